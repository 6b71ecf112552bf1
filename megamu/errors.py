"""The error a part's config dataclass raises for a bad value. It names the field, never a command-line flag:
``megamu.arguments`` maps fields to the flags that set them, so each part stays free of the command line.

A part names its own field (``weight_sync``); as the error leaves a parent that holds the part, the parent prefixes
its own field name (``engine.sglang.weight_sync``), so the error names the one place in the config tree it refers to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field  # dotted path from the config that raised it or holds the part that did
        self.message = message

    def within(self, parent_field: str) -> ConfigError:
        """The same error as seen from the config holding this one's config as ``parent_field``."""
        return ConfigError(f"{parent_field}.{self.field}" if parent_field else self.field, self.message)


def build_at(path: str, make: Callable[..., T], *args, **kwargs) -> T:
    """``make(*args, **kwargs)``, a part built (or rebuilt) as field ``path`` of its parent: its error names the
    dotted path."""
    try:
        return make(*args, **kwargs)
    except ConfigError as e:
        raise e.within(path) from None


def check_positive(config, *names: str) -> None:
    """Each named field of ``config`` is an integer > 0 (None allowed: "not set")."""
    for name in names:
        v = getattr(config, name)
        if v is not None and not (isinstance(v, int) and v > 0):
            raise ConfigError(name, f"must be a positive integer, got {v!r}")


def check_non_negative(config, *names: str) -> None:
    for name in names:
        v = getattr(config, name)
        if v is not None and not v >= 0:
            raise ConfigError(name, f"must be >= 0, got {v!r}")


def check_choice(config, name: str, choices) -> None:
    v = getattr(config, name)
    if v not in choices:
        raise ConfigError(name, f"must be one of {', '.join(map(str, choices))}; got {v!r}")
