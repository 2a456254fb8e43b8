"""cstorch.core.annotation: attributes a model attaches to the ops of a region (a kernel's name,
a recompute hint), for the real compiler.

    @create_annotation(MyConfig, get_attribute, name="x", enable_fwd=True, enable_bwd=True)
    def region(...): ...            # or: with create_annotation(...): ...

The emulator's compiler takes the ops as torch.export gives them and chooses no kernel by
attribute, so an annotation validates its config and leaves the numbers as they are.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable


class AnnotationMode:
    @dataclass
    class Config:   # no defaults: a subclass's own fields (name: Optional[str]) come after these
        enable_fwd: bool
        enable_bwd: bool

    @dataclass
    class Attribute:
        name: str
        value: Any


class _Annotation(contextlib.ContextDecorator):
    def __init__(self, config: AnnotationMode.Config, get_attribute: Callable):
        self.config, self.get_attribute = config, get_attribute

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __call__(self, fn):
        # A decorated function runs as it is; the wrapper keeps its name for the model's source lines.
        return functools.wraps(fn)(super().__call__(fn))


def create_annotation(config_class: type, get_attribute: Callable, enable_fwd: bool = True,
                      enable_bwd: bool = True, **kwargs) -> _Annotation:
    if not (isinstance(config_class, type) and issubclass(config_class, AnnotationMode.Config)):
        raise TypeError(f"create_annotation: {config_class!r} is not an AnnotationMode.Config")
    config = config_class(enable_fwd=enable_fwd, enable_bwd=enable_bwd, **kwargs)
    for is_backward in (False, True):   # the attributes must be makeable, as the real compiler makes them
        attribute = get_attribute(config, is_backward)
        if not isinstance(attribute, AnnotationMode.Attribute):
            raise TypeError(f"create_annotation: {getattr(get_attribute, '__name__', get_attribute)} returned "
                            f"{type(attribute).__name__}, not an AnnotationMode.Attribute")
    return _Annotation(config, get_attribute)
