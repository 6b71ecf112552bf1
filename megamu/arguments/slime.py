"""slime's own flags (THUDM/slime ``slime/utils/arguments.py``), as its launch scripts pass them
(``scripts/run-qwen3-4B.sh``): each is translated to megamu's flag of the same meaning, accepted where megamu already
does what it asks, or refused naming megamu's equivalent. The translation is printed at start, one line per flag.

Flags that share slime's name and meaning live with megamu's own (``--rollout-batch-size``, ``--input-key``,
``--label-key``, ``--apply-chat-template``, ``--eval-prompt-data``, ...). slime's policy-loss flags mean what they mean
in slime: a launch giving ``--advantage-estimator`` or ``--eps-clip`` without ``--algorithm`` runs slime's GRPO, and a
launch in slime's terms trains in bf16 as slime does (``resolve_precision``). ``--save-interval`` and
``--eval-interval`` count rollouts in slime and updates in megamu (Megatron-LM's iterations): see ``convert_intervals``.
"""

from __future__ import annotations

import argparse
import shlex

from megamu.algo.presets import PRESETS
from megamu.arguments.flag_errors import field_default, flag_error
from megamu.config.run_config import DEFAULT_ALGORITHM
from megamu.runtime.device import Device
from megamu.training.policy import PolicyConfig

DEEPSCALER_REWARD_FN = "megamu.reward.math:deepscaler_score"
# slime's --rm-type -> megamu's reward flags (the rest: write it as a function and pass --custom-rm-path)
RM_TYPES = {"math": ("--reward math", {"reward": "math"}),
            "deepscaler": (f"--reward-fn {DEEPSCALER_REWARD_FN}", {"reward_fn": DEEPSCALER_REWARD_FN})}
INTERVAL_FLAGS = (("--save-interval", "save_interval"), ("--eval-interval", "eval_interval"),
                  ("--hf-export-interval", "hf_export_interval"))
# slime's names for the run's shape: a launch using them counts its intervals in rollouts (slime's train.py)
SLIME_SHAPE = ("rollout_batch_size", "num_rollout", "num_steps_per_rollout")
# slime's policy-loss flags (slime/utils/arguments.py:899-900, :941 at 624b824): given without --algorithm, the
# launch means slime's GRPO
SLIME_ALGORITHM = ("advantage_estimator", "eps_clip", "eps_clip_high")
# flags only a slime launch gives (verl's translation shares --rollout-batch-size, so it is not one of them)
SLIME_LAUNCH = ("actor_num_nodes", "actor_num_gpus_per_node", "colocate", "rollout_num_gpus_per_engine",
                "num_rollout", "num_steps_per_rollout", "use_dynamic_batch_size", "rm_type", "optimizer",
                *SLIME_ALGORITHM)


