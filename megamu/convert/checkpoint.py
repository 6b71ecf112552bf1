"""HF folders in and out of a live model: loading the initial policy, and the in-process HF export (every run's
engine weights). Offline conversion is torch_dist only (megamu.convert.bridge, tools/convert_checkpoint.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from megamu.convert.io import DEFAULT_SHARD_BYTES, SafetensorsDir, copy_meta_files, write_sharded
from megamu.convert.mapping import check_hf_names, fuse, mcore_to_hf_tensors, plan
from megamu.convert.tp import full_state_dict, load_full_state_dict
from megamu.model.config import ModelArch
from megamu.runtime.atomic import atomic_dir

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_CONFIG_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def load_hf_into_model(model, arch: ModelArch, hf_dir: str | Path) -> None:
    """Initial policy straight from an HF folder, one tensor at a time."""
    reader = SafetensorsDir(hf_dir)
    check_hf_names(arch, reader.keys())
    entries = {e.mcore: e for e in plan(arch)}

    def get(name: str) -> torch.Tensor:
        e = entries[name]
        return fuse(e, [reader.get(n) for n in e.hf], arch)

    load_full_state_dict(model, arch, get, names=entries)


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")


def _write_hf(
    hf_tensors: Iterable[tuple[str, torch.Tensor]], folder: Path, meta_dir: Path, dtype: str, max_shard_bytes: int
) -> None:
    _check_dtype(dtype)
    cast = ((n, t.to(DTYPES[dtype])) for n, t in hf_tensors)
    write_sharded(cast, folder, max_shard_bytes)
    copy_meta_files(meta_dir, folder, skip=("config.json",))
    config = json.loads((meta_dir / "config.json").read_text())
    # transformers 5 and SGLang read "dtype" first (SGLang 0.5.23 maps a float32 config under --dtype auto to
    # float16), older readers "torch_dtype": both say what the tensors are
    config["dtype"] = _CONFIG_DTYPE[dtype]
    if "torch_dtype" in config:
        config["torch_dtype"] = _CONFIG_DTYPE[dtype]
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def training_dtype(model) -> str:
    """The precision the model trains in ("bf16", "fp16" or "fp32"): its parameters' dtype."""
    from megamu.model.build import unwrap

    dtype = next(unwrap(model).parameters()).dtype
    names = {v: k for k, v in DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"model parameters are {dtype}; an HF export supports {sorted(DTYPES)}")
    return names[dtype]


def export_hf(
    model, arch: ModelArch, out_dir: str | Path, *, hf_source_dir: str | Path, dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Export a live (TP-sharded) model as an HF folder: the first data-parallel replica gathers tensor by tensor,
    global rank 0 writes into a temp folder that replaces ``out_dir`` only once complete; all ranks then meet at a
    barrier on the CPU-side group, which the collective timeout does not bound. A write error (disk full) is raised
    on rank 0 after the other ranks are released, not as a hang.

    ``dtype`` (``--export-dtype``) defaults to the training precision (``training_dtype``): a bf16 run's rollouts
    are served in bf16, and its exports are half the size of fp32 ones."""
    from megamu.runtime.parallel import gathers_full_weights, is_main_rank, wait_for_main_rank

    dtype = training_dtype(model) if dtype is None else dtype
    _check_dtype(dtype)  # on every rank, before any collective
    error = None
    if gathers_full_weights():  # other replicas hold the same weights
        hf = mcore_to_hf_tensors(arch, full_state_dict(model, arch))
        if is_main_rank():
            try:
                with atomic_dir(out_dir) as tmp:
                    _write_hf(hf, tmp, Path(hf_source_dir), dtype, max_shard_bytes)
            except OSError as e:
                error = e
        for _ in hf:  # take part in every remaining gather
            pass
    wait_for_main_rank()  # rank 0's last shard and rename may outlast the collective timeout (a big model, slow disk)
    if error is not None:
        raise error
    return Path(out_dir)
