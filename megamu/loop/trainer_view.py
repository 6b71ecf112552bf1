"""What a loop (megamu.loop.staged, megamu.loop.async_) reads and calls of the Trainer that runs it, typed once.

The Trainer (megamu.loop.trainer) picks and runs its loop, so the loops cannot import it (tests/test_structure.py
counts type-only imports in its cycle check): they take this view of it, which the Trainer matches, as do the
tests' stand-ins for it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from megamu.config.plan import Plan
    from megamu.config.run_config import RunConfig
    from megamu.data.stage_prompts import Prompts
    from megamu.engines.types import SamplingParams
    from megamu.engines.weights import Weights
    from megamu.loop.state import RunState
    from megamu.observability.metrics import MetricsLogger
    from megamu.rollout.dataset import StageDataset
    from megamu.run.run_dir import RunDir
    from megamu.training.policy import Policy


class TrainerView(Protocol):
    """The run's parts and the steps every loop shares; the engine and what it does are the loop's."""

    cfg: RunConfig
    plan: Plan  # and its mode: plan.mode
    policy: Policy
    run_dir: RunDir
    tokenizer: Any
    prompts: Prompts
    metrics: MetricsLogger
    state: RunState  # the loops read it; only the Trainer writes it
    eta_shown: bool

    def train_on(self, samples: list, bar, **fields) -> None: ...

    def stage_done(self, stage: int, dataset: StageDataset, **times: float) -> None: ...

    def show_eta(self, stage: int, t_update: float, t_rollout: float, t_eval: float) -> None: ...

    def progress_bar(self, desc: str, total: int, initial: int): ...

    def sampling(self, stage: int) -> SamplingParams: ...

    def evaluate(self, engine, scorer, stage: int, label: str, weights: Weights | None = None) -> float | None: ...

    def final_evaluation(self, engine, scorer, stage: int) -> None: ...
