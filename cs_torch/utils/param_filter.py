"""cstorch.utils.utils (the real package's module of that name): parameters picked by name.

    make_param_filter(["*decoder*dense*weight", "*embedding*weight"])(name, param) -> bool

A pattern is a glob (fnmatch's syntax: `*`, `?`, `[!1]`) matched against the whole dotted
parameter name.
"""
from __future__ import annotations

import fnmatch
import re
from typing import Callable, Union

FilterCallable = Callable[[str, "torch.Tensor"], bool]  # noqa: F821 (torch: only named)


def convert_glob_to_regex(pattern: Union[str, re.Pattern]) -> re.Pattern:
    """The compiled regex of a glob that matches whole names (`.search` on it is a full match)."""
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise TypeError(f"convert_glob_to_regex: expected a glob string, got {type(pattern).__name__}")
    return re.compile("^" + fnmatch.translate(pattern))


def make_param_filter(patterns) -> FilterCallable:
    """A filter (name, param) -> bool: True when the name matches one of the globs; a filter
    callable given is returned as it is."""
    if callable(patterns):
        return patterns
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    compiled = [convert_glob_to_regex(p) for p in patterns]
    return lambda name, param=None: any(p.search(name) for p in compiled)
