"""The run's shape, printed by --dry-run, and its mode, held once: ``StagedPlan`` (staged and colocated modes: stages of
μ updates on a static dataset each) or ``AsyncPlan`` (async mode: updates on a stream, no stages); ``plan_type`` says
which a mode name takes. ``Plan`` is either; both answer ``rollout_mode`` (the name, as checkpoints store it),
``mode`` (its megamu.mode.Mode), ``mu``, ``num_stages`` (None in async mode), ``total_updates``, the cadences that
need those counts (``checkpoint_due``, ``log_due``), where a resumed run stands (``stage_complete``, ``where``),
``summary()``, ``describe()`` and ``json_line()``."""

from __future__ import annotations

import json
from dataclasses import dataclass

from megamu.algo import AlgoConfig
from megamu.config_fields import derived, flag
from megamu.errors import ConfigError, check_positive
from megamu.mode import DEFAULT_MODE, Mode, mode_of


def stage_counts(prompts_per_stage: int | None, prompts_per_update: int | None, mu: int | None,
                 num_stages: int | None, train_iters: int | None) -> tuple[int, int, int]:
    """(num_stages, B_mini, μ) from any two of B_train, B_mini, μ (B_train = μ · B_mini) and at most one of
    num_stages, train_iters (= num_stages · μ). What is not given is StagedPlan's default (the CPU demo's: 4 prompts
    per update, μ = 16, 2 stages), so the flags and a plan built in code agree."""
    demo = StagedPlan()
    b_train, b_mini = prompts_per_stage, prompts_per_update
    for name, v in (("prompts_per_stage", b_train), ("prompts_per_update", b_mini), ("mu", mu),
                    ("num_stages", num_stages), ("train_iters", train_iters)):
        if v is not None and v <= 0:
            raise ConfigError(name, f"must be a positive integer, got {v}")
    given = sum(v is not None for v in (b_train, b_mini, mu))
    if given == 0:
        b_mini, mu = demo.prompts_per_update, demo.mu
    elif given == 1 and b_mini is None:
        b_mini = demo.prompts_per_update if b_train is None else min(demo.prompts_per_update, b_train)
    elif given == 1:
        mu = demo.mu
    if b_train is None:
        b_train = mu * b_mini
    elif b_mini is None:
        if b_train % mu:
            raise ConfigError("mu", f"prompts per stage {b_train} is not divisible by μ = {mu}")
        b_mini = b_train // mu
    if b_train % b_mini:
        raise ConfigError("prompts_per_update", f"prompts per stage {b_train} is not a multiple of {b_mini}")
    if mu is not None and mu * b_mini != b_train:
        raise ConfigError("mu", f"μ = {mu} contradicts {b_train} prompts per stage / {b_mini} per update")
    mu = b_train // b_mini
    if train_iters is not None:
        if train_iters % mu:
            raise ConfigError("train_iters", f"{train_iters} is not a multiple of μ = {mu}")
        if num_stages not in (None, train_iters // mu):
            raise ConfigError("train_iters", f"{train_iters} contradicts {num_stages} stages x μ = {mu}")
        num_stages = train_iters // mu
    return (demo.num_stages if num_stages is None else num_stages), b_mini, mu


@dataclass(frozen=True, kw_only=True)
class PlanBase:
    """What every plan has: B_mini prompts per update, G samples per prompt, the response bound, the algorithm.
    G and the response bound are the run's, stored here only (RunConfig passes them to the rollout and the prompts);
    ``algorithm`` is the name of the run's AlgoConfig, filled in by RunConfig.derive (the plan's summary prints it)."""

    prompts_per_update: int = flag("--prompts-per-update", default=4, flag_default=None, type=int,
                                   help="B_mini: prompt groups per optimiser update")
    n_samples_per_prompt: int = flag("--n-samples-per-prompt", default=8, type=int, help="G")
    max_response_len: int = flag("--rollout-max-response-len", default=64, type=int)
    algorithm: str | None = derived("algo.name")

    def __post_init__(self):
        check_positive(self, "prompts_per_update", "n_samples_per_prompt", "max_response_len")

    @property
    def mode(self) -> Mode:
        """The run's mode (``rollout_mode`` is its name, as the plan's dict in a checkpoint keeps it)."""
        return mode_of(self.rollout_mode)

    def summary(self) -> dict:
        """Every count the plan implies (``rollout_mode``, ``total_updates``, ``weight_syncs``: the subclass's)."""
        return {"prompts_per_update": self.prompts_per_update, "n_samples_per_prompt": self.n_samples_per_prompt,
                "max_response_len": self.max_response_len, "algorithm": self.algorithm,
                "rollout_mode": self.rollout_mode, "total_updates": self.total_updates,
                "total_samples": self.total_updates * self.prompts_per_update * self.n_samples_per_prompt,
                "weight_syncs": self.weight_syncs}

    def shape(self) -> list[tuple[str, object]]:
        raise NotImplementedError

    def describe(self, algo: AlgoConfig, precision: str, device: str = "") -> str:
        rows = self.shape() + [("rollout mode", self.rollout_mode), ("training precision", precision),
                               ("algorithm", f"{self.algorithm} {algo.describe()}")] + (
            [("device", device)] if device else [])
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)

    def json_line(self) -> str:
        return "plan: " + json.dumps(self.summary())


