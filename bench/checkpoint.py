"""Training-checkpoint save and load time in megatron-core's torch_dist format (megamu.training.checkpoint).

  python -m bench.checkpoint [--hf-dir DIR] [--repeats 3]     (default model: SmolLM2-135M-Instruct)

One process, a world of one (TP=1): the model takes one update first, so the Adam moments are saved too; best of
--repeats. The writer fsyncs its tensor files, so the disk sets much of the pace. (Until the previous layout's reader
was retired, this compared the two formats side by side: docs/checkpoints.md keeps that measurement.)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from functools import partial
from pathlib import Path


def _dir_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file()) / 1e6


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(hf_dir: Path, repeats: int) -> dict:
    import torch

    from megamu.algo import ALGORITHM_PRESETS
    from megamu.convert import load_hf_into_model
    from megamu.model import ModelArch, build_model
    from megamu.runtime import parallel
    from megamu.training import OptimizerConfig, build_optimizer, train_step
    from megamu.training.checkpoint import load_checkpoint, save_checkpoint
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
    times: dict[str, list[float]] = {"save_s": [], "load_s": []}
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as work:
        folder = Path(work) / "torch_dist"
        for it in range(1, repeats + 1):
            times["save_s"].append(_timed(partial(save_checkpoint, folder, it, model, arch, opt, extra={}, keep=1)))
            times["load_s"].append(_timed(partial(load_checkpoint, folder, fresh, arch, fresh_opt)))
            size_mb = _dir_mb(folder / f"iter_{it:07d}")
    return {
        "model": str(hf_dir), "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "repeats": repeats, "best": {k: min(v) for k, v in times.items()}, "size_mb": size_mb,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.hf_dir is None:
        from megamu.model.demo_model import smollm2_hf_dir

        args.hf_dir = smollm2_hf_dir()
    print(json.dumps(run(args.hf_dir, args.repeats), indent=1))


if __name__ == "__main__":
    main()
