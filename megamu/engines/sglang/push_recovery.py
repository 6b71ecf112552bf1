"""A colocated refresh that survives one fault (issue 50): ~1000 refreshes in a run, each a chance for one.

What each fault gets (ColocatedSGLang runs it; pool.py retries the control calls themselves):
- a failed push (a bucket refused, a server that does not report the new version, a timed-out or dropped call) is
  sent once more, through a new weight-sync group (the old one may have lost a member mid-broadcast);
- failing again, rank 0 writes θ_k from the tensors it holds as an HF folder beside the launch export, reads back
  that every tensor is there whole, and every server reloads it with ``/update_weights_from_disk`` (no process group
  needed); a failed reload stops the run. The folder is checked first because SGLang cannot survive one it cannot
  read: ``update_weights_from_disk`` points its model config at the new folder before loading
  (model_runner_components/weight_updater.py:193) and its "Rolling back to original weights" reloads from that same
  config (:229-238), so the load fails twice and the scheduler dies (the CPU build, 0.5.23, with a truncated shard:
  SIGQUIT, the server gone; tests/sglang_real/test_real_push_recovery.py);
- a probe whose log-probs differ from the trainer's is pushed once more and probed again; differing again, the run
  stops, naming the probe's worst token (the weights the servers serve are not the trainer's: training on their
  samples would be wrong).
A layout mismatch (weights that do not fit the running model) is refused before anything is sent and stops at once:
it would be refused again. slime recovers a dead server the same way, a fresh one from the HF checkpoint and then
the current weights pushed into it (slime/ray/rollout.py:286-320 ``recover``, :553-563 before each weight update).
"""

from __future__ import annotations

import http.client
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from megamu.engines.sglang.schema import SGLangError
from megamu.engines.sglang.weight_sync import ProbeMismatch, WeightMismatch

# What a push that may succeed when sent again raises: SGLangError (a RuntimeError) for refused or failed calls, a
# RuntimeError for a server reporting another version, OSError/HTTPException for a broken connection. WeightMismatch
# (a ValueError) is not one: the layout check refuses the same weights every time.
PUSH_FAULTS = (RuntimeError, OSError, http.client.HTTPException)
RECOVERY_DIR = "sglang_recovery"  # beside the launch export, as sglang_logs/; no config.json: not an export

T = TypeVar("T")
Note = Callable[[str, BaseException], None]  # (what happened, the error): logged as a "sync_fault" record


def push_surviving_one_fault(first: Callable[[], T], again: Callable[[], T], reset: Callable[[], None],
                             reload: Callable[[], T] | None, note: Note) -> T:
    """``first()`` (a push, or the probe of one), then as the module's docstring says: ``again()`` (the same
    weights pushed once more) after a failure (``reset()`` first: a new weight-sync group) or a probe mismatch, then
    after a second failure ``reload()`` from disk (None: nothing to reload from, the run stops)."""
    try:
        return first()
    except ProbeMismatch as e:
        note("probe mismatch: pushing again", e)
        try:
            return again()
        except ProbeMismatch as twice:
            raise SGLangError(f"the servers' log-probs differ from the trainer's after the push and again after a "
                              f"second one: stopping (the weights they serve are not the trainer's): {twice}"
                              ) from twice
    except WeightMismatch:
        raise
    except PUSH_FAULTS as e:
        note("push failed: pushing again", e)
    reset()
    try:
        return again()
    except (ProbeMismatch, *PUSH_FAULTS) as e:
        if reload is None:
            raise SGLangError(f"the weight push failed twice and there is no copy to reload from: {e}") from e
        note("push failed again: reloading the servers from an HF export of the same weights", e)
    try:
        return reload()
    except (WeightMismatch, *PUSH_FAULTS) as e:
        raise SGLangError(f"the weight push failed twice and the servers could not reload the same weights from "
                          f"disk: stopping: {e}") from e


def write_recovery_export(tensors: dict, launch_folder: Path, stage: int) -> Path:
    """θ_k's HF-named ``tensors`` as an HF folder ``sglang_recovery/stage_<k>`` beside ``launch_folder`` (whose
    config and tokenizer files it copies; the running servers were launched from it), written under a temporary name
    and renamed into place; older recovery folders are removed (a restarted server loads the newest,
    ServerWeights.folder). tools/evaluate.py --run does not take it for an export (no config.json at its top)."""
    from megamu.convert.io import write_sharded

    parent = launch_folder.parent / RECOVERY_DIR
    final, tmp = parent / f"stage_{stage:04d}", parent / f".stage_{stage:04d}.tmp"
    for stale in (tmp, final):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in launch_folder.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, tmp / f.name)
    write_sharded(sorted(tensors.items()), tmp)
    _check_whole(tmp, tensors)
    tmp.rename(final)
    for old in parent.iterdir():
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _check_whole(folder: Path, tensors: dict) -> None:
    """Every tensor of ``tensors`` is in ``folder`` with its shape, and every file holds the bytes its header names;
    OSError otherwise (a push fault: the recovery stops the run rather than hand SGLang a folder it would die on)."""
    from megamu.convert.io import SafetensorsDir

    found = SafetensorsDir(folder)
    wrong = [n for n, t in tensors.items() if n not in found or found.entries[n][2]["shape"] != list(t.shape)]
    ends: dict[Path, int] = {}
    for path, start, entry in found.entries.values():
        ends[path] = max(ends.get(path, 0), start + entry["data_offsets"][1])
    short = [p.name for p, end in sorted(ends.items()) if p.stat().st_size < end]
    if wrong or short:
        raise OSError(f"{folder}: the recovery export is not whole (tensors missing or reshaped: {wrong[:3]}; files "
                      f"shorter than their headers: {short[:3]}): no server is asked to load it")