@dataclass(frozen=True, kw_only=True)
class StagedPlan(PlanBase):
    """Staged and colocated modes: ``num_stages`` stages of μ updates on B_train = μ · B_mini prompts each, one
    weight sync per stage. The defaults are the CPU demo's (``stage_counts`` with no count given)."""

    # the flags' None: worked out from the counts given (any two of B_train, B_mini, μ, the stages: stage_counts)
    num_stages: int = flag("--num-stages", default=2, flag_default=None, type=int,
                           help="default 2 (or --train-iters / μ)")
    mu: int = flag("--mu", default=16, flag_default=None, type=int, help="updates per stage, μ = B_train / B_mini")
    rollout_mode: str = derived("--rollout-mode", default=DEFAULT_MODE.name)  # the flag also picks the plan

    def __post_init__(self):
        super().__post_init__()
        if not self.mode.has_stages:  # ConfigError for a name that is no mode
            raise ConfigError("rollout_mode", f"{self.rollout_mode!r} has no stages: its plan is an AsyncPlan")
        check_positive(self, "num_stages", "mu")

    def checkpoint_due(self, update: int, interval: int) -> bool:
        """Whether the update that brings the run to ``update`` updates saves a checkpoint (``interval``:
        --save-interval). A restarted engine's stages: every ``interval`` updates of a stage and at each stage's end
        (a resume then skips the stage's rollout). An engine refreshed every μ (= 4) updates (colocated): every
        ``interval`` updates of the run and at its end, not at each refresh (1024 checkpoints in the paper's GRPO
        baseline)."""
        if self.mode.restarts_engine:
            in_stage = (update - 1) % self.mu + 1
            return in_stage == self.mu or bool(interval and in_stage % interval == 0)
        return _run_cadence(update, self.total_updates, interval)

    def log_due(self, update: int, interval: int) -> bool:
        """Whether the update that brings the run to ``update`` updates is logged: every ``interval``
        (--log-interval) updates of a stage and its last."""
        in_stage = (update - 1) % self.mu + 1
        return in_stage % interval == 0 or in_stage == self.mu

    def stage_complete(self, stage: int, update: int) -> bool:
        """A checkpoint of stage ``stage`` at ``update`` updates was saved at the stage's end: a resume skips its
        rollout and updates."""
        return update >= (stage + 1) * self.mu

    def where(self, stage: int) -> str:
        """The place in the run a resume message names after the update count."""
        return f" (stage {stage})"

    @property
    def total_updates(self) -> int:
        return self.num_stages * self.mu

    @property
    def prompts_per_stage(self) -> int:
        """B_train."""
        return self.mu * self.prompts_per_update

    @property
    def weight_syncs(self) -> int:
        return self.num_stages

    def summary(self) -> dict:
        samples = self.prompts_per_stage * self.n_samples_per_prompt
        return {**super().summary(), "num_stages": self.num_stages, "mu": self.mu, "updates_per_stage": self.mu,
                "prompts_per_stage": self.prompts_per_stage, "samples_per_stage": samples,
                "max_tokens_per_stage": samples * self.max_response_len}

    def shape(self) -> list[tuple[str, object]]:
        d = self.summary()
        return [("stages", d["num_stages"]), ("μ (updates per stage)", d["mu"]),
                ("B_train (prompts per stage)", d["prompts_per_stage"]),
                ("B_mini (prompts per update)", d["prompts_per_update"]),
                ("G (samples per prompt)", d["n_samples_per_prompt"]), ("total updates", d["total_updates"]),
                ("samples per stage", d["samples_per_stage"]), ("total samples", d["total_samples"]),
                ("max response tokens per stage", d["max_tokens_per_stage"]), ("weight syncs", d["weight_syncs"])]


