"""Which reward a run uses, decided once: ``make_scorer(RewardConfig)`` builds the worker pool for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from megamu.config_fields import flag
from megamu.errors import ConfigError
from megamu.reward.code import CODE_MODES
from megamu.reward.pool import DEFAULT_REWARD_FN, RewardScorer
from megamu.reward.signatures import DEFAULT_REWARD_KEY, CallOptions

REWARD_KINDS = ("math", "code")
CODE_REWARD_FN = "megamu.reward.code:code_score"
MATH_ITEM_TIMEOUT_S = 5.0
CODE_ITEM_SLACK_S = 60.0  # a code item may run many cases; the pool kills it only this long past one case's limit


@dataclass(frozen=True)
class RewardConfig:
    kind: str = flag("--reward", default="math", choices=REWARD_KINDS, help=(
        "math: last \\boxed{} vs the answer (math-verify), or by the row's data_source as verl's default reward "
        "(openai/gsm8k: the '#### N' line; math_dapo, aime*: 'Answer: X', 1 / -1); code: the last ```python block "
        "runs against the row's tests in a sandbox"))
    reward_fn: str | None = flag("--reward-fn", "--custom-rm-path", default=None, help=(
        "module:function, file.py:function or module.function (slime's --custom-rm-path); fn(response, "
        "ground_truth), verl's compute_score(data_source, solution_str, ground_truth, extra_info) or slime's "
        "custom_rm(args, sample), detected; overrides --reward"))
    # code: all tests pass -> 1, or the fraction passed
    code_mode: str = flag("--code-reward-mode", default="all", choices=CODE_MODES, help=(
        "code: 1 only when every test passes, or the fraction of stdin/stdout cases passed"))
    sandbox_url: str | None = flag("--code-sandbox-url", default=None, help=(
        "code: run programs on this sandbox service (megamu/reward/remote.py) instead of locally"))
    timeout_s: float = flag("--code-timeout", default=10.0, type=float, help=(
        "code: wall-clock and CPU seconds of one program execution (one test case)"))
    num_workers: int | None = flag("--reward-workers", default=None, type=int, help=(
        "reward worker processes (default: min(4, CPU cores))"))
    concurrency: int = flag("--reward-concurrency", default=1, type=int, help=(
        "calls of an async reward function (slime's custom_rm coroutines: a remote judge) in flight per worker"))
    reward_key: str = flag("--reward-key", default=DEFAULT_REWARD_KEY, help=(
        "the key of the reward in a dict a reward function returns (slime's --reward-key; verl reads 'score')"))
    group_rm: bool = flag("--group-rm", default=False, action="store_true", help=(
        "call slime's custom_rm(args, samples) once per prompt group, returning one reward per sample"))
    # slime's ``args``: the run's flags by name (megamu.arguments fills it); not part of the config's identity
    run_args: dict = field(default_factory=dict, compare=False, repr=False)
    max_error_fraction: float = flag("--reward-error-tolerance", default=0.0, type=float, help=(
        "fraction of reward calls that may raise before the run stops with the exception and one offending sample "
        "(default 0: a function that fails stops the run at its first shard)"))
    # seconds per item (None: 5 s math, code's own slack)
    item_timeout: float | None = flag("--reward-timeout", default=None, type=float, help=(
        "seconds one reward call may take before it scores 0 (default: 5 for math and --reward-fn, the code reward's "
        "own limit for code); raise it for a remote judge. A --reward-fn call past it counts against "
        "--reward-error-tolerance"))

    def __post_init__(self):
        if self.reward_fn is not None and ":" not in self.reward_fn and "." not in self.reward_fn:
            raise ConfigError("reward_fn", f"expected module:function, file.py:function or module.function (slime's "
                                           f"--custom-rm-path), got {self.reward_fn!r}")
        if not 0 <= self.max_error_fraction <= 1:
            raise ConfigError("max_error_fraction", f"must be a fraction in [0, 1], got {self.max_error_fraction}")
        if self.item_timeout is not None and not self.item_timeout > 0:
            raise ConfigError("item_timeout", f"must be > 0 seconds, got {self.item_timeout}")
        if self.kind not in REWARD_KINDS:
            raise ConfigError("kind", f"must be one of {REWARD_KINDS}, got {self.kind!r}")
        if self.code_mode not in CODE_MODES:
            raise ConfigError("code_mode", f"must be one of {CODE_MODES}, got {self.code_mode!r}")
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
        if self.num_workers is not None and self.num_workers < 1:
            raise ConfigError("num_workers", f"must be >= 1, got {self.num_workers}")
        if self.concurrency < 1:
            raise ConfigError("concurrency", f"must be >= 1, got {self.concurrency}")
        if self.group_rm and not self.reward_fn:
            raise ConfigError("group_rm", "needs a group reward function: --custom-rm-path / --reward-fn")

    @property
    def item_timeout_s(self) -> float:
        """The pool's per-item limit: --reward-timeout, else a math item must finish in 5 s and a code item gets time
        for many cases."""
        if self.item_timeout is not None:
            return self.item_timeout
        if self.reward_fn or self.kind == "math":
            return MATH_ITEM_TIMEOUT_S
        return CODE_ITEM_SLACK_S + 2 * self.timeout_s

    def spec_and_kwargs(self) -> tuple[str, dict]:
        if self.reward_fn:
            return self.reward_fn, {}
        if self.kind == "math":
            return DEFAULT_REWARD_FN, {}
        # Stop starting new cases early enough that the case in flight still ends before the pool's limit.
        kwargs = {"timeout_s": self.timeout_s, "mode": self.code_mode, "budget_s": CODE_ITEM_SLACK_S - 5.0}
        if self.sandbox_url:
            kwargs["sandbox_url"] = self.sandbox_url
        return CODE_REWARD_FN, kwargs


    def call_options(self) -> CallOptions:
        """How the workers call the function: a user's is never called outside a timeout (no warm-up); megamu's own
        scorers are warmed up once per worker (their lazy imports would otherwise count against an item)."""
        return CallOptions(reward_key=self.reward_key, run_args=dict(self.run_args), group=self.group_rm,
                           concurrency=self.concurrency, warm_up=not self.reward_fn)


def make_scorer(cfg: RewardConfig) -> RewardScorer:
    """The reward pool for ``cfg`` (``--reward-fn`` wins over ``--reward``). A user's function that times out fails
    (a judge that hangs stops the run past --reward-error-tolerance); megamu's own scorers' timeouts score 0."""
    spec, kwargs = cfg.spec_and_kwargs()
    return RewardScorer(spec, timeout_s=cfg.item_timeout_s, num_workers=cfg.num_workers, fn_kwargs=kwargs,
                        max_error_fraction=cfg.max_error_fraction, options=cfg.call_options(),
                        timeouts_are_errors=bool(cfg.reward_fn))
