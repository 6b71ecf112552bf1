"""The checkpoint folders around checkpoint.py's torch_dist format: the iter_N folders and their tracker, retention,
every rank's RNG state, and errors gathered from every rank so that all of them raise together."""

from __future__ import annotations

import base64
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megamu.runtime import parallel
from megamu.runtime.atomic import atomic_write_text, remove_dir, replace_dir

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"  # a tracker saying "release" names save_dir/release (Megatron-LM's; slime's converter writes it)


class CheckpointError(RuntimeError):
    pass


def iteration_dir(save_dir: str | Path, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if parallel.device().is_cuda:
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    as_tensor = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
    torch.set_rng_state(as_tensor(state["torch"]))
    if "cuda" in state and parallel.device().is_cuda:
        torch.cuda.set_rng_state(as_tensor(state["cuda"]))


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _raise_any(errors: list, what: str) -> None:
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(f"{what} failed: " + "; ".join(failed))


def _iterations(save_dir: Path) -> dict[int, Path]:
    found = {}
    for d in save_dir.glob("iter_*"):
        number = d.name[len("iter_"):]
        if d.is_dir() and number.isdigit():
            found[int(number)] = d
    return found


def prune_checkpoints(save_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (0: delete none) and leftovers of interrupted saves.

    The one the tracker names is never deleted. A folder is first renamed out of the ``iter_*`` namespace, then
    removed, so a crash mid-delete leaves no half checkpoint that looks loadable. Returns the deleted folders.
    """
    save_dir = Path(save_dir)
    current = latest_iteration(save_dir)
    found = _iterations(save_dir)
    doomed = sorted(found)[:-keep] if keep > 0 else []
    doomed = [found[i] for i in doomed if i != current]
    # temp/old folders of atomic_dir and half deletions, left by a killed run (one run writes a save_dir at a time)
    doomed += [d for d in save_dir.glob(".iter_*") if d.is_dir()]
    for d in doomed:
        remove_dir(d)
    return doomed


def latest_checkpoint(load_dir: str | Path) -> tuple[int, Path] | None:
    """(iteration, folder) of the checkpoint the tracker names; None when ``load_dir`` holds no checkpoint at all.

    A tracker reading "release" names ``load_dir/release``, iteration 0, as Megatron-LM's ``read_metadata`` reads it
    (converted weights, not a run's progress)."""
    tracker = Path(load_dir) / TRACKER
    if not tracker.exists():
        if any(Path(load_dir).glob("iter_*")):
            raise CheckpointError(f"{tracker} is missing but {load_dir} holds iter_* folders; point --load at one "
                                  f"of them by writing its number into {TRACKER}")
        return None
    text = tracker.read_text().strip()
    if text == RELEASE:
        return 0, Path(load_dir) / RELEASE
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number or {RELEASE!r}, found {text!r}")
    return int(text), iteration_dir(load_dir, int(text))


def latest_iteration(load_dir: str | Path) -> int | None:
    """The iteration the tracker names (0 for "release"); None when ``load_dir`` holds no checkpoint at all."""
    found = latest_checkpoint(load_dir)
    return None if found is None else found[0]


def publish(main: bool, tmp: Path, out: Path, save_dir: str | Path, iteration: int, keep: int,
            finish: Callable[[], None], group: dist.ProcessGroup | None = None) -> Path:
    """The end of a save, in both formats: rank 0 completes the folder ``tmp`` (``finish``), puts it in place of
    ``out``, moves the tracker to it and applies retention; then every rank raises the same error if any step failed,
    so none goes on alone. The other ranks wait for rank 0's rename and retention on ``group`` (the save's gloo
    group, ``parallel.save_group``), not under the default group's collective timeout."""
    error = None
    if main:
        try:
            finish()
            replace_dir(tmp, out)
            atomic_write_text(Path(save_dir) / TRACKER, f"{iteration}\n")
            prune_checkpoints(save_dir, keep)
        except (OSError, CheckpointError) as e:
            error = str(e)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful replace
    _raise_any(parallel.all_gather_object(error, group), f"saving checkpoint {out}")
    return out
