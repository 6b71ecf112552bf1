"""Training checkpoints in megatron-core's ``dist_checkpointing`` format (``torch_dist``, what Megatron-LM writes).

Layout (Megatron-LM's)::

    save_dir/latest_checkpointed_iteration.txt   "12"
    save_dir/iter_0000012/                       a torch_dist checkpoint: metadata.json, .metadata, common.pt,
                                                 __<rank>_<i>.distcp (each rank writes its own shards)
    save_dir/iter_0000012/megamu_state.json      megamu's run state: update count, the caller's ``extra`` (stage,
                                                 rollout cursor, ...), every rank's RNG, the architecture

Inside the torch_dist checkpoint the model's tensors carry megatron-core's own keys (``model.sharded_state_dict()``,
the same whichever layer spec wrote them) and the Adam moments Megatron's optimiser keys,
``optimizer.state.exp_avg.<param key>`` (+ ``exp_avg_sq``, and ``main_param`` for a bf16 model's fp32 master
weights). ``dist_checkpointing.load`` reshards, so a checkpoint loads at any TP or DP size; a checkpoint with no
``megamu_state.json`` (written by Megatron-LM or plain megatron-core code) gives its weights (and moments when it has
them) and no run state. Folders in megamu's previous layout (safetensors, ``state.json``; retired, see CHANGELOG.md)
are refused with what to do.

CPU: megatron-core 0.16.1's stock save refuses a CPU-only torch: ``FileSystemWriterAsync.preload_tensors``
(strategies/filesystem_async.py:230) calls ``torch.cuda.synchronize()``, and ``save_state_dict_async_finalize``
(strategies/state_dict_saver.py:252) and the async-save machinery (strategies/async_utils.py:165, 212, 488, 604) use
``torch.cuda.current_device()``. ``SyncTorchDistSave`` writes the same format through PyTorch's synchronous
``FileSystemWriter`` with megatron's own planner and key translation.

It is used on CUDA too, for the waits: the stock strategy runs torch.distributed.checkpoint's plan and finish
collectives on the default group (``save_state_dict_async_plan(..., None, coordinator)``, strategies/torch.py:703),
where every rank waits for the slowest writer under the NCCL watchdog's timeout. ``SyncTorchDistSave`` gives them
``parallel.save_group``: gloo on the CPU, its timeout sized to the save.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.checkpoint import CheckpointException

from megamu.errors import ConfigError
from megamu.model import ModelArch, unwrap
from megamu.runtime import parallel
from megamu.runtime.atomic import atomic_write_text, make_temp_dir
from megamu.training.checkpoint_dirs import (
    TRACKER,
    CheckpointError,
    _raise_any,
    _rng_state,
    _set_rng_state,
    _world,
    iteration_dir,
    latest_checkpoint,
    latest_iteration,  # noqa: F401  (megamu.training re-exports it)
    publish,
)
from megamu.training.megatron_schema import CHECKPOINT_VERSION, megatron_entries

RUN_STATE = "megamu_state.json"
PREVIOUS_LAYOUT_STATE = "state.json"  # the run state of megamu's previous layout: recognised only to refuse it
FORMAT = "megamu-run-state-2"
MOMENTS = ("exp_avg", "exp_avg_sq", "main_param")  # main_param: fp32 master weights of a bf16 model (GPU)
OPT_PREFIX = "optimizer.state"  # megatron-core's prefix for per-parameter state (optim_state_to_sharding_state)


def _sync_save_strategy(process_group=None):
    """A torch_dist save strategy whose collectives run on ``process_group`` (see the module docstring)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class SyncTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir: Path) -> None:
            # the same translation and planner as the stock async_save, then PyTorch's synchronous writer (it copies
            # CUDA tensors to the host as it writes), whose collectives run on the given gloo group
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp.save(mcore_to_pyt_state_dict(flat, False),
                     storage_writer=dcp.FileSystemWriter(checkpoint_dir, thread_count=self.thread_count),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                              flatten_state_dict=False),
                     process_group=process_group)

    return SyncTorchDistSave("torch_dist", 1)


def save_strategy(process_group=None):
    """The torch_dist save strategy on every device: synchronous, its collectives on ``process_group``."""
    return _sync_save_strategy(process_group)


