"""Atomic file and folder writes: a reader (or a resumed run) sees the old file or folder or the complete new one,
never a torn one."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
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


def make_temp_dir(out_dir: str | Path) -> Path:
    """An empty temp folder beside ``out_dir``, to be moved into place by ``replace_dir``."""
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; engines may run as another user
    return tmp


def replace_dir(tmp: Path, out_dir: str | Path) -> None:
    """Move the complete ``tmp`` to ``out_dir``; an old ``out_dir`` is removed only after the new one is in place."""
    out = Path(out_dir).absolute()
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield an empty temp folder beside ``out_dir``; on success it replaces ``out_dir`` (old one removed only after
    the new one is in place), on error it is deleted. A reader never sees a half-written ``out_dir``."""
    tmp = make_temp_dir(out_dir)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out_dir)
