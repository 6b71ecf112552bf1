"""The run's progress: what every checkpoint carries besides the weights and the optimiser, typed at both ends."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class QueueCursor:
    """Async mode's place in its durable queue (megamu.loop.async_): what a resumed run continues from."""

    cursor: int = 0  # queue position of the next group to consume
    dropped_stale: int = 0  # samples dropped for lag > K (cumulative over the run)
    idle_s: float = 0.0  # time the trainer waited for samples
    busy_s: float = 0.0  # everything else it did


@dataclass
class RunState:
    """The run's progress, saved in every checkpoint and given back on resume."""

    stage: int = 0  # the stage being trained (staged modes)
    update: int = 0  # optimiser updates done in the whole run
    elapsed: float = 0.0  # run time so far, over every resumed process
    queue: QueueCursor | None = None  # async mode only

    def state_dict(self) -> dict:
        return {"stage": self.stage, "update": self.update, "elapsed": self.elapsed,
                "rollout": asdict(self.queue) if self.queue else {}}

    def load_state_dict(self, d: dict) -> None:
        """``d`` as ``state_dict`` made it (checkpoints older than RunState have "update_in_stage" and "iteration",
        the run's update count, in place of "update")."""
        self.stage, self.elapsed = d["stage"], d["elapsed"]
        self.update = d["update"] if "update" in d else d["iteration"]
        self.queue = QueueCursor(**d["rollout"]) if d.get("rollout") else None
