"""Command-line flags: Megatron-LM names for shared concepts, ours for μ-GRPO. Validated up front, errors name the flag.

With no flags at all the program runs the embedded default: the CPU demo (SmolLM2-135M-Instruct on two-digit addition).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from megamu.algo import ALGORITHM_PRESETS, AlgoConfig
from megamu.arguments.defaults import announcements, gpus_per_node, resolve_defaults, servers_note, world_size
from megamu.arguments.engine import add_engine_arguments, engine_config, engine_flags  # noqa: F401 (tools/evaluate.py)
from megamu.arguments.evaluation import add_evaluation_arguments, eval_sets, evaluation_config, tracker_config
from megamu.arguments.flag_errors import build_config, flag_error, flag_of, flag_or_path  # noqa: F401 (tests)
from megamu.arguments.generated import add_fields, field_values
from megamu.arguments.megatron import add_megatron_arguments, check_megatron_arguments, optimizer_offload_note
from megamu.arguments.model_args import add_model_arguments, check_model_arguments, resolve_hf_checkpoint
from megamu.arguments.reward import add_reward_arguments, answer_key, reward_config  # noqa: F401 (tools/evaluate.py)
from megamu.arguments.sglang_flags import forward_sglang_flags
from megamu.arguments.slime import (
    add_slime_arguments,
    convert_intervals,
    dynamic_micro_batch,
    resolve_precision,
    translate_slime_arguments,
)
from megamu.config.loop_config import AsyncConfig
from megamu.config.plan import AsyncPlan, Plan, StagedPlan, plan_type, stage_counts
from megamu.config.run_config import DEFAULT_ALGORITHM, RunConfig, hf_model_config
from megamu.data.stage_prompts import PromptsConfig
from megamu.errors import ConfigError
from megamu.memory.memory_fixes import fix_sets
from megamu.mode import DEFAULT_MODE, MODE_NAMES
from megamu.model.moe_settings import MoeSettings
from megamu.rollout import RolloutConfig
from megamu.runtime.device import Device
from megamu.training.checkpoint_dirs import TRACKER, latest_checkpoint
from megamu.training.optimizer import OptimizerConfig
from megamu.training.policy import CheckpointConfig, PolicyConfig

BUILTIN_DATA = "builtin:addition"  # the demo task: seeded two-digit additions, generated in-process


# The flags are generated from the config tree (fields made with megamu.config_fields.flag), group by group in the
# order --help shows. Written out (here and in megatron.py, model_args.py, slime.py, evaluation.py): only flags whose
# value is not a field's value, which parse_args converts (the fields they set say so: config_fields.derived): a list
# of files, a preset or mode that picks a whole part, slime's and Megatron-LM's spellings of other settings, and the
# model flags checked against --hf-checkpoint. The engine's and the reward's groups are added by engine.py and
# reward.py (tools/evaluate.py shares them).
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_mu_grpo.py", description=__doc__, allow_abbrev=False)
    g = p.add_argument_group("model and parallelism (Megatron names)")
    add_fields(g, PolicyConfig, ["hf_checkpoint"])
    add_fields(g, RunConfig, ["tensor_model_parallel_size", "expert_model_parallel_size",
                              "expert_tensor_parallel_size"])
    add_fields(g, PolicyConfig, ["transformer_impl", "bf16"])
    add_fields(g, RunConfig, ["seed"])
    add_fields(g, RunConfig, ["distributed_timeout_minutes"])
    add_fields(g, PolicyConfig, ["sequence_parallel", "recompute_granularity", "moe_router_load_balancing_type",
                                 "moe_aux_loss_coeff"])
    add_fields(g, MoeSettings)

    g = p.add_argument_group("optimiser (Megatron names)")
    add_fields(g, OptimizerConfig, ["lr", "lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "min_lr",
                                    "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"])
    add_fields(g, PolicyConfig, ["micro_batch_size", "max_tokens_per_micro_batch"])
    add_fields(g, OptimizerConfig, ["max_skipped_steps"])

    g = p.add_argument_group("checkpoints and logging (Megatron names)")
    add_fields(g, CheckpointConfig, ["save", "load", "pretrained_checkpoint", "save_interval", "hf_export_interval",
                                     "keep", "keep_hf_exports", "save_optim"])
    add_fields(g, PolicyConfig, ["export_dtype"])
    add_fields(g, RunConfig, ["tensorboard_dir", "log_interval"])

    g = p.add_argument_group("data")
    g.add_argument("--prompt-data", default=BUILTIN_DATA, help="FILE[,FILE...] jsonl/parquet, or builtin:addition")
    add_fields(g, PromptsConfig, ["prompt_key", "answer_key", "chat_template", "instruction", "max_prompt_length",
                                  "skip_bad_rows"])
    add_reward_arguments(p)

    g = p.add_argument_group("μ-GRPO stages")
    add_fields(g, StagedPlan, ["num_stages"])
    add_fields(g, AsyncPlan, ["train_iters"])
    g.add_argument("--prompts-per-stage", type=int, default=None, help="B_train: prompt groups per rollout stage")
    add_fields(g, StagedPlan, ["prompts_per_update", "mu"])
    g.add_argument("--rollout-batch-size", type=int, default=None,
                   help="slime's name for --prompts-per-stage: prompts per rollout (x G samples)")
    add_fields(g, StagedPlan, ["n_samples_per_prompt"])
    g.add_argument("--algorithm", choices=sorted(ALGORITHM_PRESETS), default=None,
                   help=f"default {DEFAULT_ALGORITHM}; grpo for a launch giving slime's --advantage-estimator or "
                        "--eps-clip without it (slime's GRPO)")
    add_fields(g, AlgoConfig, ["clip_low", "clip_high", "veto_threshold", "veto_scope", "m2po_threshold",
                               "aggregation", "use_kl_loss", "kl_coef", "kl_type", "entropy_coef", "overlong_buffer",
                               "overlong_penalty_factor", "dynamic_sampling", "max_sampling_rounds", "filter_metric",
                               "sampling_round_prompts", "fill_short_stage", "clip_ratio_c"])
    g.add_argument("--behaviour-logprobs", choices=["engine", "recompute"], default="engine")
    add_fields(g, PolicyConfig, ["skip_zero_advantage"])

    g = p.add_argument_group("rollout")
    g.add_argument("--rollout-mode", choices=MODE_NAMES, default=None,  # resolved in parse_args (resolve_defaults):
                   help=f"default {DEFAULT_MODE.name}")  # slime's --colocate may set it
    add_fields(g, PolicyConfig, ["offload_train"])
    add_fields(g, RolloutConfig, ["temperature", "top_p"])
    add_fields(g, StagedPlan, ["max_response_len"])  # the run's response bound: the plan's, passed to the rollout
    add_fields(g, RolloutConfig, ["groups_per_shard", "shards_per_call"])
    add_engine_arguments(p)

    g = p.add_argument_group("async rollout (--rollout-mode async, §5.1)")
    add_fields(g, AsyncPlan, ["max_policy_lag", "weight_sync_interval"])
    add_fields(g, AsyncConfig, ["queue_groups", "rollout_devices"])

    g = p.add_argument_group("run control")
    add_fields(g, RunConfig, ["gpu_memory_gib", "host_memory_gib", "measured_peaks"])
    add_fields(g, RunConfig, ["dry_run"])
    add_evaluation_arguments(p)
    add_megatron_arguments(p)
    add_model_arguments(p)
    add_slime_arguments(p)
    return p


def plan_of(args: argparse.Namespace) -> Plan:
    """The run's shape from the flags: staged modes take any two of B_train, B_mini, μ and the stages (or
    --train-iters); async mode takes --train-iters, N and K."""
    if args.rollout_batch_size is not None:  # slime's flag, megamu's --prompts-per-stage
        if args.prompts_per_stage not in (None, args.rollout_batch_size):
            flag_error("--rollout-batch-size", f"{args.rollout_batch_size} contradicts --prompts-per-stage "
                                               f"{args.prompts_per_stage} (the same quantity: give one)")
        args.prompts_per_stage = args.rollout_batch_size
    if args.global_batch_size is not None and args.prompts_per_update is None:  # Megatron's: samples per update
        if args.global_batch_size % args.n_samples_per_prompt:
            flag_error("--global-batch-size", f"{args.global_batch_size} samples is not a whole number of groups of "
                                              f"--n-samples-per-prompt {args.n_samples_per_prompt}")
        args.prompts_per_update = args.global_batch_size // args.n_samples_per_prompt
    if plan_type(args.rollout_mode) is AsyncPlan:  # async: updates on a stream, no stages
        if args.prompts_per_stage is not None:
            flag_error("--prompts-per-stage", "has no meaning with --rollout-mode async (no stages): give "
                                              "--train-iters and --prompts-per-update")
        for flag, value in (("--num-stages", args.num_stages), ("--mu", args.mu)):
            if value is not None:
                flag_error(flag, "has no meaning in async mode")
        if args.train_iters is None:
            flag_error("--train-iters", "required in async mode")
        return build_config(AsyncPlan, at="plan", prompts_per_update=args.prompts_per_update or 4,
                            n_samples_per_prompt=args.n_samples_per_prompt,
                            max_response_len=args.rollout_max_response_len, train_iters=args.train_iters,
                            weight_sync_interval=args.weight_sync_interval, max_policy_lag=args.max_policy_lag)
    num_stages, b_mini, mu = build_config(stage_counts, at="plan", prompts_per_stage=args.prompts_per_stage,
                                          prompts_per_update=args.prompts_per_update, mu=args.mu,
                                          num_stages=args.num_stages, train_iters=args.train_iters)
    return build_config(StagedPlan, at="plan", prompts_per_update=b_mini,
                        n_samples_per_prompt=args.n_samples_per_prompt, max_response_len=args.rollout_max_response_len,
                        rollout_mode=args.rollout_mode, num_stages=num_stages, mu=mu)


def check_paths(args: argparse.Namespace) -> None:
    """Inputs must exist before anything starts; a dry run of a cluster script on a laptop only warns."""
    missing = []
    if args.hf_checkpoint and not os.path.exists(os.path.join(args.hf_checkpoint, "config.json")):
        missing.append(("--hf-checkpoint", f"{args.hf_checkpoint} has no config.json"))
    if args.prompt_data != BUILTIN_DATA:
        for f in args.prompt_data.split(","):
            if not os.path.exists(f):
                missing.append(("--prompt-data", f"{f} does not exist"))
    missing += start_point_errors(args)
    for flag, message in missing:
        if not args.dry_run:
            flag_error(flag, message)
        print(f"warning: {flag}: {message} (ignored by --dry-run)", flush=True)
    if args.dry_run:
        check_first_rows(args)


def check_first_rows(args: argparse.Namespace, rows: int = 8) -> None:
    """A dry run reads the first rows of each data file that is here (a run reads them all before its first
    rollout): bad JSON or a row without the problem or answer keys is an error naming the file and the row."""
    from megamu.data.prompts import first_rows_errors

    files = {"--prompt-data": [] if args.prompt_data == BUILTIN_DATA else args.prompt_data.split(","),
             "--eval-prompt-data": list(args.eval_prompt_data[1::2])}
    for flag, paths in files.items():
        errors = first_rows_errors([f for f in paths if os.path.exists(f)], args.prompt_key, answer_key(args), rows)
        if errors:
            flag_error(flag, f"the first {rows} rows of each file: " + "; ".join(errors[:5]) + (
                f"; ... and {len(errors) - 5} more" if len(errors) > 5 else ""))


def start_point_errors(args: argparse.Namespace) -> list[tuple[str, str]]:
    """A new run's --load / --pretrained-checkpoint must hold a checkpoint (a typo would start from the HF weights
    unnoticed); once --save holds one, restarts resume from it and the start point is not read."""
    if latest_checkpoint(args.save) is not None:
        return []
    return [(flag, f"{path} holds no checkpoint (no {TRACKER})") for flag, path in
            (("--load", args.load), ("--pretrained-checkpoint", args.pretrained_checkpoint))
            if path and Path(path) != Path(args.save) and latest_checkpoint(path) is None]


def hf_config(args: argparse.Namespace) -> dict | None:
    """--hf-checkpoint's config.json, when it is readable here (a dry run of a cluster script may not see it)."""
    return hf_model_config(args.hf_checkpoint)


