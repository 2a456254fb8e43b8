"""cstorch.utils.nest: walking a nested batch (lists, tuples, dicts) to its leaves.

    for scope, tensor in visit_torch_tensors(batch, scope=["input"]):
        ...   # scope: the keys and indices that lead to the tensor, e.g. ["input", "0"]

The model zoo's run flow logs its input summaries with these. torch is only
imported when a torch tensor is asked for, so this module stays torch-free.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator


def visit_structure(data: Any, select_fn: Callable[[Any], bool], strict: bool = False,
                    scope: list[str] | None = None) -> Iterator[tuple[list[str], Any]]:
    """(scope, leaf) for every leaf `select_fn` selects, in the order of the structure; with
    `strict`, a leaf it does not select is an error."""
    scope = list(scope or [])
    if isinstance(data, (list, tuple)):
        for index, value in enumerate(data):
            yield from visit_structure(value, select_fn, strict, scope + [str(index)])
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from visit_structure(value, select_fn, strict, scope + [str(key)])
    elif select_fn(data):
        yield scope, data
    elif strict:
        raise ValueError(f"unknown data structure: {type(data).__name__} at {'.'.join(scope) or 'top'}")


def visit_torch_tensors(data: Any, strict: bool = False, scope: list[str] | None = None):
    """(scope, tensor) for every torch tensor in `data`."""
    import torch
    yield from visit_structure(data, lambda leaf: isinstance(leaf, torch.Tensor), strict, scope)


def recurse_spec(spec: Any, scope: list[str] | None = None) -> Iterator[list[str]]:
    """The scope of every leaf of a structure, in the order visit_structure walks it."""
    for leaf_scope, _ in visit_structure(spec, lambda leaf: True, scope=scope):
        yield leaf_scope