def _largest_rank_bytes(*sharded: dict) -> int:
    """The most bytes any rank writes in this save (tensors only, replicas counted: an upper bound)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    mine = sum(v.data.numel() * v.data.element_size() for d in sharded for v in nested_values(d)
               if isinstance(v, ShardedTensor) and v.data is not None)
    return max(parallel.all_gather_object(mine))


def _param_tensors(model_sd: dict) -> dict[int, tuple[str, object]]:
    """id(parameter) -> (its name in ``model_sd``, its ShardedTensor, or ShardedTensorFactory: a SwiGLU fc1 is
    stored as two tensors, gate and up, so that TP resharding splits each half). ``sharded_state_dict`` keeps the
    parameters themselves as ``data``; the name tells layers apart, the stored key does not (layers are stacked: one
    key, an offset per layer)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return {id(v.data): (k, v) for k, v in model_sd.items() if isinstance(v, (ShardedTensor, ShardedTensorFactory))}


def _optimizer_sharded(model, model_sd: dict, optimizer, *, templates: bool) -> tuple[dict, dict]:
    """({name: ShardedTensor} of every parameter's moments, {name: step}); sharded like the parameter itself.

    ``templates``: empty tensors of the right shapes to load into, else the optimiser's current state (every rank
    asks for every parameter: on GPU ``param_state`` is a data-parallel collective). Both live in host memory: the
    GPU's ``param_state`` streams each state to the host through one bounded buffer, and a load moves only each
    rank's range to the device (``megamu.training.optimizer_shards``), so neither materialises the optimiser state
    on the GPU a second time (the memory plan's ``checkpoint`` phase)."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    by_id = _param_tensors(model_sd)
    out, steps = {}, {}
    for p in unwrap(model).parameters():
        name, sh = by_id[id(p)]
        if templates:
            dtype = torch.float32 if parallel.device().is_cuda else p.dtype  # GPU moments are fp32 (megatron Adam)
            keys = MOMENTS if p.dtype != torch.float32 and parallel.device().is_cuda else MOMENTS[:2]
            state = {k: torch.empty(p.shape, dtype=dtype) for k in keys}  # host: see the docstring
        else:
            # only the main replica of a shard is written (torch_dist's keep_only_main_replica): the others stage
            # nothing and add no entry (megatron validates coverage by the main replicas alone, validation.py:411)
            state = optimizer.param_state(p, writes=is_main_replica(sh.replica_id))
            if state is None:  # before the first update: no moments anywhere (all parameters step together)
                continue
            steps[name] = float(state["step"])
        for k in MOMENTS:
            if k in state:  # stored as "optimizer.state.<k>.<param key>", Megatron's optimiser keys
                out[f"{k}.{name}"] = make_sharded_optimizer_tensor(sh, state[k], f"{OPT_PREFIX}.{k}")
    return out, steps


def _write_sharded(sharded: dict, folder: Path, group=None) -> None:
    """``dist_checkpointing.save`` with its collectives on ``group`` (a seam for tests that simulate a failed
    write)."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded, str(folder), sharded_strategy=save_strategy(group))


