"""slime's ``--sglang-<name>`` flags, passed to megamu's SGLang servers as SGLang's own ``--<name>``.

slime adds all of SGLang's ServerArgs to its parser under the prefix ``--sglang-`` (slime
``slime/backends/sglang_utils/arguments.py:41-121``: ``ServerArgs.add_cli_args`` through a wrapper that prefixes each
flag, minus the ones slime sets itself) and hands each ``sglang_<field>`` to its servers' ServerArgs
(``slime/backends/sglang_utils/sglang_engine.py:582``). megamu's trainer imports nothing of SGLang (its servers may
run another Python), so it keeps no copy of SGLang's flags either: a ``--sglang-<name>`` that is not one of megamu's
own flags (``--sglang-tp-size``, ``--sglang-mem-fraction-static``, ... keep their meaning) goes to every server's
command line as ``--<name>`` with the words that follow it, and SGLang's own parser accepts it or refuses it at launch
(``sglang/srt/server_args.py`` ``prepare_server_args``: argparse ``parse_args``, "unrecognized arguments"), which
megamu reports with the server's log. Flags megamu sets on that command line itself are refused here by name.
"""

from __future__ import annotations

import argparse
import shlex

from megamu.engines.sglang.launch import SGLangConfig, server_command

PREFIX = "--sglang-"


def _megamu_sets() -> set[str]:
    """The flags megamu writes on every server's command line (launch.server_command), memory saver included."""
    return {w for w in server_command(SGLangConfig(memory_saver=True), "model", 0, 0, "key") if w.startswith("--")}


def split_sglang_flags(unknown: list[str]) -> tuple[list[str], list[str]]:
    """(SGLang's flags from the ``--sglang-<name> [values]`` words of ``unknown``, the other unknown words)."""
    forwarded: list[str] = []
    rest: list[str] = []
    taking = False  # the words after a --sglang-<name> are its values, up to the next flag
    for word in unknown:
        if word.startswith(PREFIX):
            forwarded.append("--" + word[len(PREFIX):])
            taking = "=" not in word
        elif taking and not word.startswith("--"):
            forwarded.append(word)
        else:
            rest.append(word)
            taking = False
    return forwarded, rest


def forward_sglang_flags(args: argparse.Namespace, unknown: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Append slime's ``--sglang-<name>`` flags to ``--sglang-server-args`` as SGLang's ``--<name>``; any other unknown
    word is an error as argparse reports it. Returns the notes to print."""
    forwarded, rest = split_sglang_flags(unknown)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if not forwarded:
        return []
    given = shlex.split(args.sglang_server_args)
    taken = {w.split("=")[0] for w in given if w.startswith("--")}
    for flag in (w.split("=")[0] for w in forwarded if w.startswith("--")):
        if flag in _megamu_sets():
            parser.error(f"{PREFIX}{flag[2:]}: megamu sets the servers' {flag} itself, from its own flags "
                         "(docs/coming-from-slime-verl.md); remove it")
        if flag in taken:
            parser.error(f"{PREFIX}{flag[2:]}: contradicts --sglang-server-args' {flag} (the same setting: give one)")
    args.sglang_server_args = shlex.join([*given, *forwarded])
    if args.rollout_engine is None:
        args.rollout_engine = "sglang"  # slime always generates with SGLang servers
    return [f"{' '.join(PREFIX + w[2:] if w.startswith('--') else w for w in forwarded)} -> the SGLang servers' "
            f"{' '.join(forwarded)} (SGLang checks them at launch)"]
