"""Log settings as the model zoo sets them: `wsc_logger` (the cluster's servers'
levels, --wsc_log_level), `get_level_name`, `ClassLogger`."""
from __future__ import annotations

import logging

wsc_logger = logging.getLogger("wsc")
# The real client's extra levels, below DEBUG: verbose and trace.
VERBOSE = 5
TRACE = 1
logging.addLevelName(VERBOSE, "VERBOSE")
logging.addLevelName(TRACE, "TRACE")


def get_level_name(level) -> int:
    """'info' / 'INFO' / 20 / '20' -> 20; anything else is one line naming it."""
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    if isinstance(level, str):
        if level.isdigit():
            return int(level)
        value = logging.getLevelName(level.upper())
        if isinstance(value, int):
            return value
    raise ValueError(f"invalid logging level {level!r}: expected a level name (e.g. INFO) or a number")


def collect_wsc_log_settings() -> dict[str, int]:
    """The levels set on wsc_logger and its children, {'' or task: level}."""
    settings = {"": wsc_logger.level} if wsc_logger.level else {}
    prefix = wsc_logger.name + "."
    for name, item in logging.Logger.manager.loggerDict.items():
        if name.startswith(prefix) and isinstance(item, logging.Logger) and item.level:
            settings[name[len(prefix):]] = item.level
    return settings


class ClassLogger:
    """A class decorator's base: gives the class a `logger` named after it."""

    def __init__(self, cls=None, name: str | None = None):
        self.name = name
        if cls is not None:
            cls.logger = logging.getLogger(name or f"{cls.__module__}.{cls.__qualname__}")


def named_class_logger(name: str | None = None):
    """@named_class_logger("x") sets cls.logger = logging.getLogger("x")."""
    def decorate(cls):
        cls.logger = logging.getLogger(name or f"{cls.__module__}.{cls.__qualname__}")
        return cls
    if isinstance(name, type):   # used without arguments
        cls, name = name, None
        return decorate(cls)
    return decorate
