"""megamu's previous checkpoint layout (full TP-gathered tensors in safetensors, megamu's own index), read so old runs
resume once, and written only by bench/checkpoint.py to compare with the torch_dist format (megamu.training.checkpoint).

Layout::

    iter_0000012/model/          mcore folder (canonical full tensors, megamu_arch.json)
    iter_0000012/optimizer/      "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.step" (+ "<param>.main_param")
    iter_0000012/state.json      iteration, optimiser scalars, parallel sizes, caller's ``extra``
    iter_0000012/rng.json        python / numpy / torch (/ CUDA) RNG states of every global rank

Every tensor is stored whole (gathered over TP), so it loads at any TP size. All ranks take part in the gathers and
each writes the tensors ``writer_of`` assigns it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from megamu import parallel
from megamu.convert.checkpoint import ARCH_FILE, load_mcore_into_model, read_arch, write_mcore_meta
from megamu.convert.io import SafetensorsDir, make_temp_dir, write_index, write_shards
from megamu.convert.tp import gather_tensor, shard_tensor
from megamu.errors import ConfigError
from megamu.model import ModelArch, unwrap
from megamu.model.spec import canonical_param_name
from megamu.training.checkpoint_dirs import (
    CheckpointError,
    _raise_any,
    _rng_state,
    _set_rng_state,
    _world,
    iteration_dir,
    publish,
)

LEGACY_STATE = "state.json"
FORMAT = "megamu-checkpoint-1"
OPT_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _named_params(model) -> Iterator[tuple[str, torch.nn.Parameter]]:
    for name, p in unwrap(model).named_parameters():
        yield canonical_param_name(name), p


def _full_optimizer_states(model, arch: ModelArch, optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    for name, p in _named_params(model):
        state = optimizer.param_state(p)  # same presence on every rank: all params step together
        if state is None:
            continue
        for key in ("exp_avg", "exp_avg_sq", "main_param"):  # main_param: fp32 master weights of a bf16 model
            if key in state:
                yield f"{name}.{key}", gather_tensor(name, state[key], arch)
        yield f"{name}.step", torch.as_tensor(state["step"], dtype=torch.float32).reshape(())


def writer_of(sizes: list[tuple[str, int]], world: int) -> dict[str, int]:
    """Which global rank writes each parameter (its weight and its optimiser state): the next largest tensor goes to
    the rank with the fewest elements so far. Every rank computes the same map from the same (name, size) list."""
    load = [0] * world
    owner = {}
    for name, size in sorted(sizes, key=lambda x: -x[1]):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += size
    return owner


def _owned(items: Iterator[tuple[str, torch.Tensor]], owner: dict[str, int], rank: int):
    """The items this rank writes; iterating it still runs every gather, so the other ranks' collectives complete."""
    return ((n, t) for n, t in items if owner[n.rsplit(".", 1)[0] if n not in owner else n] == rank)


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def save_legacy_checkpoint(
    save_dir: str | Path, iteration: int, model, arch: ModelArch, optimizer, *, extra: dict,
    hf_source_dir: str | Path | None = None, keep: int = 2,
) -> Path:
    """Write ``save_dir/iter_{iteration:07d}`` and point the tracker at it; returns the folder (on every rank).

    ``extra`` (JSON-serialisable: stage, update offset, ...) comes back from ``load_checkpoint``. With
    ``hf_source_dir`` (the HF folder the run started from) the model folder is a complete mcore folder that
    ``megamu.convert`` can export to HF on its own. ``keep``: how many checkpoints to leave (newest first, the
    new one always among them; 0 keeps all), see ``prune_checkpoints``.

    Every rank writes the full (TP-gathered) tensors of the parameters ``writer_of`` gives it, as its own shard
    files in one temp folder beside the target (``save_dir`` must be on a filesystem every rank sees, as for
    Megatron); rank 0 then writes the index and metadata, renames the folder into place and moves the tracker.
    """
    json.dumps(extra)  # fail before any collective, not halfway through a write
    if keep < 0:
        raise ConfigError("keep_checkpoints", f"must be >= 0 (0 keeps all), got {keep}")
    out = iteration_dir(save_dir, iteration)
    rank, world = _world()
    main = parallel.is_main_rank()
    rngs = parallel.all_gather_object(_rng_state())
    tmp = Path(parallel.all_gather_object(str(make_temp_dir(out)) if main else None)[0])
    owner = writer_of([(n, p.numel()) for n, p in _named_params(model)], world)
    error, parts = None, {}
    for part, items in (("model", ((n, gather_tensor(n, p, arch)) for n, p in _named_params(model))),
                        ("optimizer", _full_optimizer_states(model, arch, optimizer))):
        if error is None:
            try:
                (tmp / part).mkdir(exist_ok=True)
                parts[part] = write_shards(_owned(items, owner, rank), tmp / part, prefix=f"{part}-rank{rank:05d}")
            except OSError as e:  # disk full on one rank: it still takes part in the remaining gathers below
                error = f"{type(e).__name__}: {e}"
        for _ in items:
            pass
    written = parallel.all_gather_object((error, parts))

    def finish() -> None:
        _raise_any([e for e, _ in written], f"writing checkpoint {out}")
        for part, fmt in (("model", "megamu-mcore"), ("optimizer", "megamu-optimizer")):
            weight_map = {k: v for _, p in written for k, v in p[part][0].items()}
            write_index(tmp / part, weight_map, sum(p[part][1] for _, p in written), {"format": fmt})
        write_mcore_meta(tmp / "model", arch, hf_source_dir)
        _write_json(tmp / "rng.json", rngs)
        _write_json(tmp / "state.json", {
            "format": FORMAT,
            "iteration": iteration,
            "optimizer": optimizer.state_dict(),
            "tensor_model_parallel_size": parallel.tp_size(),
            "data_parallel_size": parallel.dp_size(),
            "world_size": world,
            "extra": extra,
        })

    return publish(main, tmp, out, save_dir, iteration, keep, finish)


