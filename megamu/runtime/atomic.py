"""Atomic file writes: a reader (or a resumed run) sees the old file or the complete new one, never a torn one."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` fills a temporary file beside ``path``; it is fsynced, then renamed over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def remove_dir(d: Path) -> None:
    """Rename out of the visible namespace first, so a crash mid-delete leaves no half folder that looks complete."""
    trash = d if d.name.startswith(".") else d.with_name(f".{d.name}.deleting-{os.getpid()}")
    if trash != d:
        os.replace(d, trash)
    shutil.rmtree(trash)
