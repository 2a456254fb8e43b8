"""cstorch.utils.data.SyntheticDataset: samples made from a spec, for runs without real data.

Each sample is the spec's tree (lists, tuples, dicts, named tuples) with
each tensor leaf cloned and each callable leaf called with the sample's
index, num_samples of them (forever when None), as the real API documents.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class SyntheticDataset(torch.utils.data.IterableDataset):
    def __init__(self, sample_spec, num_samples: int | None = None):
        super().__init__()
        self._leaves, self._tree = tree_flatten(sample_spec)
        if not self._leaves:
            raise ValueError("`sample_spec` must be a non-empty python tree of `torch.Tensor` or `Callable`.")
        for leaf in self._leaves:
            if not isinstance(leaf, torch.Tensor) and not callable(leaf):
                raise ValueError(f"`sample_spec` is expected to contain a python tree of `torch.Tensor`, or "
                                 f"`Callable`, but got an item of type `{type(leaf)}`.")
        if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)):
            raise TypeError(f"`num_samples` must be a positive integer or None, but got a value of type "
                            f"`{type(num_samples)}`.")
        if num_samples is not None and num_samples <= 0:
            raise ValueError(f"`num_samples` must be a positive integer, but got `{num_samples}`.")
        self._num_samples = num_samples

    def __iter__(self):
        index = 0
        while self._num_samples is None or index < self._num_samples:
            leaves = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf(index) for leaf in self._leaves]
            yield tree_unflatten(leaves, self._tree)
            index += 1

    def __len__(self) -> int:
        if self._num_samples is None:
            raise TypeError("`SyntheticDataset` does not have a length because `num_samples` was not provided.")
        return self._num_samples