def model_context(args: argparse.Namespace, config: dict | None) -> int | None:
    """The model's context (max_position_embeddings); a reply as long as it leaves no room for any prompt."""
    context = (config or {}).get("max_position_embeddings")
    if context and args.rollout_max_response_len >= context:
        flag_error("--rollout-max-response-len", f"{args.rollout_max_response_len} leaves no room for a prompt in the "
                   f"model's context of {context} (max_position_embeddings of --hf-checkpoint)")
    return context


def check_device(args: argparse.Namespace, device: Device) -> None:
    """What the device cannot do is refused here, before any process group or model exists."""
    if args.bf16 and not device.is_cuda:
        message = ("needs a GPU: the CPU optimiser keeps no fp32 master weights, so CPU runs train in fp32 "
                   "(drop --bf16 here)")
        if not args.dry_run:
            flag_error("--bf16", message)
        if not getattr(args, "bf16_by_default", False):  # a slime launch's bf16: said by its note
            print(f"warning: --bf16: {message} (ignored by --dry-run: the plan is for a GPU machine)", flush=True)
    if args.transformer_impl == "transformer_engine" and not device.is_cuda and not args.dry_run:
        flag_error("--transformer-impl", "transformer_engine needs a GPU; use local on CPU")


def check_inputs(args: argparse.Namespace, device: Device) -> None:
    """What no single config can see: the launcher's world size, the reward flags, the input paths and the device."""
    world = world_size(args)
    if args.tensor_model_parallel_size > 0 and world % args.tensor_model_parallel_size:
        flag_error("--tensor-model-parallel-size",
                   f"{args.tensor_model_parallel_size} does not divide world size {world}")
    # megatron-core's expert groups (parallel_state.py:786-795): ETP x EP x expert-DP = the world, ETP = TP unless given
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    experts = etp * args.expert_model_parallel_size
    if experts > 0 and world % experts:
        flag = "--expert-tensor-parallel-size" if args.expert_tensor_parallel_size else "--expert-model-parallel-size"
        flag_error(flag, f"ETP x EP = {etp} x {args.expert_model_parallel_size} = {experts} does not divide world size "
                         f"{world}" + ("" if args.expert_tensor_parallel_size else
                                       f" (ETP is --tensor-model-parallel-size {etp} unless "
                                       "--expert-tensor-parallel-size gives the experts their own)"))
    reward_config(args)  # its errors before any path check
    check_paths(args)
    check_device(args, device)


