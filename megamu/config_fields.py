"""Config fields that carry their command-line spelling: ``flag(...)`` is a ``dataclasses.field`` whose metadata holds
the flag's names, help and argparse details (``FlagSpec``); ``derived(source)`` marks a field no flag of its own sets
and says where its value comes from. megamu.arguments generates the parser from the first and maps a config error's
field to its flag through both; nothing else reads them, so a part stays usable (and checked) without a parser."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any


@dataclass(frozen=True)
class FlagSpec:
    names: tuple[str, ...]  # the flag and its aliases, e.g. ("--prompt-key", "--input-key")
    help: str | None = None
    argparse: dict[str, Any] = field(default_factory=dict)  # type, choices, action, metavar; a "default" of its own

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value under (its first long name's)."""
        return self.argparse.get("dest") or self.names[0].lstrip("-").replace("-", "_")


def flag(*names: str, default: Any = MISSING, default_factory: Any = MISSING, flag_default: Any = MISSING,
         help: str | None = None, **argparse: Any) -> Any:
    """A config field set by the flag ``names[0]`` (aliases after it). ``argparse``: add_argument's other keywords
    (``action="optional_bool"``: --x / --no-x).
    The flag's default is the field's, unless ``flag_default`` gives one of its own (e.g. for a field without one).
    A field made by ``default_factory`` (a list, a dict) needs one: its flag is a string the parser converts."""
    if default_factory is not MISSING and flag_default is MISSING:
        raise TypeError(f"{names[0]}: a field with a default_factory needs a flag_default")
    if flag_default is not MISSING:
        argparse["default"] = flag_default
    return field(default=default, default_factory=default_factory,
                 metadata={"flag": FlagSpec(tuple(names), help, argparse)})


def derived(source: str, *, default: Any = None, default_factory: Any = MISSING, kw_only: Any = MISSING) -> Any:
    """A field no flag of its own sets: the run works it out from ``source``, either the dotted path in RunConfig's
    tree of the field that holds the quantity (RunConfig.derive passes it down; a copy must agree with it), or the
    flag (``--...``) that megamu.arguments converts into it (a flag whose spelling is not the field's value: a list
    of files, a choice of preset or mode, slime's launch shape). An error about the field names that source's flag."""
    if default_factory is not MISSING:
        default = MISSING
    return field(default=default, default_factory=default_factory, kw_only=kw_only, metadata={"source": source})


def field_source(config_cls: type, name: str) -> str | None:
    """Where the value of field ``name`` of ``config_cls`` comes from, if it is ``derived``."""
    f = getattr(config_cls, "__dataclass_fields__", {}).get(name)
    return f.metadata.get("source") if f is not None else None


def flag_spec(config_cls: type, name: str) -> FlagSpec | None:
    """The flag of field ``name`` of ``config_cls``, if it carries one."""
    f = getattr(config_cls, "__dataclass_fields__", {}).get(name)
    return f.metadata.get("flag") if f is not None else None
