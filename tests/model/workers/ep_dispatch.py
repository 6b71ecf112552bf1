"""torchrun worker (2 ranks, gloo): a tiny Qwen3-MoE at EP 2 through megatron-core's own alltoall token dispatcher,
each rank with a different number of tokens; writes each rank's logits, router-split sizes and expert gradients
(under their global expert names) for tests/model/test_ep_dispatch.py.

Usage: ep_dispatch.py HF_DIR OUT_DIR
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from tests import cpu_cuda_shim  # noqa: E402

LENGTHS = (20, 5)  # tokens per rank: uneven shares, so the all-to-all's splits differ per rank


def rank_ids(rank: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, LENGTHS[rank]), generator=torch.Generator().manual_seed(10 + rank))


def rank_loss(logits: torch.Tensor, rank: int) -> torch.Tensor:
    """Different weights per rank, so each rank's tokens leave their own mark on every expert's gradient."""
    return logits.logsumexp(-1).mean() * (rank + 1)


def main(hf_dir: str, out_dir: str) -> None:
    import megamu.model.config as model_config
    from megamu.convert import load_hf_into_model
    from megamu.convert.tp import global_expert_name
    from megamu.model import ModelArch, build_model
    from megamu.model.spec import canonical_param_name
    from megamu.runtime import parallel

    torch.set_num_threads(1)
    cpu_cuda_shim.install()
    # megamu's CPU choice is the allgather dispatcher; the GPU's is alltoall: run that one, on the CPU experts/router
    model_config.moe_impl = lambda impl: model_config.MoeImpl(grouped_gemm=False, token_dispatcher="alltoall",
                                                              cpu_router=True)
    parallel.init_distributed(tensor_model_parallel_size=1, seed=0, expert_model_parallel_size=2,
                              distributed_timeout_minutes=1.5)  # a rank left waiting fails, not hangs
    rank = parallel.ep_rank()
    arch = ModelArch.from_hf(hf_dir)
    model = build_model(arch, params_dtype=torch.float64)
    load_hf_into_model(model, arch, hf_dir)
    dispatcher = model.decoder.layers[0].mlp.token_dispatcher
    ids = rank_ids(rank, arch.vocab_size)
    logits = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)[..., : arch.vocab_size]
    rank_loss(logits, rank).backward()
    grads = {global_expert_name(canonical_param_name(n), arch, rank, 2): p.grad.clone()
             for n, p in model.named_parameters() if ".local_experts." in n}
    torch.save({"dispatcher": type(dispatcher).__name__, "logits": logits.detach(), "grads": grads,
                "input_splits": [int(x) for x in dispatcher.input_splits],
                "output_splits": [int(x) for x in dispatcher.output_splits]}, Path(out_dir) / f"rank{rank}.pt")
    parallel.destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
