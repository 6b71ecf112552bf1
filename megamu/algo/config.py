"""The update rule's settings (``AlgoConfig``): clipping range, veto, aggregation, M2PO mask, KL and entropy terms.
Built by ``AlgoConfig.preset(name, **overrides)`` from the paper's presets (megamu.algo.presets)."""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, replace
from types import MappingProxyType
from typing import Any

from megamu.algo.dapo import FILTER_METRICS
from megamu.algo.kl import KL_TYPES
from megamu.algo.presets import PRESETS
from megamu.algo.veto import VETO_SCOPES
from megamu.config_fields import derived, flag
from megamu.errors import ConfigError

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """Everything ``policy_loss`` needs to know about the update rule (Eq. 2 and J_μ-GRPO of §4).

    Ratio clip range [1 - clip_low, 1 + clip_high] (``clip_high=None``: no upper bound); ``clip_ratio_c``: dual-clip's
    bound c > 1 for A < 0 tokens (None: off; see ``policy_loss``); the negative-advantage veto
    with threshold τ = ``veto_threshold`` (None: off) and ``veto_scope`` (§3.3, App. C.2); ``aggregation`` of the
    per-token loss; ``m2po_threshold``: M2PO's second-moment mask (None: off).

    Regularisers of slime's and verl's recipes, off in every paper preset: with ``use_kl_loss``, ``kl_coef`` x the
    ``kl_type`` estimator of KL(π_θ ‖ π_ref) against a frozen reference policy (megamu.algo.kl); ``entropy_coef`` x
    the policy's entropy subtracted (an entropy bonus). Both aggregated like the policy loss.

    DAPO's rollout-side parts (megamu.algo.dapo), applied where a stage's groups are scored: ``overlong_buffer``
    (tokens; None or 0: off) and ``overlong_penalty_factor`` of the soft overlong punishment; ``dynamic_sampling``:
    groups whose ``filter_metric`` values are all equal are dropped and the stage refilled with new prompts' groups,
    ``sampling_round_prompts`` prompts per generation round (verl's data.gen_batch_size; None: the stage's B_train),
    in at most ``max_sampling_rounds`` rounds (verl's max_num_gen_batches; 0: no limit). A stage still short after
    them is an error, as in verl, unless ``fill_short_stage``: then equal-valued groups fill it.

    ``name`` is one of the presets' and the rule's own settings have no defaults: ``AlgoConfig.preset`` is the way to
    build one, so a config named for a method is that method (plus the overrides it states)."""

    # The flags override the preset (a flag left out: None, the preset's value): slime's and verl's names where they
    # have the setting (verl's in the comments), megamu's where they do not.
    # --algorithm picks the preset the flags below override (written out in megamu.arguments: its default follows
    # from slime's flags)
    name: str = derived("--algorithm", default=MISSING, kw_only=False)
    # the ratio's range [1 - clip_low, 1 + clip_high]; slime's --eps-clip / --eps-clip-high set them with slime's
    # meaning (megamu.arguments.slime: --eps-clip alone sets both, and a launch without --algorithm runs slime's GRPO)
    clip_low: float = flag("--clip-low", flag_default=None, type=float)
    clip_high: float | None = flag("--clip-high", flag_default=None, type=float)
    # τ, the paper's threshold of the negative-advantage veto (NAV, §3.3): the flag says which feature, the field which
    # quantity; both names are kept (launch scripts and the loss code use them)
    veto_threshold: float | None = flag("--nav-threshold", flag_default=None, type=float,
                                        help="τ of the negative-advantage veto")
    veto_scope: str = flag("--nav-scope", flag_default=None, choices=VETO_SCOPES)  # the veto's scope (App. C.2)
    aggregation: str = flag("--loss-aggregation", flag_default=None, choices=AGGREGATIONS)  # verl's loss_agg_mode
    m2po_threshold: float | None = flag("--m2po-threshold", flag_default=None, type=float)
    # dual-clip PPO's bound c (verl: actor.clip_ratio_c; slime: --eps-clip-c)
    clip_ratio_c: float | None = flag("--clip-ratio-c", "--eps-clip-c", default=None, flag_default=None, type=float,
                                      help="dual-clip: an A < 0 token's loss is at most c x |A| (c > 1; default off)")
    # slime's names (verl: actor.use_kl_loss, kl_loss_coef, kl_loss_type, entropy_coeff)
    use_kl_loss: bool = flag("--use-kl-loss", default=False, flag_default=None, action="store_true", help=(
        "a KL term against a frozen reference policy (--ref-load's weights, else the initial ones), scaled by "
        "--kl-loss-coef"))
    kl_coef: float = flag("--kl-loss-coef", default=0.0, flag_default=None, type=float,
                          help="coefficient of the KL term (0: no reference model is built)")
    kl_type: str = flag("--kl-loss-type", default="k1", flag_default=None, choices=KL_TYPES,  # slime's default
                        help="KL estimator (low_var_kl: k3 clamped to [-10, 10])")
    entropy_coef: float = flag("--entropy-coef", default=0.0, flag_default=None, type=float,
                               help="coefficient of the entropy bonus (loss -= coef x entropy)")
    # DAPO's (verl: reward_model.overlong_buffer.len / penalty_factor, algorithm.filter_groups, max_num_gen_batches)
    overlong_buffer: int | None = flag("--overlong-buffer-len", default=None, flag_default=None, type=int, help=(
        "DAPO's soft overlong punishment: replies within this many tokens of --rollout-max-response-len lose reward "
        "linearly, down to -factor (0: off, verl's overlong_buffer.enable=False)"))
    overlong_penalty_factor: float = flag("--overlong-penalty-factor", default=1.0, flag_default=None, type=float)
    dynamic_sampling: bool = flag("--dynamic-sampling", default=False, flag_default=None, action="optional_bool",
                                  help="DAPO's dynamic sampling: drop groups whose rewards are all equal and refill "
                                       "the stage with new prompts' groups")
    max_sampling_rounds: int = flag("--max-sampling-rounds", default=10, flag_default=None, type=int, help=(
        "generation rounds per stage with --dynamic-sampling (the first included; 0: no limit); short of groups "
        "after them, the run stops as verl's does, or with --fill-short-stage the stage keeps dropped ones (its "
        "record says how many)"))
    filter_metric: str = flag("--filter-groups-metric", default="seq_reward", flag_default=None,
                              choices=FILTER_METRICS, help=(
                                  "what --dynamic-sampling compares within a group (verl's "
                                  "algorithm.filter_groups.metric): acc, the reward function's own score; seq_reward, "
                                  "the reward trained on (with the overlong penalty)"))
    sampling_round_prompts: int | None = flag("--prompts-per-sampling-round", default=None, flag_default=None,
                                              type=int, help=(
        "prompts generated per dynamic-sampling round (verl's data.gen_batch_size; default: the stage's B_train); "
        "the stage keeps the first B_train informative groups"))
    fill_short_stage: bool = flag("--fill-short-stage", default=False, flag_default=None, action="store_true",
                                  help="a stage still short of informative groups after --max-sampling-rounds is "
                                       "filled with equal-valued groups (verl: an error)")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> AlgoConfig:
        """The preset ``name`` (megamu.algo.presets), with ``overrides`` (None included: e.g. clip_high=None) on top."""
        if name not in PRESETS:
            raise ConfigError("name", f"must be one of {sorted(PRESETS)}, got {name!r}")
        return cls(name, **{**PRESETS[name], **overrides})

    def __post_init__(self) -> None:
        if self.name not in PRESETS:
            raise ConfigError("name", f"must be one of {sorted(PRESETS)}, got {self.name!r}")
        if not 0.0 <= self.clip_low <= 1.0:
            raise ConfigError("clip_low", f"must be in [0, 1] (ratio lower bound 1 - clip_low), got {self.clip_low}")
        if self.clip_high is not None and self.clip_high < 0:
            raise ConfigError("clip_high", f"must be >= 0, got {self.clip_high}")
        if self.clip_ratio_c is not None and not (math.isfinite(self.clip_ratio_c) and self.clip_ratio_c > 1.0):
            raise ConfigError("clip_ratio_c", f"must be > 1 (dual-clip bounds -ρA by c|A|), got {self.clip_ratio_c}")
        if self.veto_threshold is not None and not 0.0 < self.veto_threshold < 1.0:
            raise ConfigError("veto_threshold", f"must be in (0, 1), got {self.veto_threshold}")
        if self.veto_scope not in VETO_SCOPES:
            raise ConfigError("veto_scope", f"must be one of {VETO_SCOPES}, got {self.veto_scope!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError("aggregation", f"must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.m2po_threshold is not None and self.m2po_threshold <= 0:
            raise ConfigError("m2po_threshold", f"must be > 0, got {self.m2po_threshold}")
        if self.kl_type not in KL_TYPES:
            raise ConfigError("kl_type", f"must be one of {KL_TYPES}, got {self.kl_type!r}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ConfigError("kl_coef", f"must be a finite number >= 0, got {self.kl_coef}")
        if self.kl_coef > 0 and not self.use_kl_loss:
            raise ConfigError("kl_coef", f"{self.kl_coef} has no effect without the KL loss: add --use-kl-loss")
        if not math.isfinite(self.entropy_coef):
            raise ConfigError("entropy_coef", f"must be finite, got {self.entropy_coef}")
        if self.overlong_buffer is not None and self.overlong_buffer < 0:
            raise ConfigError("overlong_buffer", f"must be >= 1 token (or 0: off), got {self.overlong_buffer}")
        if not (math.isfinite(self.overlong_penalty_factor) and self.overlong_penalty_factor >= 0):
            raise ConfigError("overlong_penalty_factor", f"must be >= 0, got {self.overlong_penalty_factor}")
        if self.max_sampling_rounds < 0:
            raise ConfigError("max_sampling_rounds", f"must be >= 1 (or 0: no limit), got {self.max_sampling_rounds}")
        if self.filter_metric not in FILTER_METRICS:
            raise ConfigError("filter_metric", f"must be one of {FILTER_METRICS}, got {self.filter_metric!r}")
        if self.sampling_round_prompts is not None and self.sampling_round_prompts < 1:
            raise ConfigError("sampling_round_prompts", f"must be >= 1, got {self.sampling_round_prompts}")

    @property
    def uses_reference(self) -> bool:
        """A reference policy is needed (built, scored each update): the KL term is on with a coefficient > 0."""
        return self.use_kl_loss and self.kl_coef > 0

    def describe(self) -> dict:
        """The settings without the name (the dry-run plan prints them)."""
        d = asdict(self)
        d.pop("name")
        return d

    def with_overrides(self, **overrides: Any) -> AlgoConfig:
        """These settings with the ``overrides`` that are not None (a flag left out: the preset's value)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


# Every preset built (read-only): what --algorithm NAME runs before any override.
ALGORITHM_PRESETS: MappingProxyType[str, AlgoConfig] = MappingProxyType({n: AlgoConfig.preset(n) for n in PRESETS})
