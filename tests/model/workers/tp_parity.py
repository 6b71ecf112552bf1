"""torchrun worker (2 ranks): TP=2 vs TP=1 on the same weights — log-probs, entropy and every parameter gradient;
and log-probs of two responses packed after one shared prompt (masked attention) equal to their per-sample rows."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tests.training.helpers, from a torchrun worker


def run(arch, hf_dir, ids, weights, tp):
    from megatron.core import parallel_state

    from megamu.convert import gather_tensor, load_hf_into_model
    from megamu.model import allreduce_tp_partial_grads, build_model, forward_logprobs
    from megamu.runtime.parallel import init_distributed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_distributed(tp, seed=123)
    model = build_model(arch, params_dtype=torch.float64)  # TP only reorders sums: compared in fp64 (numerics.py)
    load_hf_into_model(model, arch, hf_dir)
    logp, ent = forward_logprobs(model, ids, temperature=0.7, with_entropy=True)
    loss = (weights[0] * logp).sum() + (weights[1] * ent).sum()
    loss.backward()
    allreduce_tp_partial_grads(model)  # q/k norm grads are per-rank partial sums under TP
    from megamu.model.spec import canonical_param_name

    grads = {}
    for n, p in model.named_parameters():
        n = canonical_param_name(n)
        grads[n] = gather_tensor(n, p.grad, arch).clone()
    return logp.detach(), ent.detach(), grads, shared_vs_per_sample(model, arch, ids)


def shared_vs_per_sample(model, arch, ids):
    """Log-probs of ids[0, 5:] and ids[1, 5:] after the prompt ids[0, :5]: one shared row vs one row each."""
    from megamu.rollout.records import RolloutSample
    from megamu.training import pack, response_logprobs

    prompt = ids[0, :5].tolist()
    samples = [RolloutSample(0, j, prompt, ids[j, 5:].tolist(), [0.0] * (ids.shape[1] - 5), 0.0, 0.0, "stop")
               for j in range(2)]
    with torch.no_grad():
        shared, _ = response_logprobs(model, pack(samples, share_prompts=True), temperature=0.7)
        per_sample, _ = response_logprobs(model, pack(samples), temperature=0.7)
    from tests.training.helpers import fp64_model_rtol

    # same sums in another order (masked attention over one packed row): the fp64 model's bound
    assert relative_gap(shared, per_sample) <= fp64_model_rtol(arch), (shared - per_sample).abs().max()
    return shared


def relative_gap(a, b):
    return ((a - b).abs() / a.abs().clamp_min(1)).max()


def main(hf_dirs):
    from megamu.model import ModelArch
    from tests.training.helpers import fp64_model_rtol

    torch.set_num_threads(1)
    for hf_dir in hf_dirs:
        arch = ModelArch.from_hf(hf_dir)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, arch.vocab_size, (2, 12), generator=gen)
        weights = torch.randn(2, 2, 11, generator=gen)
        lp2, ent2, g2, shared2 = run(arch, hf_dir, ids, weights, tp=2)
        lp1, ent1, g1, shared1 = run(arch, hf_dir, ids, weights, tp=1)
        rtol = fp64_model_rtol(arch)
        for what, a, b in (("logp", lp1, lp2), ("entropy", ent1, ent2), ("shared-prompt logp", shared1, shared2)):
            assert relative_gap(a, b) <= rtol, (arch.family, what, (a - b).abs().max())
        # the entropy really is the temperature-scaled one, and log-probs are normalised
        assert ent1.min() > 0 and lp1.max() < 0
        assert set(g1) == set(g2) and len(g1) > 0
        for name in g1:
            rel = (g1[name] - g2[name]).abs().max() / g1[name].abs().max().clamp_min(1e-12)
            assert rel <= rtol, f"{arch.family} {name}: relative gradient difference {rel:.2e}"
            assert g1[name].abs().max() > 0, f"{arch.family} {name}: zero gradient"
        print(f"OK {arch.family} tp1-vs-tp2 logp {(lp1 - lp2).abs().max():.1e} entropy {(ent1 - ent2).abs().max():.1e}")


if __name__ == "__main__":
    main(sys.argv[1:])
