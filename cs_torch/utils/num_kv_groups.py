"""cstorch.utils.num_kv_groups.groups_annotater: tells the real compiler how many key/value head
groups an attention matmul has. A hint for kernel placement only: the op is returned as it is."""
from __future__ import annotations


def groups_annotater(num_kv_groups):
    if num_kv_groups is not None and (isinstance(num_kv_groups, bool) or not isinstance(num_kv_groups, int)
                                      or num_kv_groups < 1):
        raise ValueError(f"groups_annotater: num_kv_groups must be a positive integer or None, "
                         f"got {num_kv_groups!r}")
    return lambda fn: fn