def add_slime_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("slime's flags (translated to megamu's; printed at start)")
    g.add_argument("--actor-num-nodes", type=int, default=None,
                   help="torchrun's --nnodes: with --actor-num-gpus-per-node, the world a dry run plans for; checked "
                        "against torchrun's WORLD_SIZE")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=None, help="torchrun's --nproc_per_node")
    g.add_argument("--colocate", action="store_true", help="--rollout-mode colocated")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=None, help="--sglang-tp-size")
    g.add_argument("--sglang-mem-fraction-static", type=float, default=None,
                   help="--sglang-server-args '--mem-fraction-static F'")
    g.add_argument("--num-rollout", type=int, default=None, help="--num-stages (one rollout per stage)")
    g.add_argument("--num-steps-per-rollout", type=int, default=None, help="--mu (updates per rollout)")
    g.add_argument("--use-dynamic-batch-size", action="store_true",
                   help="with --max-tokens-per-gpu: micro-batches packed to a token budget "
                        "(--max-tokens-per-micro-batch), --micro-batch-size not applied")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None, help="--max-tokens-per-micro-batch")
    g.add_argument("--rollout-shuffle", action="store_true",
                   help="accepted: megamu always draws prompts in a seeded shuffled order (--seed)")
    g.add_argument("--balance-data", action="store_true",
                   help="accepted, no effect: slime balances work over data-parallel ranks (speed only: the update "
                        "is the same); megamu splits each update by samples, at prompt-group boundaries")
    g.add_argument("--eval-input-key", default=None, help="must equal --input-key: evaluation prompts are built as "
                                                          "training's")
    g.add_argument("--optimizer", default=None, help="adam only (megamu's optimiser: Adam with decoupled weight "
                                                     "decay, Megatron-LM's 'adam')")
    g.add_argument("--rm-type", default=None, help=f"{', '.join(f'{k}: {v[0]}' for k, v in RM_TYPES.items())}; "
                                                   "others: --custom-rm-path")
    g.add_argument("--advantage-estimator", default=None, help="grpo only (every --algorithm uses GRPO's group "
                                                               "advantages); without --algorithm: --algorithm grpo")
    g.add_argument("--eps-clip", type=float, default=None,
                   help="slime's PPO clip: --clip-low, and --clip-high too unless --eps-clip-high is given (slime's "
                        "rule); without --algorithm: --algorithm grpo (slime's GRPO, no veto)")
    g.add_argument("--eps-clip-high", type=float, default=None, help="--clip-high")
    g.add_argument("--fp16", action="store_true",
                   help="refused: megamu trains in bf16 (a slime launch's default on GPUs) or fp32, never fp16")
    g.add_argument("--recompute-method", default=None, help="uniform only, with --recompute-granularity full")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="1 only (one layer per checkpoint)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accepted: megamu always accumulates and reduces gradients in fp32")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="accepted: flash attention (and the CPU path) keep the softmax in fp32")
    g.add_argument("--attention-backend", default=None, help="flash or auto: megamu's GPU layers use Transformer "
                                                             "Engine's flash attention")
    g.add_argument("--interval-unit", choices=("updates", "rollouts"), default=None, help=(
        "what --save-interval, --eval-interval and --hf-export-interval count, and --lr-warmup-iters outside a "
        "slime launch (verl's lr_warmup_steps): optimiser updates (megamu's and Megatron-LM's default) or rollouts "
        "(slime's and verl's: a stage, μ updates). Required when a launch in slime's terms (--rollout-batch-size, "
        "--num-rollout) gives an interval and μ > 1"))


def _set(args: argparse.Namespace, notes: list[str], slime: str, dest: str, value, megamu: str, *,
         default=None) -> None:
    """megamu's ``dest`` takes slime's value unless the launch gave it another one (an error naming both)."""
    current = getattr(args, dest)
    if current not in (default, value):
        flag_error(slime, f"contradicts {megamu.split()[0]} {current} (the same setting: give one)")
    setattr(args, dest, value)
    notes.append(f"{slime} -> {megamu}")