def load_legacy_checkpoint(folder: Path, model, arch: ModelArch, optimizer) -> dict:
    """Restore model, optimiser and RNG from an old-layout ``iter_N`` folder (written at any TP size); returns the
    ``extra`` dict it was saved with plus "iteration"."""
    state_file = folder / LEGACY_STATE
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{state_file}: cannot read checkpoint state ({e})") from e
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{state_file}: format {state.get('format')!r}, expected {FORMAT!r}")
    saved_arch = read_arch(folder / "model")
    if saved_arch != arch:
        raise CheckpointError(f"{folder / 'model' / ARCH_FILE}: the checkpoint's architecture {saved_arch} differs "
                              f"from the model's {arch}")
    for part, load in (("model", load_mcore_into_model), ("optimizer", _load_optimizer)):
        try:
            load(model, arch, folder / part, *([optimizer] if part == "optimizer" else []))
        except Exception as e:  # safetensors raises its own error type on truncated files
            raise CheckpointError(f"{folder / part}: corrupt or incomplete checkpoint ({type(e).__name__}: {e})") from e
    optimizer.load_state_dict(state["optimizer"])
    rng_file = folder / "rng.json"
    rngs = json.loads(rng_file.read_text())
    rank, world = _world()
    if len(rngs) == world:
        _set_rng_state(rngs[rank])  # a different world size cannot resume the same random streams
    parallel.barrier()
    return {**state["extra"], "iteration": state["iteration"]}


def _load_optimizer(model, arch: ModelArch, folder: Path, optimizer) -> None:
    reader = SafetensorsDir(folder)
    names = set(reader.keys())
    rank, size = parallel.tp_rank(), parallel.tp_size()
    for name, p in _named_params(model):
        keys = [f"{name}.{k}" for k in OPT_KEYS]
        present = [k in names for k in keys]
        if not any(present):
            continue  # saved before the first update
        if not all(present):
            have = [k for k in keys if k in names]
            raise KeyError(f"optimizer state of {name} is incomplete in {folder}: has only {have}")
        sharded = [k for k in ("exp_avg", "exp_avg_sq", "main_param") if f"{name}.{k}" in names]
        optimizer.load_param_state(p, {
            **{k: shard_tensor(name, reader.get(f"{name}.{k}"), arch, rank, size) for k in sharded},
            "step": reader.get(f"{name}.step"),
        })
