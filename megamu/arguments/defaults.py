"""Defaults that follow from where the run goes (GPUs or CPU, the launcher's world) rather than from one config field,
decided once here, and the start-up lines that announce them and every default a verl or slime user would not expect.
"""

from __future__ import annotations

import argparse
import os

from megamu.arguments.flag_errors import flag_error
from megamu.mode import DEFAULT_MODE
from megamu.runtime.device import Device

# verl's actor.loss_agg_mode default (volcengine/verl verl/trainer/config/actor/actor.yaml:82, b178a3c)
VERL_LOSS_AGGREGATION = "token-mean"


def world_size(args: argparse.Namespace) -> int:
    """torchrun's WORLD_SIZE; without torchrun (a dry run), slime's --actor-num-nodes x --actor-num-gpus-per-node."""
    actors = (args.actor_num_nodes or 1) * (args.actor_num_gpus_per_node or 1)
    given = args.actor_num_nodes is not None or args.actor_num_gpus_per_node is not None
    if "WORLD_SIZE" not in os.environ:
        return actors
    world = int(os.environ["WORLD_SIZE"])
    if given and actors != world:
        flag_error("--actor-num-nodes/--actor-num-gpus-per-node", f"{args.actor_num_nodes or 1} x "
                   f"{args.actor_num_gpus_per_node or 1} = {actors} GPUs contradicts torchrun's world of {world}")
    return world


def gpus_per_node(args: argparse.Namespace) -> int:
    """torchrun's --nproc_per_node (LOCAL_WORLD_SIZE), else slime's --actor-num-gpus-per-node, else the world."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else (args.actor_num_gpus_per_node or world_size(args))


def resolve_defaults(args: argparse.Namespace, device: Device) -> list[str]:
    """The mode (megamu.mode.DEFAULT_MODE); the engine itself and its server count follow from the run
    (RunConfig.derive). Returns the lines announcing what was chosen."""
    notes = []
    args.rollout_mode = args.rollout_mode or DEFAULT_MODE.name
    if args.rollout_engine is None and device.is_cuda:
        notes.append("rollout engine: sglang (the default on GPUs; --rollout-engine local for the in-process one)")
    return notes


def servers_note(run, given: int | None) -> list[str]:
    """The line announcing the SGLang server count a run chose (``given``: --sglang-num-servers, None if unset): one
    per --sglang-tp-size GPUs of the node when the servers take turns with the trainer or share its GPUs."""
    sg = run.engine.sglang
    if given is not None or run.engine.kind != "sglang" or not run.for_gpu or run.plan.mode.streams:
        return []
    return [f"SGLang servers: {sg.num_servers} per node x --sglang-tp-size {sg.tp_size} = {sg.num_servers * sg.tp_size}"
            f" of the node's {run.ranks_per_node} GPUs (default: nproc_per_node / --sglang-tp-size; "
            "--sglang-num-servers sets it)"]


def announcements(run, interval_unit: str | None = None) -> list[str]:
    """Defaults of the run a verl or slime user would not assume, said at start (docs/coming-from-slime-verl.md);
    ``interval_unit``: --interval-unit, when the launch said what its intervals count."""
    algo, lines = run.algo, []
    if algo.aggregation != VERL_LOSS_AGGREGATION:
        lines.append(f"loss aggregation: {algo.aggregation} (each reply's token mean, then the mean over replies); "
                     f"verl's default is {VERL_LOSS_AGGREGATION}: --loss-aggregation {VERL_LOSS_AGGREGATION} for it")
    high = "none" if algo.clip_high is None else f"{1 + algo.clip_high:g}"
    if (algo.clip_low, algo.clip_high) != (0.2, 0.2):
        lines.append(f"ratio clip: [{1 - algo.clip_low:g}, {high}] ({run.algo.name}); slime's and verl's default is "
                     "[0.8, 1.2] (--clip-low/--eps-clip, --clip-high/--eps-clip-high)")
    if (run.save_interval or run.evaluation.eval_interval) and not run.plan.mode.streams and run.plan.mu > 1 \
            and interval_unit is None:
        lines.append(f"intervals (--save-interval, --eval-interval) count optimiser updates, every {run.save_interval} "
                     f"and {run.evaluation.eval_interval} here; slime and verl count rollouts (1 rollout = μ = "
                     f"{run.plan.mu} updates): --interval-unit rollouts for theirs")
    return lines

