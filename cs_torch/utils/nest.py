"""cstorch.utils.nest: walking nested batches and state dicts (dicts, lists, tuples) by scope.

A scope is the list of keys (as strings) from the top down to an item, as
the model zoo names a batch's tensors ("input", "labels") and flattens
checkpoints ("model", "fc1.weight").
"""
from __future__ import annotations

from collections import UserDict
from inspect import isclass


def _children(struct):
    if isinstance(struct, (dict, UserDict)):
        return [([str(k)], v) for k, v in struct.items()]
    if isinstance(struct, (list, tuple)):
        return [([str(i)], v) for i, v in enumerate(struct)]
    return None


def visit_structure(data_structure, select_fn, strict: bool = False, scope=None):
    """(scope, item) for each item of the nested structure that select_fn accepts; with strict, an item
    neither a container nor selected is a ValueError."""
    scope = list(scope or [])
    children = _children(data_structure)
    if children is not None:
        for key, value in children:
            yield from visit_structure(value, select_fn, strict, scope + key)
    elif select_fn(data_structure):
        yield scope, data_structure
    elif strict:
        raise ValueError(f"Unknown data structure: {data_structure}")


def visit_torch_tensors(data_structure, strict: bool = False, scope=None):
    """(scope, tensor) for each torch tensor of the nested structure."""
    import torch
    yield from visit_structure(data_structure, lambda item: isinstance(item, torch.Tensor), strict, scope)


def recurse_spec(spec, scope=None):
    """The scope of each leaf of a torch pytree TreeSpec, in the order tree_flatten gives the leaves."""
    if spec.num_leaves == 0:
        return
    scope = list(scope or [])
    context = spec.context
    children = spec.children() if hasattr(spec, "children") else spec.children_specs   # torch's newer name
    if context:
        if isclass(context) and issubclass(context, tuple) and hasattr(context, "_fields"):   # a named tuple
            context = range(len(context._fields))
        for key, child in zip(context, children):
            yield from recurse_spec(child, scope + [str(key)])
    elif not children:
        yield scope
    else:
        for i, child in enumerate(children):
            yield from recurse_spec(child, scope + [str(i)])
