"""Torch eager given what a run drew, for oracle comparisons (scripts/modelzoo_oracle.py, the tests).

    with torch_dropout_with_run_masks(step, rows):    # the run's seed (cstorch.manual_seed)
        loss = model(batch)                           # torch eager, the run's dropout masks
    with torch_random_with_run_draws(step, seed=0):   # a ShardContext's seed
        loss = model(batch)                           # torch.randn_like & co. give the run's draws
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


@contextlib.contextmanager
def torch_random_with_run_draws(step: int, seed: int | None = None):
    """While inside, torch.rand, randn, randperm, rand_like and randn_like return what a
    captured program draws for the whole batch of `step` (kernels.sample_draws of the run's
    seed, the site: the k-th draw the forward reaches). On the whole batch a draw that follows
    it and one that does not are the same numbers (row r's elements are the counters after
    row r-1's), so each is drawn here as one row."""
    import torch
    from cs_runtime.numerics import kernels
    from . import session
    seed = session._seed if seed is None else seed
    site = [0]
    real = {name: getattr(torch, name) for name in ("rand", "randn", "randperm", "rand_like", "randn_like")}

    def draw(dist, shape, dtype):
        numpy_dtype = {torch.float64: np.float64, torch.int64: np.int64}.get(dtype, np.float32)
        values = kernels.sample_draws(seed, step, site[0], slice(0, 1), tuple(shape), dist, numpy_dtype)
        site[0] += 1
        return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)

    def sized(dist):
        def make(*size, dtype=None, **_):
            shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            return draw(dist, shape, dtype or torch.get_default_dtype())
        return make

    def like(dist):
        return lambda x, dtype=None, **_: draw(dist, x.shape, dtype or x.dtype)
    patched = {"rand": sized("uniform"), "randn": sized("normal"), "rand_like": like("uniform"),
               "randn_like": like("normal"),
               "randperm": lambda n, dtype=torch.int64, **_: draw("permutation", (n,), dtype)}
    for name, fn in patched.items():
        setattr(torch, name, fn)
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(torch, name, fn)
