"""The error a part's config dataclass raises for a bad value. It names the field, never a command-line flag:
``megamu.arguments`` maps fields to the flags that set them, so each part stays free of the command line."""

from __future__ import annotations


class ConfigError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


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
