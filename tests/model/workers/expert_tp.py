"""torchrun worker (4 ranks, gloo): a tiny Qwen3-MoE with its experts at their own TP, megatron-core's parallel
folding: attention at TP 2 + SP (dense TP x DP = 2 x 2), experts at ETP 1 x EP 2 (x expert-DP 2), against TP 1 (DP 4)
on the same weights, in fp64, through megamu's scoring path (``response_logprobs`` on packed rows): per-token
log-probs and entropies, and every parameter's gradient gathered to its full, global-expert tensor. The two
data-parallel replicas score different samples, so a replica's tokens reaching the other's experts would show.
Then a torch_dist checkpoint saved at the folded layout is loaded at TP 1 and at TP 2 = ETP 2 x EP 1: every tensor
equal to the HF weights, bit for bit.

Upstream runs unmodified except for the ``torch.cuda.current_device()`` that SP's gather and reduce-scatter allocate
on (tensor_parallel/mappings.py:141, :181), answered with "cpu" by tests/cpu_cuda_shim.py. Prints one "OK" line per
rank and check.

Usage: expert_tp.py HF_DIR CKPT_DIR
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from tests import cpu_cuda_shim  # noqa: E402

PROMPT, RESPONSES = 5, (16, 11)  # rows of 21 and 16 tokens: the longest odd, so SP pads to a multiple of TP


def samples(vocab: int, replica: int):
    from megamu.rollout.records import RolloutSample

    gen = torch.Generator().manual_seed(30 + replica)  # each data-parallel replica its own samples
    prompt = torch.randint(3, vocab, (PROMPT,), generator=gen).tolist()
    return [RolloutSample(0, j, prompt, torch.randint(3, vocab, (r,), generator=gen).tolist(), [0.0] * r, 0.0, 0.0,
                          "stop") for j, r in enumerate(RESPONSES)]


def layout(tp: int, ep: int, etp: int) -> None:
    from megatron.core import parallel_state

    from megamu.runtime.parallel import init_distributed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_distributed(tp, seed=123, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                     distributed_timeout_minutes=1.5)  # a rank left in a collective fails, not hangs


def model_at(arch, hf_dir: str, tp: int, ep: int, etp: int):
    from megamu.convert import load_hf_into_model
    from megamu.model import build_model

    layout(tp, ep, etp)
    model = build_model(arch, params_dtype=torch.float64, sequence_parallel=tp > 1)
    if hf_dir:
        load_hf_into_model(model, arch, hf_dir)
    return model


def scored(arch, model, replica: int):
    """Log-probs and entropies (one row per sample), and every gradient under its canonical, global-expert name."""
    from megamu.convert import gather_tensor
    from megamu.convert.tp import global_expert_name
    from megamu.model import allreduce_tp_partial_grads
    from megamu.model.spec import canonical_param_name
    from megamu.runtime import parallel
    from megamu.training import pack, response_logprobs

    batch = pack(samples(arch.vocab_size, replica), share_prompts=False)
    logp, ent = response_logprobs(model, batch, temperature=0.7, with_entropy=True)
    gen = torch.Generator().manual_seed(4 + replica)
    weights = torch.randn(2, *logp.shape, generator=gen, dtype=torch.float64)
    ((weights[0] * logp).sum() + (weights[1] * ent).sum()).backward()
    allreduce_tp_partial_grads(model)  # norms and the router under SP, q/k norms under TP: partial per rank
    grads = {}
    for n, p in model.named_parameters():
        name = canonical_param_name(n)
        full = gather_tensor(name, p.grad, arch).clone()  # over the expert-TP group for an expert
        grads[global_expert_name(name, arch, parallel.ep_rank(), parallel.ep_size())] = full
    return {"logp": logp.detach(), "entropy": ent.detach()}, grads


def main(hf_dir: str, ckpt_dir: str) -> None:
    from megatron.core import parallel_state as ps

    from megamu.convert.tp import full_state_dict
    from megamu.model import ModelArch
    from megamu.training.checkpoint import load_model_checkpoint, save_model_checkpoint
    from tests.model.workers.tp_parity import relative_gap
    from tests.training.helpers import fp64_model_rtol

    torch.set_num_threads(1)
    cpu_cuda_shim.install()
    arch = ModelArch.from_hf(hf_dir)

    folded = model_at(arch, hf_dir, tp=2, ep=2, etp=1)
    rank = torch.distributed.get_rank()
    # megatron-core's groups for this layout (parallel_state.py:786-805): dense TP {0,1} {2,3}; experts ETP 1, EP
    # pairs; each rank holds half the experts, whole
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()) == (2, 2)
    assert (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
            ps.get_expert_data_parallel_world_size()) == (1, 2, 2)
    fc1 = folded.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
    assert fc1.shape == (2 * arch.moe_ffn_hidden_size, arch.hidden_size), fc1.shape  # not split over TP 2
    assert len(folded.decoder.layers[0].mlp.experts.local_experts) == arch.num_experts // 2
    replica = ps.get_data_parallel_rank()
    out2, g2 = scored(arch, folded, replica)
    save_model_checkpoint(ckpt_dir, 0, folded)

    out1, g1 = scored(arch, model_at(arch, hf_dir, tp=1, ep=1, etp=1), replica)
    rtol = fp64_model_rtol(arch)  # the layouts differ only in reduction order (tests/model/workers/tp_parity.py)
    for what in out1:
        gap = relative_gap(out1[what], out2[what])
        assert gap <= rtol, f"{what}: relative gap {gap:.2e} > {rtol:.1e}"
    experts = {n for n in g1 if ".local_experts." in n}  # TP 1: all of them, under their global names
    assert len(experts) == arch.num_layers * arch.num_experts * 2
    assert set(g1) - experts == set(g2) - experts and len(experts & set(g2)) == len(experts) // 2  # this EP rank's
    routed = 0
    for name in g2:  # this rank's experts and every dense tensor
        if ".local_experts." in name and g1[name].abs().max() == 0:  # no token of this replica routed there
            assert g2[name].abs().max() == 0, f"{name}: gradient at the folded layout only"
            continue
        routed += ".local_experts." in name
        rel = (g1[name] - g2[name]).abs().max() / g1[name].abs().max().clamp_min(1e-12)
        assert rel <= rtol, f"{name}: relative gradient difference {rel:.2e} > {rtol:.1e}"
        assert g1[name].abs().max() > 0, f"{name}: zero gradient"
    assert routed >= len(experts) // 4, routed  # most of this rank's experts got tokens (4 experts, top 2)
    worst = max(relative_gap(out1[w], out2[w]).item() for w in out1)
    print(f"OK rank {rank} TP2+SP/ETP1xEP2 vs TP1: outputs {worst:.1e} bound {rtol:.1e}", flush=True)

    for tp, ep, etp in ((1, 1, 1), (2, 1, 2)):  # another dense TP, another expert layout
        want = dict(full_state_dict(model_at(arch, hf_dir, tp, ep, etp), arch))
        loaded = model_at(arch, "", tp, ep, etp)
        assert load_model_checkpoint(ckpt_dir, loaded) == 0
        got = dict(full_state_dict(loaded, arch))
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name], want[name]), f"TP {tp} ETP {etp} EP {ep}: {name}"
        print(f"OK rank {rank} torch_dist from TP2/ETP1xEP2 loaded at TP {tp} ETP {etp} x EP {ep}", flush=True)

    # micro-batch counts agree over the ETP x EP group, every MoE layer's collective: at ETP 1 x EP 4 beside TP 2 it
    # spans both data-parallel replicas (all 4 ranks), at ETP 1 x EP 2 it is the TP pair (ranks {0,1}, {2,3}); at
    # TP 1 with ETP 2 x EP 2 all 4 ranks too, though each EP group is a pair ({0,2}, {1,3}): the ETP pair's gather
    # is a collective as well
    from megamu.runtime.parallel import ep_agreed_count

    cpu = torch.device("cpu")
    for tp, ep, etp, want in ((2, 4, 1, 3), (2, 2, 1, rank | 1), (1, 2, 2, 3)):
        layout(tp, ep, etp)
        got = ep_agreed_count(rank, cpu)
        assert got == want, (ep, got, want)
    print(f"OK rank {rank} micro-batch counts agree over ETP x EP", flush=True)


if __name__ == "__main__":
    from tests.torchrun import rank_main

    rank_main(main, *sys.argv[1:])