def save_checkpoint(
    save_dir: str | Path, iteration: int, model, arch: ModelArch, optimizer, *, extra: dict,
    hf_source_dir: str | Path | None = None, keep: int = 2, save_optim: bool = True,
) -> Path:
    """Write ``save_dir/iter_{iteration:07d}`` and point the tracker at it; returns the folder (on every rank).

    ``extra`` (JSON-serialisable: stage, update offset, ...) comes back from ``load_checkpoint``. ``keep``: how many
    checkpoints to leave (newest first, the new one always among them; 0 keeps all), see ``prune_checkpoints``.
    ``hf_source_dir``: recorded in the run state (where the run's tokenizer and config came from). ``save_optim``
    False (Megatron's --no-save-optim): no optimiser state; a resume restarts Adam from zero moments.

    Every rank writes its own shards into one temp folder beside the target (``save_dir`` must be on a filesystem
    every rank sees, as for Megatron); rank 0 then adds the run state, renames the folder into place and moves the
    tracker, so a reader never sees a half-written checkpoint.
    """
    json.dumps(extra)  # fail before any collective, not halfway through a write
    if keep < 0:
        raise ConfigError("keep_checkpoints", f"must be >= 0 (0 keeps all), got {keep}")
    out = iteration_dir(save_dir, iteration)
    _, world = _world()
    main = parallel.is_main_rank()
    rngs = parallel.all_gather_object(_rng_state())
    tmp = Path(parallel.all_gather_object(str(make_temp_dir(out)) if main else None)[0])
    model_sd = unwrap(model).sharded_state_dict()
    opt_sd, steps = _optimizer_sharded(model, model_sd, optimizer, templates=False) if save_optim else ({}, {})
    bf16 = any(p.dtype == torch.bfloat16 for p in unwrap(model).parameters())
    entries = megatron_entries(arch, iteration, optimizer.cfg, plan=extra.get("plan"), world=world,
                               hf_source_dir=str(hf_source_dir) if hf_source_dir is not None else None, bf16=bf16)
    entries["args"].no_save_optim = not save_optim
    sharded = {"model": model_sd, "optimizer": opt_sd, "optimizer_steps": steps, "iteration": iteration,
               "checkpoint_version": CHECKPOINT_VERSION,  # Megatron-LM's top-level names, and what it reads besides
               **entries}
    group = parallel.save_group(_largest_rank_bytes(model_sd, opt_sd))  # every wait below: gloo, sized to the save
    error = None
    try:
        _write_sharded(sharded, tmp, group)
    except (Exception, CheckpointException) as e:  # disk full on one rank: every rank still reaches the gather
        error = f"{type(e).__name__}: {e}"
    has_optimizer_state = bool(steps)  # every rank has the steps; the moments only where it writes them
    del sharded, opt_sd  # the host copy of the optimiser state goes before the rank moves on
    parallel.device().release_host_cache()  # megatron's pinned staging: back to the OS, not kept for the run
    errors = parallel.all_gather_object(error, group)  # a rank that wrote less waits here for the slowest

    def finish() -> None:
        _raise_any(errors, f"writing checkpoint {out}")
        atomic_write_text(tmp / RUN_STATE, json.dumps({
            "format": FORMAT,
            "iteration": iteration,
            "optimizer": optimizer.state_dict(),
            "has_optimizer_state": has_optimizer_state,
            "tensor_model_parallel_size": parallel.tp_size(),
            "data_parallel_size": parallel.dp_size(),
            "world_size": world,
            "arch": arch.to_dict(),
            "hf_source_dir": str(hf_source_dir) if hf_source_dir is not None else None,
            "extra": extra,
            "rng": rngs,
        }, indent=1) + "\n")

    return publish(main, tmp, out, save_dir, iteration, keep, finish, group)


def load_checkpoint(load_dir: str | Path, model, arch: ModelArch, optimizer) -> dict | None:
    """Restore model, optimiser and RNG from the latest checkpoint in ``load_dir`` (written at any TP or DP size).

    Returns the ``extra`` dict given to ``save_checkpoint`` plus "iteration"; None when there is no checkpoint. A
    checkpoint without megamu's run state (Megatron-LM's) loads its weights, and its Adam moments when it has them,
    and returns ``{"iteration": N, "run_state": False}``: the caller starts a new run from those weights.
    """
    found = latest_checkpoint(load_dir)
    if found is None:
        return None
    iteration, folder = found
    if not (folder / "metadata.json").exists():
        if (folder / PREVIOUS_LAYOUT_STATE).exists():
            raise CheckpointError(
                f"{folder}: a checkpoint in megamu's previous layout (safetensors with {PREVIOUS_LAYOUT_STATE}), which "
                "megamu no longer reads (CHANGELOG.md). Resume it once with megamu at commit 7cf1936 or earlier: its "
                "next checkpoint, in the same --save folder, is written in torch_dist, which this version loads.")
        raise CheckpointError(f"{folder}: not a torch_dist checkpoint (no metadata.json)")
    state = _read_run_state(folder)
    if state is not None and state.get("arch") and ModelArch.from_dict(state["arch"]) != arch:
        raise CheckpointError(f"{folder / RUN_STATE}: the checkpoint's architecture {state['arch']} differs from "
                              f"the model's {arch}")
    try:
        _load_sharded(folder, model, optimizer, state)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # truncated files, missing keys (CheckpointException is a
        # BaseException: torch DCP's way to carry every rank's failure)
        raise CheckpointError(f"{folder}: corrupt, incomplete or incompatible checkpoint "
                              f"({type(e).__name__}: {e})") from e
    if state is None:
        parallel.barrier()
        return {"iteration": iteration, "run_state": False}
    optimizer.load_state_dict(state["optimizer"])
    rngs = state["rng"]
    rank, world = _world()
    if len(rngs) == world:
        _set_rng_state(rngs[rank])  # a different world size cannot resume the same random streams
    parallel.barrier()
    return {**state["extra"], "iteration": state["iteration"]}


