"""HF folder <-> torch_dist checkpoint (Megatron-LM's format, the trainer's own): the model is built, filled through
mbridge (megamu.convert.bridge) and saved or loaded by the trainer's checkpoint code (megamu.training.checkpoint).
Here rather than in megamu.convert, which then needs nothing of the trainer; tools/convert_checkpoint.py calls these."""

from __future__ import annotations

from pathlib import Path

from megamu.model import ModelArch


def hf_to_torch_dist(hf_dir: str | Path, save_dir: str | Path, iteration: int = 0) -> Path:
    """HF folder -> torch_dist checkpoint ``save_dir/iter_N`` (+ tracker) that Megatron-LM and megamu load at any TP
    size, through mbridge. Builds the model at the current TP size (call megamu.runtime.parallel.init_distributed
    first)."""
    from megamu.convert.bridge import load_hf_via_mbridge
    from megamu.model import build_model
    from megamu.training.checkpoint import save_model_checkpoint

    arch = ModelArch.from_hf(hf_dir)
    model = build_model(arch)
    load_hf_via_mbridge(model, arch, hf_dir)
    return save_model_checkpoint(save_dir, iteration, model)


def torch_dist_to_hf(load_dir: str | Path, hf_source_dir: str | Path, out_dir: str | Path, dtype: str = "bf16",
                     max_shard_bytes: int | None = None) -> Path:
    """The latest torch_dist checkpoint in ``load_dir`` (megamu's, Megatron-LM's) -> HF folder, through mbridge.
    ``hf_source_dir`` gives the config and tokenizer (the model the checkpoint was trained from)."""
    from megamu.convert.bridge import hf_tensors_via_mbridge
    from megamu.convert.checkpoint import _write_hf
    from megamu.convert.io import DEFAULT_SHARD_BYTES
    from megamu.model import build_model
    from megamu.runtime import parallel
    from megamu.runtime.atomic import atomic_dir
    from megamu.training.checkpoint import load_model_checkpoint

    arch = ModelArch.from_hf(Path(hf_source_dir))
    # initialised, although every weight is loaded: megatron-core 0.16.1 with perform_initialization=False on CPU
    # leaves the vocab-parallel weights without their ``tensor_model_parallel`` attribute, by which mbridge decides
    # what to gather over TP (it then exports one shard of the embedding)
    model = build_model(arch)
    load_model_checkpoint(load_dir, model)
    tensors = hf_tensors_via_mbridge(model, arch, Path(hf_source_dir))
    if parallel.is_main_rank():
        with atomic_dir(out_dir) as tmp:
            _write_hf(tensors, tmp, Path(hf_source_dir), dtype, max_shard_bytes or DEFAULT_SHARD_BYTES)
    for _ in tensors:  # other ranks take part in every gather
        pass
    parallel.wait_for_main_rank()  # rank 0's last writes may outlast the collective timeout
    return Path(out_dir)
