"""torchrun worker (2 ranks, TP=1, EP=2): a Qwen3-MoE's experts split over two expert-parallel ranks. megamu's
mapping loads each rank's experts from the HF folder by their global index, export_hf gathers them back over EP, and
a torch_dist checkpoint written here (each rank its own experts) is left for the test to load at EP=1. No forward:
megatron-core 0.16.1 refuses the MoE forward at EP > 1 on CPU (tensor_parallel/mappings.py:141).
Args: hf_dir, export_dir, torch_dist_dir."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # this checkout's megamu and tests, not an installed one


def main(hf_dir, export_dir, dist_dir):
    from megamu.convert import export_hf, load_hf_into_model
    from megamu.convert.io import SafetensorsDir
    from megamu.model import ModelArch, build_model
    from megamu.runtime import parallel
    from megamu.training.checkpoint import save_model_checkpoint

    torch.set_num_threads(1)
    parallel.init_distributed(1, expert_model_parallel_size=2)
    assert (parallel.ep_size(), parallel.dp_size()) == (2, 2)
    arch = ModelArch.from_hf(hf_dir)
    model = build_model(arch)
    load_hf_into_model(model, arch, hf_dir)
    hf = SafetensorsDir(hf_dir)
    rank, local = parallel.ep_rank(), arch.num_experts // 2
    checked = 0
    for name, p in model.named_parameters():
        if ".local_experts." not in name:
            continue
        layer, j = int(name.split(".")[2]), int(name.split(".local_experts.")[1].split(".")[0])
        src = f"model.layers.{layer}.mlp.experts.{rank * local + j}."
        want = (torch.cat([hf.get(src + "gate_proj.weight"), hf.get(src + "up_proj.weight")])
                if name.endswith("linear_fc1.weight") else hf.get(src + "down_proj.weight"))
        assert torch.equal(p, want), name
        checked += 1
    assert checked == arch.num_layers * local * 2
    export_hf(model, arch, export_dir, hf_source_dir=hf_dir, dtype="fp32")
    save_model_checkpoint(dist_dir, 0, model)
    print(f"OK EP=2 rank {rank}: experts {rank * local}..{rank * local + local - 1}", flush=True)


if __name__ == "__main__":
    from tests.torchrun import rank_main

    rank_main(main, *sys.argv[1:])
