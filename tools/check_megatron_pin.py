"""Fail an image build whose `megatron.core` is not Megatron-LM at the pinned commit.

The Dockerfile runs it twice: after installing the checkout, and after installing megamu (the step that could replace
it: pip swaps an installed distribution whose version does not satisfy a requirement for the newest release).

    python tools/check_megatron_pin.py --source /opt/Megatron-LM --commit <sha> --version 0.16.0rc0
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path


class PinMismatch(RuntimeError):
    """The megatron-core that imports is not the pinned one."""


def installed_megatron_core() -> tuple[str, str, Path]:
    """(megatron.core's own __version__, the installed distribution's version, the package's directory)."""
    package_info = importlib.import_module("megatron.core.package_info")
    core = importlib.import_module("megatron.core")
    return package_info.__version__, importlib.metadata.version("megatron-core"), Path(core.__file__).resolve().parent


def checkout_commit(source: Path) -> str:
    return subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


def check_megatron_pin(source: Path, commit: str, version: str) -> str:
    """Raise PinMismatch naming what differs; return a one-line summary when all agree."""
    own_version, dist_version, package_dir = installed_megatron_core()
    problems = []
    if own_version != version:
        problems.append(f"megatron.core.package_info.__version__ is {own_version}, the pin is {version}")
    if dist_version != version:
        problems.append(f"pip's megatron-core is {dist_version}, the pin is {version} (was the checkout replaced?)")
    source = source.resolve()
    if not package_dir.is_relative_to(source):
        problems.append(f"megatron.core imports from {package_dir}, not from the checkout {source}")
    else:
        head = checkout_commit(source)
        if head != commit:
            problems.append(f"{source} is at {head}, the pin is {commit}")
    if problems:
        raise PinMismatch("; ".join(problems))
    return f"megatron-core {version} from {source} @{commit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="the Megatron-LM checkout installed with -e")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--version", required=True, help="megatron/core/package_info.py's version at --commit")
    args = parser.parse_args(argv)
    try:
        print(check_megatron_pin(args.source, args.commit, args.version))
    except PinMismatch as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
