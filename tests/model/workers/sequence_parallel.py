"""torchrun worker (2 ranks, gloo): megatron-core's sequence parallelism at TP 2 against TP 1 on the same weights, in
fp64, through megamu's scoring path (``response_logprobs`` on packed rows): per-token log-probs and entropies, and
every parameter's gradient gathered to the full tensor; rows of odd length, so the padding to a multiple of TP runs.
Both layouts: one sample per row (causal) and two responses after one shared prompt (masked attention). An MoE model
runs megamu's CPU MoE layer (allgather dispatcher over TP, SequentialMLP experts split over TP, CpuTopKRouter).

Upstream runs unmodified except for the ``torch.cuda.current_device()`` that SP's gather and reduce-scatter allocate
on (tensor_parallel/mappings.py:141, :181; tensor_parallel/layers.py's backward), answered with "cpu" by
tests/cpu_cuda_shim.py. Prints one "OK" line per rank.

Usage: sequence_parallel.py HF_DIR [HF_DIR ...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from tests import cpu_cuda_shim  # noqa: E402

PROMPT, RESPONSES = 3, (6, 4)  # rows of 9 and 7 tokens (one per sample, padded to 9), 3 + 5 + 3 = 11 (shared)


def samples(vocab: int):
    from megamu.rollout.records import RolloutSample

    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, vocab, (PROMPT,), generator=gen).tolist()
    out = []
    for j, r in enumerate(RESPONSES):
        response = torch.randint(3, vocab, (r,), generator=gen).tolist()
        out.append(RolloutSample(0, j, prompt, response, [0.0] * r, 0.0, 0.0, "stop"))
    return out


def run(arch, hf_dir: str, tp: int, sequence_parallel: bool):
    """Log-probs and entropies of both layouts, and the gradients of a loss that weighs every one of them."""
    from megatron.core import parallel_state

    from megamu.convert import gather_tensor, load_hf_into_model
    from megamu.model import allreduce_tp_partial_grads, build_model
    from megamu.model.spec import canonical_param_name
    from megamu.runtime.parallel import init_distributed
    from megamu.training import pack, response_logprobs

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_distributed(tp, seed=123)
    model = build_model(arch, params_dtype=torch.float64, sequence_parallel=sequence_parallel)
    load_hf_into_model(model, arch, hf_dir)
    assert model.config.sequence_parallel is sequence_parallel
    seen = []  # tokens per rank at the final norm: the decoder really ran split along the sequence
    model.decoder.final_layernorm.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    outputs, loss = {}, 0.0
    gen = torch.Generator().manual_seed(4)
    for shared in (False, True):
        batch = pack(samples(arch.vocab_size), share_prompts=shared)
        assert batch.input_ids.shape[1] % 2 == 1, batch.input_ids.shape  # odd rows: the SP padding runs
        logp, ent = response_logprobs(model, batch, temperature=0.7, with_entropy=True)
        rows = batch.input_ids.shape[1]
        assert seen.pop() == ((rows + 1) // 2 if sequence_parallel else rows), (rows, sequence_parallel)
        weights = torch.randn(2, *logp.shape, generator=gen, dtype=torch.float64)
        loss = loss + (weights[0] * logp).sum() + (weights[1] * ent).sum()
        outputs[f"logp shared={shared}"], outputs[f"entropy shared={shared}"] = logp.detach(), ent.detach()
    loss.backward()
    allreduce_tp_partial_grads(model)  # q/k norms (TP) and, under SP, every norm: partial sums per rank
    grads = {canonical_param_name(n): gather_tensor(canonical_param_name(n), p.grad, arch).clone()
             for n, p in model.named_parameters()}
    marked = sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False))
    return outputs, grads, marked


def main(*hf_dirs: str) -> None:
    from megamu.model import ModelArch
    from tests.model.workers.tp_parity import relative_gap
    from tests.training.helpers import fp64_model_rtol

    torch.set_num_threads(1)
    cpu_cuda_shim.install()
    for hf_dir in hf_dirs:
        arch = ModelArch.from_hf(hf_dir)
        out2, g2, marked = run(arch, hf_dir, tp=2, sequence_parallel=True)
        out1, g1, unmarked = run(arch, hf_dir, tp=1, sequence_parallel=False)
        # every norm (2 per layer, q/k norms where the arch has them, the final one) carries the SP mark, and an MoE
        # layer's router (megatron's own mark, transformer/moe/router.py:74); nothing else
        per_layer = 2 + 2 * arch.qk_norm + bool(arch.num_experts)
        assert len(marked) == per_layer * arch.num_layers + 1, marked
        assert all("layernorm" in n or n.endswith("mlp.router.weight") for n in marked), marked
        assert unmarked == []
        # fp64 model; the same bound as TP 2 vs TP 1 without SP (tests/model/workers/tp_parity.py): the layouts
        # differ only in reduction order, the fp32 sums over the padded vocabulary dominating
        rtol = fp64_model_rtol(arch)
        for what in out1:
            gap = relative_gap(out1[what], out2[what])
            assert gap <= rtol, f"{arch.family} {what}: relative gap {gap:.2e} > {rtol:.1e}"
        assert set(g1) == set(g2) and len(g1) > 0
        for name in g1:
            rel = (g1[name] - g2[name]).abs().max() / g1[name].abs().max().clamp_min(1e-12)
            assert rel <= rtol, f"{arch.family} {name}: relative gradient difference {rel:.2e} > {rtol:.1e}"
            assert g1[name].abs().max() > 0, f"{arch.family} {name}: zero gradient"
        worst = max((out1[w] - out2[w]).abs().max().item() for w in out1)
        print(f"OK {arch.family} tp2+sp-vs-tp1 rank {torch.distributed.get_rank()} outputs {worst:.1e} "
              f"bound {rtol:.1e}", flush=True)


if __name__ == "__main__":
    from tests.torchrun import rank_main

    rank_main(main, *sys.argv[1:])