# slime's spellings of the plan's fields: a fix is named in the flag the launch wrote
SLIME_MEMORY_FLAGS = {"max_tokens_per_micro_batch": "--max-tokens-per-gpu"}


def check_memory(plan, argv: list[str] | tuple[str, ...] = ()) -> None:
    """A MemoryPlan that overflows the device is an error naming the line that overflows and each change that makes
    it fit (megamu.memory.memory_fixes.fix_sets: a flag alone, or a layout with the budget that fits at it), in the
    flags of ``argv`` where it wrote slime's (``SLIME_MEMORY_FLAGS``); else the device size."""
    try:
        plan.check()
    except ConfigError as e:
        if e.field != "gpu_memory_gib":
            build_config(plan.check, at="memory")
        written = {field: slime for field, slime in SLIME_MEMORY_FLAGS.items()
                   if any(a == slime or a.startswith(slime + "=") for a in argv)}

        def flag(field: str, value) -> str:
            name = written.get(field) or flag_or_path("memory." + field)
            return name if value is True else f"{name} {value}"

        remedies = [" ".join(flag(field, value) for field, value in changes) for changes in fix_sets(plan.config)]
        tail = f" Any one of these fits: {'; '.join(remedies)}" if remedies else ""
        flag_error(flag_or_path("memory." + e.field), e.message + "." + tail)


