"""The parser generated from the config tree: each field made with ``megamu.config_fields.flag`` adds its own flag
(``add_fields``) and is read back by name (``field_values``); ``flag_of`` maps a config error's dotted path to the flag
of that field. AlgoConfig's flags are attached here (``ALGO_FLAGS``): megamu.algo has no command-line names."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence

from megamu.config_fields import FlagSpec, flag_spec

# The update rule's overrides of its preset (None: the preset's value).
ALGO_FLAGS = {
    # ratio in [1 - clip_low, 1 + clip_high]; slime's --eps-clip / --eps-clip-high set them with slime's meaning
    # (megamu.arguments.slime: --eps-clip alone sets both, and a launch without --algorithm runs slime's GRPO)
    "clip_low": FlagSpec(("--clip-low",), None, {"type": float, "default": None}),
    "clip_high": FlagSpec(("--clip-high",), None, {"type": float, "default": None}),
    "veto_threshold": FlagSpec(("--nav-threshold",), "τ of the negative-advantage veto",
                               {"type": float, "default": None}),
    "veto_scope": FlagSpec(("--nav-scope",), None, {"choices": None, "default": None}),  # choices: VETO_SCOPES
    "m2po_threshold": FlagSpec(("--m2po-threshold",), None, {"type": float, "default": None}),
    "aggregation": FlagSpec(("--loss-aggregation",), None, {"choices": None, "default": None}),  # AGGREGATIONS
    # slime's names (verl: actor.use_kl_loss, kl_loss_coef, kl_loss_type, entropy_coeff)
    "use_kl_loss": FlagSpec(("--use-kl-loss",), "a KL term against a frozen reference policy (--ref-load's weights, "
                            "else the initial ones), scaled by --kl-loss-coef", {"action": "store_true",
                                                                                 "default": None}),
    "kl_coef": FlagSpec(("--kl-loss-coef",), "coefficient of the KL term (0: no reference model is built)",
                        {"type": float, "default": None}),
    "kl_type": FlagSpec(("--kl-loss-type",), "KL estimator (low_var_kl: k3 clamped to [-10, 10])",
                        {"choices": None, "default": None}),  # choices: KL_TYPES
    "entropy_coef": FlagSpec(("--entropy-coef",), "coefficient of the entropy bonus (loss -= coef x entropy)",
                             {"type": float, "default": None}),
    # DAPO's (verl: reward_model.overlong_buffer.len / penalty_factor, algorithm.filter_groups, max_num_gen_batches)
    "overlong_buffer": FlagSpec(("--overlong-buffer-len",), "DAPO's soft overlong punishment: replies within this "
                                "many tokens of --rollout-max-response-len lose reward linearly, down to -factor "
                                "(0: off, verl's overlong_buffer.enable=False)",
                                {"type": int, "default": None}),
    "overlong_penalty_factor": FlagSpec(("--overlong-penalty-factor",), None, {"type": float, "default": None}),
    "dynamic_sampling": FlagSpec(("--dynamic-sampling",), "DAPO's dynamic sampling: drop groups whose rewards are "
                                 "all equal and refill the stage with new prompts' groups",
                                 {"action": "optional_bool", "default": None}),
    "max_sampling_rounds": FlagSpec(("--max-sampling-rounds",), "generation rounds per stage with "
                                    "--dynamic-sampling (the first included; 0: no limit); short of groups after "
                                    "them, the run stops as verl's does, or with --fill-short-stage the stage keeps "
                                    "dropped ones (its record says how many)", {"type": int, "default": None}),
    "filter_metric": FlagSpec(("--filter-groups-metric",), "what --dynamic-sampling compares within a group "
                              "(verl's algorithm.filter_groups.metric): acc, the reward function's own score; "
                              "seq_reward, the reward trained on (with the overlong penalty)",
                              {"choices": None, "default": None}),  # choices: FILTER_METRICS
    "sampling_round_prompts": FlagSpec(("--prompts-per-sampling-round",), "prompts generated per dynamic-sampling "
                                       "round (verl's data.gen_batch_size; default: the stage's B_train); the stage "
                                       "keeps the first B_train informative groups", {"type": int, "default": None}),
    "fill_short_stage": FlagSpec(("--fill-short-stage",), "a stage still short of informative groups after "
                                 "--max-sampling-rounds is filled with equal-valued groups (verl: an error)",
                                 {"action": "store_true", "default": None}),
    # dual-clip PPO's bound (verl: actor.clip_ratio_c; slime: --eps-clip-c)
    "clip_ratio_c": FlagSpec(("--clip-ratio-c", "--eps-clip-c"), "dual-clip: an A < 0 token's loss is at most "
                             "c x |A| (c > 1; default off)", {"type": float, "default": None}),
}


def _spec(config_cls: type, name: str, attached: Mapping[str, FlagSpec] | None) -> FlagSpec | None:
    return (attached or {}).get(name) or flag_spec(config_cls, name)


def add_fields(group, config_cls: type, only: Sequence[str] | None = None, *,
               attached: Mapping[str, FlagSpec] | None = None, choices: Mapping[str, tuple] | None = None) -> None:
    """A flag for each field of ``config_cls`` that carries one (or is given one in ``attached``): the fields ``only``
    names, in its order (a group may hold flags of several parts), else all, in ``attached``'s or field order.
    ``choices``: values filled in where a spec leaves them to the caller (AlgoConfig's, which live in megamu.algo)."""
    by_name = {f.name: f for f in dataclasses.fields(config_cls)}
    for name in only or attached or by_name:
        spec = _spec(config_cls, name, attached)
        if spec is None:
            continue
        kw = {"default": by_name[name].default, **spec.argparse}
        if kw.get("choices", ...) is None:
            kw["choices"] = (choices or {})[name]
        if kw.get("action") == "optional_bool":  # --x / --no-x (parts name it without importing argparse)
            kw["action"] = argparse.BooleanOptionalAction
        if spec.help is not None:
            kw["help"] = spec.help
        group.add_argument(*spec.names, **kw)


def field_values(config_cls: type, args: argparse.Namespace, *,
                 attached: Mapping[str, FlagSpec] | None = None) -> dict:
    """The flag-carrying fields of ``config_cls`` as ``args`` holds them: keyword arguments for ``config_cls``."""
    return {f.name: getattr(args, spec.dest) for f in dataclasses.fields(config_cls)
            if (spec := _spec(config_cls, f.name, attached)) is not None}


def _part_types(hint) -> tuple[type, ...]:
    """The config classes a field's type hint holds (``X | None`` -> X; the plan's union -> both)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    return tuple(t for t in options if dataclasses.is_dataclass(t))


def field_flag(root: type, path: str) -> str | None:
    """The flag a field at dotted ``path`` below ``root`` carries (AlgoConfig's: ALGO_FLAGS); None if it has none."""
    *parents, name = path.split(".")
    classes: tuple[type, ...] = (root,)
    for part in parents:
        classes = tuple(t for cls in classes for t in _part_types(typing.get_type_hints(cls).get(part)))
    attached = ALGO_FLAGS if parents == ["algo"] else None
    return next((spec.names[0] for cls in classes if (spec := _spec(cls, name, attached)) is not None), None)