def translate_slime_arguments(args: argparse.Namespace) -> list[str]:
    """Rewrite slime's flags into megamu's in ``args``; returns the lines to print. Run before any other check."""
    notes: list[str] = []
    _algorithm(args, notes)
    if args.colocate:
        _set(args, notes, "--colocate", "rollout_mode", "colocated", "--rollout-mode colocated")
    if args.rollout_num_gpus_per_engine is not None:
        n = args.rollout_num_gpus_per_engine
        _set(args, notes, "--rollout-num-gpus-per-engine", "sglang_tp_size", n, f"--sglang-tp-size {n}", default=1)
    if args.rollout_engine is None and (args.rollout_num_gpus_per_engine or args.sglang_mem_fraction_static):
        args.rollout_engine = "sglang"  # slime always generates with SGLang servers
        notes.append("slime's engine flags -> --rollout-engine sglang")
    if args.sglang_mem_fraction_static is not None:
        f = args.sglang_mem_fraction_static
        words = shlex.split(args.sglang_server_args)
        given = [v for k, v in zip(words, words[1:]) if k == "--mem-fraction-static"]
        if given and float(given[0]) != f:
            flag_error("--sglang-mem-fraction-static", f"{f} contradicts --sglang-server-args' --mem-fraction-static "
                                                       f"{given[0]}")
        if not given:
            args.sglang_server_args = " ".join([*words, "--mem-fraction-static", str(f)])
        notes.append(f"--sglang-mem-fraction-static -> --sglang-server-args '--mem-fraction-static {f}'")
    if args.num_rollout is not None:
        _set(args, notes, "--num-rollout", "num_stages", args.num_rollout, f"--num-stages {args.num_rollout}")
    if args.num_steps_per_rollout is not None:
        _set(args, notes, "--num-steps-per-rollout", "mu", args.num_steps_per_rollout,
             f"--mu {args.num_steps_per_rollout}")
    _dynamic_batch(args, notes)
    _checked_values(args, notes)
    for flag, on in (("--rollout-shuffle", args.rollout_shuffle), ("--balance-data", args.balance_data),
                     ("--accumulate-allreduce-grads-in-fp32", args.accumulate_allreduce_grads_in_fp32),
                     ("--attention-softmax-in-fp32", args.attention_softmax_in_fp32)):
        if on:
            notes.append(f"{flag}: accepted ({'no effect: speed only' if flag == '--balance-data' else 'always so'})")
    return notes


def _algorithm(args: argparse.Namespace, notes: list[str]) -> None:
    """slime's --eps-clip / --eps-clip-high are its PPO clip range, and --eps-clip-high defaults to --eps-clip
    (slime/utils/arguments.py:1876-1877); its --advantage-estimator grpo (the default, :941) runs GRPO with that clip
    and nothing else. So a launch giving them without --algorithm runs megamu's grpo preset with that range, never
    μ-GRPO's veto under slime's clip; the note says how to run μ-GRPO. With --algorithm mu-grpo, slime's clip flags
    (written for slime's GRPO) are not applied: μ-GRPO keeps its relaxed clip [0, 5] (§3.1), and a warning says so
    and names megamu's own --clip-low/--clip-high, which do replace it (with a warning too)."""
    given = [f"--{d.replace('_', '-')}" for d in SLIME_ALGORITHM if getattr(args, d) is not None]
    eps = {f: v for f, v in (("--eps-clip", args.eps_clip), ("--eps-clip-high", args.eps_clip_high)) if v is not None}
    if args.algorithm == "mu-grpo" and eps:
        notes.append(f"warning: {' '.join(f'{f} {v}' for f, v in eps.items())} "
                     "(slime's GRPO clip) not applied: μ-GRPO keeps its relaxed clip [0, 5] with the "
                     "negative-advantage veto; --clip-low/--clip-high would replace it, --algorithm grpo runs "
                     "slime's GRPO")
    else:
        if args.eps_clip is not None:
            _set(args, [], "--eps-clip", "clip_low", args.eps_clip, f"--clip-low {args.eps_clip}")
            if args.eps_clip_high is None and args.clip_high is None:
                args.clip_high = args.eps_clip  # slime: eps_clip_high = eps_clip when not given
        if args.eps_clip_high is not None:
            _set(args, [], "--eps-clip-high", "clip_high", args.eps_clip_high, f"--clip-high {args.eps_clip_high}")
    preset = PRESETS[args.algorithm or ("grpo" if given else DEFAULT_ALGORITHM)]
    low = 1 - (preset["clip_low"] if args.clip_low is None else args.clip_low)
    high = preset["clip_high"] if args.clip_high is None else args.clip_high
    clip = f"[{low:g}, {'none' if high is None else f'{1 + high:g}'}]"
    if args.algorithm is None and given:
        args.algorithm = "grpo"
        notes.append(f"{', '.join(given)} without --algorithm -> --algorithm grpo: slime's GRPO, ratio clipped to "
                     f"{clip}, no negative-advantage veto. For μ-GRPO (relaxed clip [0, 5] and the veto): "
                     "--algorithm mu-grpo")
    args.algorithm = args.algorithm or DEFAULT_ALGORITHM
    if args.algorithm == "mu-grpo" and (args.clip_low is not None or args.clip_high is not None):
        notes.append(f"warning: --clip-low/--clip-high replace μ-GRPO's relaxed clip [0, 5] by {clip} (the "
                     "negative-advantage veto stays on): drop them for the paper's μ-GRPO")