def parse_args(argv: list[str] | None = None, device: Device | None = None) -> RunConfig:
    """Flags -> RunConfig, every check done (errors name the flag). ``device``: the machine's, unless given."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    device = device or Device.detect()
    notes = forward_sglang_flags(args, unknown, parser)  # slime's --sglang-<name>: SGLang's own --<name>
    notes += translate_slime_arguments(args)  # before any check: the checks read megamu's flags
    notes += resolve_defaults(args, device)
    notes += resolve_precision(args, device)
    resolve_hf_checkpoint(args)
    check_inputs(args, device)
    config = hf_config(args)
    check_model_arguments(args, config)
    plan = plan_of(args)
    check_megatron_arguments(args, plan.prompts_per_update)
    notes += convert_intervals(args, 1 if plan.mode.streams else plan.mu, plan.mode.streams)
    dynamic_micro_batch(args, plan.prompts_per_update * plan.n_samples_per_prompt)
    algo = build_config(AlgoConfig.preset(args.algorithm).with_overrides, at="algo",
                        **field_values(AlgoConfig, args))
    # the values the run stores once (seed, G, response bound, temperature, device, run directory) and what follows
    # from the run (lr_decay_iters, B_train, the built-in rows, ...) are passed down by RunConfig.derive
    optimizer = build_config(OptimizerConfig, at="policy.optimizer", **field_values(OptimizerConfig, args))
    moe = build_config(MoeSettings, at="policy.moe", **field_values(MoeSettings, args))
    if (args.transformer_impl or device.transformer_impl) == "local" and not args.dry_run:
        notes += moe.cpu_fallbacks()
    policy = build_config(
        PolicyConfig, at="policy", **field_values(PolicyConfig, args), optimizer=optimizer, moe=moe,
        checkpoint=build_config(CheckpointConfig, at="policy.checkpoint", **field_values(CheckpointConfig, args)))
    rollout = build_config(RolloutConfig, at="rollout", **field_values(RolloutConfig, args), reward=reward_config(args))
    async_ = None
    if plan.mode.streams:
        async_ = build_config(AsyncConfig, at="async_", **field_values(AsyncConfig, args))
    model_context(args, config)
    prompts = build_config(
        PromptsConfig, at="prompts",
        files=() if args.prompt_data == BUILTIN_DATA else tuple(args.prompt_data.split(",")),
        **field_values(PromptsConfig, args), eval_sets=eval_sets(args))
    run = build_config(
        RunConfig, plan=plan, algo=algo, device=device, policy=policy, engine=engine_flags(args), rollout=rollout,
        async_=async_, prompts=prompts, **field_values(RunConfig, args),
        recompute_behaviour_logprobs=args.behaviour_logprobs == "recompute",
        evaluation=evaluation_config(args), tracker=tracker_config(args), world_size=world_size(args),
        ranks_per_node=gpus_per_node(args))
    build_config(lambda: run.memory, at="memory")  # the memory plan's inputs checked now (computed from the run)
    notes += optimizer_offload_note(args, run.memory)
    if os.environ.get("RANK", "0") == "0":
        for line in notes + servers_note(run, args.sglang_num_servers) + announcements(run, args.interval_unit):
            print(line if line.startswith("warning: ") else f"note: {line}", flush=True)
    return run
