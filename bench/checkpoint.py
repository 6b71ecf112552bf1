"""Training-checkpoint save and load: megatron-core's torch_dist format (megamu.training.checkpoint) against megamu's
previous layout (full TP-gathered tensors in safetensors, megamu.training.checkpoint_legacy), side by side in one run.

  python -m bench.checkpoint [--hf-dir DIR] [--repeats 3]     (default model: SmolLM2-135M-Instruct)

One process, a world of one (TP=1): the model takes one update first, so the Adam moments are saved too. The two
formats alternate within each repeat (best of --repeats), so both see the same machine load. Ratios > 1 mean the
torch_dist format is faster. Both writers fsync their tensor files, so the disk sets much of the pace.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _dir_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file()) / 1e6


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def run(hf_dir: Path, repeats: int) -> dict:
    import torch

    from megamu import parallel
    from megamu.algo import ALGORITHM_PRESETS
    from megamu.convert import load_hf_into_model
    from megamu.model import ModelArch, build_model
    from megamu.training import OptimizerConfig, build_optimizer, train_step
    from megamu.training.checkpoint import load_checkpoint, save_checkpoint
    from megamu.training.checkpoint_legacy import load_legacy_checkpoint, save_legacy_checkpoint
    from tests.training.helpers import make_samples

    torch.set_num_threads(1)
    parallel.init_distributed(tensor_model_parallel_size=1)
    arch = ModelArch.from_hf(hf_dir)
    model = build_model(arch)
    load_hf_into_model(model, arch, hf_dir)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-5))
    train_step(model, opt, make_samples(1, 2, arch.vocab_size, seed=0), ALGORITHM_PRESETS["mu-grpo"],
               micro_batch_size=2)
    fresh = build_model(arch)
    fresh_opt = build_optimizer(fresh, OptimizerConfig(lr=1e-5))
    formats = {
        "torch_dist": (lambda d, it: save_checkpoint(d, it, model, arch, opt, extra={}, keep=1),
                       lambda d, it: load_checkpoint(d, fresh, arch, fresh_opt)),
        "legacy": (lambda d, it: save_legacy_checkpoint(d, it, model, arch, opt, extra={}, keep=1),
                   lambda d, it: load_legacy_checkpoint(d / f"iter_{it:07d}", fresh, arch, fresh_opt)),
    }
    times = {name: {"save_s": [], "load_s": []} for name in formats}
    sizes = {}
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as work:
        for it in range(1, repeats + 1):
            for name, (save, load) in formats.items():
                folder = Path(work) / name
                times[name]["save_s"].append(_timed(save, folder, it))
                times[name]["load_s"].append(_timed(load, folder, it))
                sizes[name] = _dir_mb(folder / f"iter_{it:07d}")
    best = {name: {k: min(v) for k, v in t.items()} for name, t in times.items()}
    return {
        "model": str(hf_dir), "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "repeats": repeats, "best": best, "size_mb": sizes,
        "speedup_save": best["legacy"]["save_s"] / best["torch_dist"]["save_s"],
        "speedup_load": best["legacy"]["load_s"] / best["torch_dist"]["load_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.hf_dir is None:
        from megamu.demo_model import smollm2_hf_dir

        args.hf_dir = smollm2_hf_dir()
    print(json.dumps(run(args.hf_dir, args.repeats), indent=1))


if __name__ == "__main__":
    main()
