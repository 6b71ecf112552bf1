"""Expert parallelism through megatron-core's own token dispatcher on CPU: a tiny Qwen3-MoE at EP 2 on gloo with
``moe_token_dispatcher_type="alltoall"`` (the GPU path's dispatcher, megamu.model.config.moe_impl), ranks holding
20 and 5 tokens, against the same weights at EP 1 in this process (megatron's allgather dispatcher on a world of one,
itself checked against transformers in test_moe.py).

What it guards: the old EP test ran a dense model, so no all-to-all ever ran on CPU and a dispatch that routed a
rank's tokens to the wrong rank's experts, combined them in the wrong order, or sent gradients back to the wrong rank
passed. Here each rank's logits and every expert's gradient (sum over both ranks' tokens, through the all-to-all's
backward) must equal the EP-1 model's. The run has a 90 s collective timeout and a 180 s wall limit: a rank left in an
all-to-all fails the test, never hangs it.

Upstream runs unmodified except for the ``torch.cuda`` calls tests/cpu_cuda_shim.py answers (token_dispatcher.py:445
creates a CUDA stream; mappings.py:442 allocates the uneven all-to-all's output on ``torch.cuda.current_device()``).
"""

from pathlib import Path

import torch

from megamu.convert import load_hf_into_model
from megamu.model import ModelArch, build_model
from megamu.model.spec import canonical_param_name
from tests.model.workers.ep_dispatch import rank_ids, rank_loss
from tests.numerics import reorder_rtol
from tests.tiny import save_tiny_model
from tests.torchrun import run_torchrun

WORKER = Path(__file__).parent / "workers" / "ep_dispatch.py"


def test_ep2_alltoall_dispatch_matches_ep1_with_uneven_tokens(distributed, tmp_path):
    hf = tmp_path / "moe"
    save_tiny_model(hf, "qwen3_moe", seed=6, vocab_size=300)
    run_torchrun(WORKER, 2, str(hf), str(tmp_path), timeout=180)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert {r["dispatcher"] for r in ranks} == {"MoEAlltoAllTokenDispatcher"}
    # layer 0's all-to-all splits: what each rank sent (to EP ranks 0, 1) sums to its tokens x top-k and differs
    arch = ModelArch.from_hf(hf)
    sent = [sum(r["input_splits"]) for r in ranks]
    assert sent == [20 * arch.moe_top_k, 5 * arch.moe_top_k]
    assert ranks[0]["input_splits"][1] == ranks[1]["output_splits"][0]  # what each rank got is what the other sent
    assert ranks[1]["input_splits"][0] == ranks[0]["output_splits"][1]

    model = build_model(arch, params_dtype=torch.float64)  # EP 1: every expert here, no all-to-all
    load_hf_into_model(model, arch, hf)
    for rank in range(2):
        ids = rank_ids(rank, arch.vocab_size)
        logits = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)[..., : arch.vocab_size]
        rank_loss(logits, rank).backward()  # gradients accumulate over both ranks' tokens, as EP 2's do
        got = ranks[rank]["logits"]
        # fp64; only the order of the experts' weighted sum and of the matmuls' reductions may differ
        rtol = reorder_rtol(torch.float64, arch.hidden_size, depth=2 * arch.num_layers + 1)
        err = ((got - logits.detach()).norm() / logits.norm()).item()
        assert err <= rtol, f"rank {rank}: relative logits difference {err:.2e} > {rtol:.1e}"
    want = {canonical_param_name(n): p.grad for n, p in model.named_parameters() if ".local_experts." in n}
    got = {**ranks[0]["grads"], **ranks[1]["grads"]}
    assert set(got) == set(want) and len(want) == arch.num_layers * arch.num_experts * 2
    rtol = reorder_rtol(torch.float64, 25 * arch.hidden_size, depth=2 * arch.num_layers + 1)
    for name, g in want.items():
        assert g.abs().sum() > 0, name
        err = ((got[name] - g).norm() / g.norm()).item()
        assert err <= rtol, f"{name}: relative gradient difference {err:.2e} > {rtol:.1e}"