def _read_run_state(folder: Path) -> dict | None:
    path = folder / RUN_STATE
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the run state ({e})") from e
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {state.get('format')!r}, expected {FORMAT!r}")
    return state


def _load_sharded(folder: Path, model, optimizer, state: dict | None) -> None:
    from megatron.core import dist_checkpointing

    model_sd = unwrap(model).sharded_state_dict()
    names = {i: name for i, (name, _) in _param_tensors(model_sd).items()}  # before load, which rewrites model_sd
    sharded = {"model": model_sd}
    if state is None:  # a foreign checkpoint: its moments are loaded when it has them, under Megatron's keys
        saved = dist_checkpointing.load_tensors_metadata(str(folder))
        with_moments = any(k.startswith(f"{OPT_PREFIX}.exp_avg.") for k in saved)
    else:
        with_moments = state["has_optimizer_state"]
    if with_moments:
        sharded["optimizer"], _ = _optimizer_sharded(model, model_sd, optimizer, templates=True)
    loaded = dist_checkpointing.load(sharded, str(folder))
    unwrap(model).load_state_dict(loaded["model"])
    if not with_moments:
        return
    steps = loaded.get("optimizer_steps", {})
    for p in unwrap(model).parameters():
        name = names[id(p)]
        moments = {k: loaded["optimizer"][f"{k}.{name}"] for k in MOMENTS if f"{k}.{name}" in loaded["optimizer"]}
        # Megatron-LM keeps Adam's step in its param groups; a foreign checkpoint without per-parameter steps
        # resumes the bias correction from its iteration count
        step = steps.get(name, float(loaded.get("iteration", 0)))
        optimizer.load_param_state(p, {**moments, "step": torch.tensor(step)})


def save_model_checkpoint(save_dir: str | Path, iteration: int, model) -> Path:
    """The model alone as a torch_dist checkpoint ``save_dir/iter_N`` + tracker, as Megatron-LM lays it out (what
    ``--load`` with ``--finetune`` / ``--no-load-optim`` reads; ``load_checkpoint`` gives it as a run's initial
    weights). Collective; the folder appears only once complete; no older checkpoint is pruned."""
    out = iteration_dir(save_dir, iteration)
    main = parallel.is_main_rank()
    tmp = Path(parallel.all_gather_object(str(make_temp_dir(out)) if main else None)[0])
    model_sd = unwrap(model).sharded_state_dict()
    group = parallel.save_group(_largest_rank_bytes(model_sd))
    error = None
    try:
        _write_sharded({"model": model_sd, "iteration": iteration, "checkpoint_version": 3.0}, tmp, group)
    except (Exception, CheckpointException) as e:  # every rank still reaches the gather below
        error = f"{type(e).__name__}: {e}"
    errors = parallel.all_gather_object(error, group)
    return publish(main, tmp, out, save_dir, iteration, 0, lambda: _raise_any(errors, f"writing {out}"), group)


def load_model_checkpoint(load_dir: str | Path, model) -> int:
    """The model's weights from the latest torch_dist checkpoint in ``load_dir`` (any TP size, any writer); returns
    its iteration."""
    from megatron.core import dist_checkpointing

    found = latest_checkpoint(load_dir)
    if found is None:
        raise CheckpointError(f"{load_dir}: no {TRACKER}, no checkpoint")
    iteration, folder = found
    loaded = dist_checkpointing.load({"model": unwrap(model).sharded_state_dict()}, str(folder))
    unwrap(model).load_state_dict(loaded["model"])
    return iteration
