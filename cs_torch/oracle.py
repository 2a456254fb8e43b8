"""Torch eager given what a run drew, for oracle comparisons (scripts/modelzoo_oracle.py, the tests).

    with torch_dropout_with_run_masks(step, rows):    # the run's seed (cstorch.manual_seed)
        loss = model(batch)                           # torch eager, the run's dropout masks
"""
from __future__ import annotations

import contextlib

import numpy as np


@contextlib.contextmanager
def torch_dropout_with_run_masks(step: int, rows: int, seed: int | None = None):
    """While inside, torch.nn.functional.dropout multiplies by the masks a traced step draws:
    kernels.sample_keep_mask of the run's seed (`seed`, else cstorch.manual_seed's, 1 by default),
    the 0-based step, the site (the k-th dropout the forward reaches) and each sample's elements in
    order; in float64 for a float64 input, else float32."""
    import torch
    from cs_runtime.numerics import kernels
    from . import session
    seed = session._seed if seed is None else seed
    site = [0]
    real = torch.nn.functional.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return x
        dtype = np.float64 if x.dtype == torch.float64 else np.float32
        mask = kernels.sample_keep_mask(seed, step, site[0], slice(0, rows), tuple(x.shape), p, dtype)
        site[0] += 1
        return x * torch.from_numpy(mask)
    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = real
