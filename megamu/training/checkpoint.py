"""Training checkpoints: model + optimiser + RNG + the caller's position, TP-reshardable, written atomically.

Layout (Megatron's names for the directory and the pointer file)::

    save_dir/latest_checkpointed_iteration.txt     "12"
    save_dir/iter_0000012/model/                   mcore folder (canonical full tensors, megamu_arch.json)
    save_dir/iter_0000012/optimizer/               "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.step", same layout
                                                   (+ "<param>.main_param": fp32 master weights of a bf16 model)
    save_dir/iter_0000012/state.json               iteration, optimiser scalars, parallel sizes, caller's ``extra``
    save_dir/iter_0000012/rng.json                 python / numpy / torch (/ CUDA) RNG states of every global rank

Every tensor is stored whole (gathered over TP), so a checkpoint loads at any TP size. All ranks take part in the
gathers; global rank 0 writes into a temp folder that is renamed into place, then the pointer is replaced atomically.
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megamu import parallel
from megamu.atomic import atomic_write_text
from megamu.convert.checkpoint import ARCH_FILE, load_mcore_into_model, read_arch, save_mcore
from megamu.convert.io import SafetensorsDir, atomic_dir, write_sharded
from megamu.convert.tp import gather_tensor, shard_tensor
from megamu.model import ModelArch, unwrap
from megamu.model.spec import canonical_param_name

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT = "megamu-checkpoint-1"
OPT_KEYS = ("exp_avg", "exp_avg_sq", "step")


class CheckpointError(RuntimeError):
    pass


def iteration_dir(save_dir: str | Path, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


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
                yield f"{name}.{key}", gather_tensor(name, state[key], arch).cpu()
        yield f"{name}.step", torch.as_tensor(state["step"], dtype=torch.float32).reshape(())


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if parallel.device().is_cuda:
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    as_tensor = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
    torch.set_rng_state(as_tensor(state["torch"]))
    if "cuda" in state and parallel.device().is_cuda:
        torch.cuda.set_rng_state(as_tensor(state["cuda"]))


def _drain(items: Iterator) -> None:
    for _ in items:  # non-writing ranks still take part in every gather
        pass


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def save_checkpoint(
    save_dir: str | Path, iteration: int, model, arch: ModelArch, optimizer, *, extra: dict,
    hf_source_dir: str | Path | None = None,
) -> Path:
    """Write ``save_dir/iter_{iteration:07d}`` and point the tracker at it; returns the folder (on every rank).

    ``extra`` (JSON-serialisable: stage, update offset, ...) comes back from ``load_checkpoint``. With
    ``hf_source_dir`` (the HF folder the run started from) the model folder is a complete mcore folder that
    ``megamu.convert`` can export to HF on its own.
    """
    json.dumps(extra)  # fail before any collective, not halfway through a write
    out = iteration_dir(save_dir, iteration)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rngs: list = [None] * world
    if world > 1:
        dist.all_gather_object(rngs, _rng_state())
    else:
        rngs = [_rng_state()]
    model_tensors = ((n, gather_tensor(n, p, arch).cpu()) for n, p in _named_params(model))
    opt_tensors = _full_optimizer_states(model, arch, optimizer)
    if parallel.is_main_rank():
        with atomic_dir(out) as tmp:
            if hf_source_dir is not None:
                save_mcore(model_tensors, tmp / "model", arch, hf_source_dir)
            else:
                (tmp / "model").mkdir()
                write_sharded(model_tensors, tmp / "model", metadata={"format": "megamu-mcore"})
                _write_json(tmp / "model" / ARCH_FILE, arch.to_dict())
            (tmp / "optimizer").mkdir()
            write_sharded(opt_tensors, tmp / "optimizer", metadata={"format": "megamu-optimizer"})
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
        atomic_write_text(Path(save_dir) / TRACKER, f"{iteration}\n")
    else:
        _drain(model_tensors)
        _drain(opt_tensors)
    parallel.barrier()
    return out


def latest_iteration(load_dir: str | Path) -> int | None:
    """The iteration the tracker names; None when ``load_dir`` holds no checkpoint at all."""
    tracker = Path(load_dir) / TRACKER
    if not tracker.exists():
        if any(Path(load_dir).glob("iter_*")):
            raise CheckpointError(f"{tracker} is missing but {load_dir} holds iter_* folders; point --load at one "
                                  f"of them by writing its number into {TRACKER}")
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def load_checkpoint(load_dir: str | Path, model, arch: ModelArch, optimizer) -> dict | None:
    """Restore model, optimiser and RNG from the latest checkpoint in ``load_dir`` (written at any TP size).

    Returns the ``extra`` dict given to ``save_checkpoint`` plus "iteration"; None when there is no checkpoint.
    """
    iteration = latest_iteration(load_dir)
    if iteration is None:
        return None
    folder = iteration_dir(load_dir, iteration)
    state_file = folder / "state.json"
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
    rank = dist.get_rank() if dist.is_initialized() else 0
    if len(rngs) == (dist.get_world_size() if dist.is_initialized() else 1):
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
