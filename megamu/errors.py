"""The error a part's config dataclass raises for a bad value. It names the field, never a command-line flag:
``megamu.arguments`` maps fields to the flags that set them, so each part stays free of the command line."""

from __future__ import annotations


class ConfigError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
