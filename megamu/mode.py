"""The rollout mode (--rollout-mode), one object chosen once from its name: staged (§4), colocated (the fair
standard-GRPO baseline) or async (§5.1).

The run holds its mode once, in its plan (megamu.config.plan: ``plan.mode``, one plan type per family of modes, which
also answers what needs the plan's counts: the checkpoint and log cadence, where a resumed run starts). Everything
else that depends on the mode is asked of its ``Mode``: how the engine lives across stages (``lifecycle``), what the
config derives from it (where servers sit, which weight pushes it allows, whether the trainer offloads), and which HF
exports may go when. No other module compares a mode name (tests/test_structure.py scans for it); ``mode_of`` is the
one place a name becomes a ``Mode``, and ``DEFAULT_MODE`` the one place the default is written.

This module imports nothing of the loop or the trainer (the config tree and the memory plan ask it too); the
lifecycles it builds come from megamu.engines.lifecycle, imported when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megamu.errors import ConfigError

if TYPE_CHECKING:
    from megamu.engines import EngineConfig
    from megamu.engines.lifecycle import EngineLifecycle, Log
    from megamu.run.run_dir import RunDir


@dataclass(frozen=True)
class Mode:
    """One rollout mode. ``streams``: an engine process generates while the trainer trains (no stages, no static
    dataset); ``keeps_engine_up``: the engine starts once on the trainer's devices and later stages refresh it in
    place; neither: each stage starts an engine on θ_k's HF folder and stops it once D_k is written."""

    name: str
    streams: bool
    keeps_engine_up: bool

    # -- what the config derives from the mode
    @property
    def has_stages(self) -> bool:
        """Stages of μ updates on a static dataset D_k (staged and colocated)."""
        return not self.streams

    @property
    def restarts_engine(self) -> bool:
        """A new engine every stage: its servers exit before the trainer updates and saves."""
        return not self.streams and not self.keeps_engine_up

    @property
    def shares_trainer_devices(self) -> bool:
        """The engine's servers sit on the trainer's devices while it trains (colocated): they may give their memory
        back, and take pushes in memory. Staged servers start after the trainer offloaded; async ones have GPUs of
        their own."""
        return self.keeps_engine_up

    @property
    def trainer_offloads(self) -> bool:
        """The trainer gives the device to the engine for each rollout (staged and colocated take turns with it)."""
        return not self.streams

    def weight_push(self, engine_kind: str | None, weight_sync: str) -> str | None:
        """How later stages' weights reach a kept-up engine ("memory" or "disk"); None where no push happens (a
        staged engine starts from each stage's folder, an async one reloads folders of its own)."""
        if not self.keeps_engine_up:
            return None
        return weight_sync if engine_kind == "sglang" else "memory"

    def releases_during_training(self, engine_kind: str | None, memory_saver: bool) -> bool:
        """SGLang servers with the memory saver give their memory back while the trainer trains: only colocated ones
        are up then."""
        return engine_kind == "sglang" and self.keeps_engine_up and memory_saver

    # -- the engine across stages
    def lifecycle(self, cfg: EngineConfig, log: Log | None = None,
                  probe_ids: list[int] | None = None) -> EngineLifecycle:
        """How this mode's engine lives across stages, for the engine of ``cfg``. ``log`` takes the "sync" records of
        checked pushes; ``probe_ids`` is the prompt whose log-probs check each SGLang push. Async mode's engine is a
        process of its own (megamu.loop.engine_process.EngineProcess), started by the async loop: no stage lifecycle."""
        from megamu.engines.lifecycle import ColocatedLocal, RestartEachStage

        if self.streams:
            raise ValueError(f"the {self.name} mode's engine is a process of its own, not a stage lifecycle")
        if not self.keeps_engine_up:
            return RestartEachStage(cfg, log, probe_ids)
        if cfg.kind == "local":
            return ColocatedLocal(cfg, log, probe_ids)
        from megamu.engines.sglang.colocated import ColocatedSGLang

        return ColocatedSGLang(cfg, log, probe_ids)

    # -- HF export retention (the run directory's folders the engine loads)
    def prune_before_start(self, run_dir: RunDir) -> None:
        """No engine is up yet: exports a killed run kept for one go (rank 0). Staged modes: every hf/stage_k whose
        D_k is durable (a resume skips that rollout); async: every sync folder, whose versions past the checkpoint
        came from a lost timeline (same names, other weights)."""
        if self.streams:
            run_dir.prune_sync_exports()
        else:
            run_dir.prune_done_stage_exports()

    def prune_after_rollout(self, run_dir: RunDir, stage: int, engine_keeps_it: bool) -> None:
        """D_k is durable: hf/stage_k goes (rank 0), unless the running servers were launched from it (their
        restarts load it; it goes at the run's end, ``prune_at_end``)."""
        if not engine_keeps_it:
            run_dir.prune_stage_export(stage)

    def prune_at_end(self, run_dir: RunDir) -> None:
        """Every engine is stopped: the export colocated servers were launched from goes (rank 0)."""
        if self.has_stages:
            run_dir.prune_done_stage_exports()

    def prune_iter_exports(self, run_dir: RunDir, keep: int) -> None:
        """After an --hf-export-interval export (rank 0), every mode: the newest ``keep`` (--keep-hf-exports, by
        default --keep-checkpoints) stay."""
        run_dir.prune_iter_exports(keep=keep)

    def prune_after_sync(self, run_dir: RunDir, loaded_version: int, keep) -> None:
        """Async: sync folders below the version the engine process serves (it never goes back), except ``keep``."""
        run_dir.prune_sync_exports(below=loaded_version, keep=keep)


STAGED = Mode("staged", streams=False, keeps_engine_up=False)
COLOCATED = Mode("colocated", streams=False, keeps_engine_up=True)
ASYNC = Mode("async", streams=True, keeps_engine_up=False)
MODES = {m.name: m for m in (STAGED, COLOCATED, ASYNC)}
MODE_NAMES = tuple(MODES)
DEFAULT_MODE = STAGED  # --rollout-mode's default, and a plan built in code without one


def mode_of(name: str, field: str = "rollout_mode") -> Mode:
    """The mode named ``name`` (--rollout-mode); ConfigError on ``field`` for any other name."""
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise ConfigError(field, f"{name!r}: expected one of {MODE_NAMES}") from None
