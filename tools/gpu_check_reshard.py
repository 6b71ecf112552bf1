"""torchrun --nproc_per_node 2 worker of tools/gpu_check.py's reshard row: load a torch_dist checkpoint (saved at
another layout, on CUDA or the CPU) at TP 2 on the CPU and write its full tensors (fp32) for the caller to compare.

Usage: gpu_check_reshard.py CKPT_DIR HF_DIR OUT (HF_DIR: the config the saving model was built from).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megamu.convert.tp import full_state_dict  # noqa: E402
from megamu.model import ModelArch, build_model  # noqa: E402
from megamu.runtime import parallel  # noqa: E402
from megamu.training import OptimizerConfig, build_optimizer, load_checkpoint  # noqa: E402


def main(ckpt: str, hf: str, out: str) -> None:
    parallel.init_distributed(tensor_model_parallel_size=2, seed=0)
    arch = ModelArch.from_hf(hf)
    model = build_model(arch)  # fp32 on the CPU: a bf16 checkpoint loads exactly (bf16 -> fp32 is exact)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-6))
    load_checkpoint(ckpt, model, arch, opt)
    full = {name: t.float().clone() for name, t in full_state_dict(model, arch)}  # a collective on every rank
    if parallel.is_main_rank():
        torch.save(full, out)
    parallel.destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:4])