@dataclass(frozen=True, kw_only=True)
class AsyncPlan(PlanBase):
    """Async mode (§5.1): ``train_iters`` updates on a stream, a weight push every N, samples older than K dropped;
    it has no stages."""

    train_iters: int = flag("--train-iters", flag_default=None, type=int, help=(
        "optimiser updates of the run (Megatron's name): async mode's run length; staged modes take it instead of "
        "--num-stages, as num_stages x μ"))
    weight_sync_interval: int = flag("--weight-sync-interval", type=int, default=4,  # N
                                     help="updates between weight pushes to the engine")
    max_policy_lag: int = flag("--max-policy-lag", type=int, default=1024, help=(  # K
        "K: samples generated more than K updates before the update that takes them are dropped (counted, never "
        "trained on); must be >= --weight-sync-interval"))
    # the only value; a field so that the plan's dict (checkpoints) names its mode
    rollout_mode: str = derived("--rollout-mode", default="async")

    def __post_init__(self):
        super().__post_init__()
        if not self.mode.streams:  # ConfigError for a name that is no mode
            raise ConfigError("rollout_mode", f"{self.rollout_mode!r} has stages: its plan is a StagedPlan")
        check_positive(self, "train_iters", "weight_sync_interval", "max_policy_lag")
        if self.max_policy_lag < self.weight_sync_interval:
            raise ConfigError("max_policy_lag", f"{self.max_policy_lag} is below the weight sync interval "
                              f"{self.weight_sync_interval}: between syncs the engine's weights fall that far behind, "
                              "so every sample would be dropped")

    num_stages = None  # no stages (the loops ask only in staged modes)
    mu = None
    prompts_per_stage = None

    @property
    def total_updates(self) -> int:
        return self.train_iters

    def checkpoint_due(self, update: int, interval: int) -> bool:
        """Every ``interval`` (--save-interval) updates of the run and at its end, not at each of the engine's
        refreshes (every N updates)."""
        return _run_cadence(update, self.total_updates, interval)

    def log_due(self, update: int, interval: int) -> bool:
        """Every ``interval`` (--log-interval) updates of the run and its last."""
        return _run_cadence(update, self.total_updates, interval)

    def stage_complete(self, stage: int, update: int) -> bool:
        """No stages: a resume never skips one."""
        return False

    def where(self, stage: int) -> str:
        return ""

    @property
    def weight_syncs(self) -> int:
        """One every N updates, none after the last."""
        return (self.train_iters - 1) // self.weight_sync_interval

    def summary(self) -> dict:
        """Samples are those trained on (the engine also generates the groups it drops and those left in the queue
        at the end)."""
        return {**super().summary(), "train_iters": self.train_iters,
                "weight_sync_interval": self.weight_sync_interval, "max_policy_lag": self.max_policy_lag}

    def shape(self) -> list[tuple[str, object]]:
        d = self.summary()
        return [("total updates", d["total_updates"]), ("B_mini (prompts per update)", d["prompts_per_update"]),
                ("G (samples per prompt)", d["n_samples_per_prompt"]), ("samples trained on", d["total_samples"]),
                ("weight sync interval N", d["weight_sync_interval"]), ("weight syncs", d["weight_syncs"]),
                ("max policy lag K", d["max_policy_lag"])]


Plan = StagedPlan | AsyncPlan


def plan_type(rollout_mode: str) -> type[StagedPlan] | type[AsyncPlan]:
    """The plan of the mode named ``rollout_mode`` (--rollout-mode): AsyncPlan where an engine process streams,
    StagedPlan where stages of μ updates run on a static dataset. ConfigError for a name that is no mode."""
    return AsyncPlan if mode_of(rollout_mode).streams else StagedPlan


def _run_cadence(update: int, total_updates: int, interval: int) -> bool:
    """Every ``interval`` updates of the run (0: none) and its last."""
    return update == total_updates or bool(interval and update % interval == 0)