def is_slime_launch(args: argparse.Namespace) -> bool:
    """A launch written in slime's terms (a flag only slime's launches give)."""
    return any(getattr(args, d) not in (None, False) for d in SLIME_LAUNCH)


def resolve_precision(args: argparse.Namespace, device: Device) -> list[str]:
    """slime trains in bf16 unless told --fp16 (slime/backends/megatron_utils/arguments.py:157, ``args.bf16 = not
    args.fp16``): a slime launch on GPUs, or a dry run planning for them, does too; megamu's own default is fp32, said
    at start for a GPU run. A CPU run trains in fp32 (the CPU optimiser keeps no fp32 master weights)."""
    if args.fp16:
        flag_error("--fp16", "megamu trains in bf16 (a slime launch's default on GPUs: drop --fp16) or fp32, never "
                             "fp16")
    if args.bf16:
        return []
    if is_slime_launch(args) and (device.is_cuda or args.dry_run):
        args.bf16 = args.bf16_by_default = True
        return ["precision: bf16, as slime trains unless told --fp16 (megamu's own default is fp32)"]
    if device.is_cuda or args.transformer_impl == "transformer_engine":
        return ["precision: fp32 (megamu's default, engine float32 too); slime and verl train in bf16: --bf16"]
    return []


def _dynamic_batch(args: argparse.Namespace, notes: list[str]) -> None:
    """slime packs micro-batches to --max-tokens-per-gpu only with --use-dynamic-batch-size, and then ignores
    --micro-batch-size (``add_data_arguments``): megamu's token budget, with no cap on rows (set in
    ``dynamic_micro_batch``, once the update's size is known)."""
    if args.use_dynamic_batch_size != (args.max_tokens_per_gpu is not None):
        flag_error("--use-dynamic-batch-size", "slime packs micro-batches to --max-tokens-per-gpu only with "
                                               "--use-dynamic-batch-size: give both (megamu: "
                                               "--max-tokens-per-micro-batch)")
    if not args.use_dynamic_batch_size:
        return
    if args.micro_batch_size != field_default(PolicyConfig, "micro_batch_size"):
        flag_error("--micro-batch-size", "slime ignores it with --use-dynamic-batch-size: drop one (megamu caps a "
                                         "micro-batch by both with --max-tokens-per-micro-batch)")
    _set(args, notes, "--max-tokens-per-gpu", "max_tokens_per_micro_batch", args.max_tokens_per_gpu,
         f"--max-tokens-per-micro-batch {args.max_tokens_per_gpu}")


def dynamic_micro_batch(args: argparse.Namespace, samples_per_update: int) -> None:
    """With --use-dynamic-batch-size the token budget alone sizes micro-batches: up to the whole update's rows."""
    if args.use_dynamic_batch_size:
        args.micro_batch_size = max(args.micro_batch_size, samples_per_update)


