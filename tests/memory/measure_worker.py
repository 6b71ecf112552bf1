"""Run in a fresh process: one megamu ``train_step`` (forward + backward, no optimiser update) of a small fp32 model
on CPU, and print the process's peak-RSS increase over the step as JSON.

Usage: python -m tests.memory.measure_worker '{"hidden_size": ..., "num_layers": ..., "num_heads": ...,
"num_kv_heads": ..., "ffn_hidden_size": ..., "vocab_size": ..., "micro_batch": b, "prompt_len": P, "response_len": R}'
(a Qwen2-shaped model: q/k/v biases, untied embeddings; b samples of P + R tokens in one micro-batch)

How the peak is measured: the kernel's high-water mark of resident memory (VmHWM) is reset right before the step
(writing 5 to /proc/self/clear_refs, Linux >= 4.0) and read after it; the baseline is VmRSS at the reset. glibc's
malloc is told (by the parent, MALLOC_MMAP_THRESHOLD_) to serve every large block by mmap and give it back on free,
so resident memory follows the live tensors instead of keeping freed heap blocks.
"""

from __future__ import annotations

import json
import sys


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def main(spec: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    from megamu.algo import AlgoConfig, group_advantages
    from megamu.model import ModelArch, build_model
    from megamu.rollout.records import RolloutSample
    from megamu.runtime import parallel
    from megamu.training.optimizer import OptimizerConfig, TorchAdamW
    from megamu.training.step import train_step

    parallel.init_distributed(tensor_model_parallel_size=1, seed=0)
    arch = ModelArch(
        family="qwen2", vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
        num_layers=spec["num_layers"], num_heads=spec["num_heads"], num_kv_heads=spec["num_kv_heads"],
        head_dim=spec["hidden_size"] // spec["num_heads"], ffn_hidden_size=spec["ffn_hidden_size"],
        rope_theta=10000.0, rope_scaling=None, norm_eps=1e-6, qkv_bias=True, qk_norm=False,
        tie_embeddings=False, max_position_embeddings=spec["prompt_len"] + spec["response_len"],
    )
    model = build_model(arch)  # no recompute: megatron's checkpointing reads the CUDA RNG

    class NoUpdate(TorchAdamW):  # the step under test ends at the backward: no Adam moments, no update
        def step(self):
            return 0.0, 0.0

    opt = NoUpdate(model, OptimizerConfig(lr=1e-6))
    g = torch.Generator().manual_seed(0)
    b, p, r = spec["micro_batch"], spec["prompt_len"], spec["response_len"]
    rewards = torch.tensor([[float(i % 2) for i in range(b)]])
    adv = group_advantages(rewards)[0]
    samples = [
        RolloutSample(0, j, torch.randint(4, arch.vocab_size, (p,), generator=g).tolist(),
                      torch.randint(4, arch.vocab_size, (r,), generator=g).tolist(), [-1.0] * r,
                      float(rewards[0, j]), float(adv[j]), "length")
        for j in range(b)
    ]
    algo = AlgoConfig.preset("grpo")
    # a first step warms up whatever is allocated once (gloo buffers, lazy module state, .grad tensors' first use)
    train_step(model, opt, samples, algo, micro_batch_size=b)
    opt.zero_grad()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    train_step(model, opt, samples, algo, micro_batch_size=b)
    peak = _status_kib("VmHWM")
    n_params = sum(t.numel() for t in model.parameters())
    return {"peak_increase_bytes": (peak - base) * 1024, "base_rss_bytes": base * 1024, "n_params": n_params}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
