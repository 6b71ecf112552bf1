"""The parser generated from the config tree: each field made with ``megamu.config_fields.flag`` adds its own flag
(``add_fields``) and is read back by name (``field_values``); megamu.arguments.flag_errors maps a config error's field
to its flag from the same declarations."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from megamu.config_fields import flag_spec


def add_fields(group, config_cls: type, only: Sequence[str] | None = None) -> None:
    """A flag for each field of ``config_cls`` that carries one: the fields ``only`` names, in its order (a group may
    hold flags of several parts), else all, in field order."""
    by_name = {f.name: f for f in dataclasses.fields(config_cls)}
    for name in only or by_name:
        spec = flag_spec(config_cls, name)
        if spec is None:
            continue
        kw = {"default": by_name[name].default, **spec.argparse}
        if kw.get("action") == "optional_bool":  # --x / --no-x (parts name it without importing argparse)
            kw["action"] = argparse.BooleanOptionalAction
        if spec.help is not None:
            kw["help"] = spec.help
        group.add_argument(*spec.names, **kw)


def field_values(config_cls: type, args: argparse.Namespace) -> dict:
    """The flag-carrying fields of ``config_cls`` as ``args`` holds them: keyword arguments for ``config_cls``."""
    return {f.name: getattr(args, spec.dest) for f in dataclasses.fields(config_cls)
            if (spec := flag_spec(config_cls, f.name)) is not None}