def _checked_values(args: argparse.Namespace, notes: list[str]) -> None:
    """slime flags accepted at the one value megamu runs, refused otherwise naming megamu's equivalent."""
    if args.optimizer not in (None, "adam"):
        flag_error("--optimizer", f"{args.optimizer} is not supported: megamu trains with Adam (decoupled weight "
                                  "decay, Megatron-LM's 'adam'): --adam-beta1/--adam-beta2/--weight-decay set it")
    if args.advantage_estimator not in (None, "grpo"):
        flag_error("--advantage-estimator", f"{args.advantage_estimator} is not supported: megamu's --algorithm "
                                            "presets (mu-grpo, grpo, grpo-high-staleness, grpo-relaxed, m2po) use "
                                            "GRPO's group advantages")
    if args.rm_type is not None:
        if args.rm_type not in RM_TYPES:
            flag_error("--rm-type", f"{args.rm_type} has no megamu equivalent (it has {', '.join(RM_TYPES)}): write "
                                    "the reward as a function and pass --custom-rm-path module:function")
        megamu, values = RM_TYPES[args.rm_type]
        if args.reward_fn not in (None, values.get("reward_fn")):
            flag_error("--rm-type", f"contradicts --custom-rm-path {args.reward_fn} (give one)")
        for dest, value in values.items():
            setattr(args, dest, value)
        notes.append(f"--rm-type {args.rm_type} -> {megamu}")
    if args.eval_input_key is not None and args.eval_input_key != args.prompt_key:
        flag_error("--eval-input-key", f"{args.eval_input_key} differs from --input-key {args.prompt_key}: megamu "
                                       "builds evaluation prompts exactly as training's (rename the column in the "
                                       "eval set)")
    if args.attention_backend not in (None, "flash", "auto"):
        flag_error("--attention-backend", f"{args.attention_backend} is not supported: megamu's GPU layers run "
                                          "Transformer Engine's flash attention (give flash or auto)")
    if args.recompute_method not in (None, "uniform") or (args.recompute_method and
                                                          args.recompute_granularity != "full"):
        flag_error("--recompute-method", f"{args.recompute_method}: megamu's --recompute-granularity full is uniform, "
                                         "one layer per checkpoint (give uniform with --recompute-granularity full)")
    if args.recompute_num_layers not in (None, 1):
        flag_error("--recompute-num-layers", f"{args.recompute_num_layers}: megamu checkpoints one layer at a time "
                                             "(give 1)")


def convert_intervals(args: argparse.Namespace, mu: int, is_async: bool) -> list[str]:
    """Intervals count optimiser updates (megamu's and Megatron-LM's rule); ``--interval-unit rollouts`` counts them
    as slime's train.py and verl's trainer do (save/eval every N rollouts), converted here to N x μ updates. A launch
    in slime's terms that gives an interval at μ > 1 must say which it means: the two differ by a factor μ.
    ``--lr-warmup-iters`` follows the unit too (verl's actor.optim.lr_warmup_steps counts training steps, one per
    rollout: its scheduler steps once per update_actor call), except in a slime launch, where it is Megatron-LM's
    count of optimiser steps as slime passes it on (slime/backends/megatron_utils/model.py:214: x global batch)."""
    flags = INTERVAL_FLAGS if is_slime_launch(args) else (*INTERVAL_FLAGS, ("--lr-warmup-iters", "lr_warmup_iters"))
    given = [(flag, dest) for flag, dest in flags if getattr(args, dest)]
    if not given:
        return []
    if args.interval_unit is None:
        slime_terms = any(getattr(args, dest) is not None for dest in SLIME_SHAPE)
        if slime_terms and mu > 1:
            flag, dest = given[0]
            n = getattr(args, dest)
            flag_error(flag, f"{n} is ambiguous here: slime counts rollouts, megamu counts optimiser updates "
                             f"(Megatron-LM's iterations), and each rollout is μ = {mu} updates. Add --interval-unit "
                             f"rollouts for slime's meaning (every {n} rollouts = {n * mu} updates) or --interval-unit "
                             f"updates (every {n} updates)")
        return []
    if args.interval_unit == "updates":
        return []
    if is_async:
        flag_error("--interval-unit", "rollouts: async mode has no rollouts of a fixed size (give updates)")
    for _, dest in given:
        setattr(args, dest, getattr(args, dest) * mu)
    return [f"{flag} {getattr(args, dest) // mu} rollouts -> {'' if 'warmup' in dest else 'every '}"
            f"{getattr(args, dest)} updates (μ = {mu})" for flag, dest in given]
