"""Shared by the training tests and their torchrun workers: tiny models, synthetic rollout batches, references."""

from __future__ import annotations

from pathlib import Path

import torch

from megamu.algo import AlgoConfig, group_advantages, policy_loss
from megamu.rollout.records import RolloutSample


def tiny_model(hf_dir: str | Path, family: str = "llama", seed: int = 0, params_dtype=torch.float32, **overrides):
    """(model, arch) of a random tiny HF model written to ``hf_dir`` (reused when present) and loaded into megatron."""
    from megamu.convert.checkpoint import load_hf_into_model
    from megamu.model import ModelArch, build_model
    from tests.tiny import save_tiny_model

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").exists():
        save_tiny_model(hf_dir, family, seed, **overrides)
    arch = ModelArch.from_hf(hf_dir)
    model = build_model(arch, params_dtype=params_dtype)
    load_hf_into_model(model, arch, hf_dir)
    return model, arch


def make_samples(
    n_groups: int, group_size: int, vocab: int, seed: int = 0, prompt_len=(3, 8), response_len=(1, 12)
) -> list[RolloutSample]:
    """Random prompt groups with 0/1 rewards, Eq. 1 advantages, and placeholder behaviour log-probs (-1 each)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
    rewards = torch.randint(0, 2, (n_groups, group_size), generator=g).float()
    rewards[0] = torch.tensor([float(i % 2) for i in range(group_size)])  # at least one group with signal
    adv = group_advantages(rewards)
    out = []
    for i in range(n_groups):
        prompt = torch.randint(4, vocab, (rand(*prompt_len),), generator=g).tolist()
        for j in range(group_size):
            resp = torch.randint(4, vocab, (rand(*response_len),), generator=g).tolist()
            out.append(RolloutSample(i, j, prompt, resp, [-1.0] * len(resp), float(rewards[i, j]), float(adv[i, j]),
                                     "stop"))
    return out


def set_behaviour(samples: list[RolloutSample], logprobs: list[list[float]], noise: float, seed: int = 0) -> None:
    """behaviour = the given log-probs + N(0, noise²) per token, so ratios spread around 1."""
    g = torch.Generator().manual_seed(seed)
    for s, lp in zip(samples, logprobs):
        s.behaviour_logprobs = (torch.tensor(lp) + noise * torch.randn(len(lp), generator=g)).tolist()


def reference_loss(model, samples: list[RolloutSample], algo: AlgoConfig, temperature: float = 1.0):
    """policy_loss over the whole minibatch in one call: the objective train_step must reproduce (with the KL term's
    reference log-probs when the samples carry them, and the policy's entropy for the entropy term)."""
    from megamu.model import forward_logprobs

    # Built independently of megamu.training.batch: one row per sample in forward_logprobs' [b, s-1] frame.
    s_max = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.zeros(len(samples), s_max, dtype=torch.long)
    mask = torch.zeros(len(samples), s_max - 1, dtype=torch.bool)
    beh = torch.zeros(len(samples), s_max - 1)
    ref = torch.zeros(len(samples), s_max - 1) if samples[0].ref_logprobs is not None else None
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        mask[i, p - 1 : p - 1 + r] = True
        beh[i, p - 1 : p - 1 + r] = torch.tensor(s.behaviour_logprobs)
        if ref is not None:
            ref[i, p - 1 : p - 1 + r] = torch.tensor(s.ref_logprobs)
    logp, entropy = forward_logprobs(model, ids, temperature=temperature, with_entropy=bool(algo.entropy_coef))
    adv = torch.tensor([s.advantage for s in samples])
    return policy_loss(logp, beh, adv, mask, algo, ref_logp=ref, entropy=entropy)


def fp64_model_rtol(arch) -> float:
    """Bound on the relative difference between two fp64-model computations that differ only in reduction order
    (another micro-batch split, another DP layout). Everything runs in fp64 except megatron's vocab-parallel cross
    entropy, which casts logits to fp32: each log-prob (forward) and its logit gradient (backward) come from fp32 sums
    over the padded vocabulary (tests/numerics.py). A wrong loss scale or a missing reduction is ~1e-2 or more."""
    from megamu.model import padded_vocab_size
    from tests.numerics import reorder_rtol

    return reorder_rtol(torch.float32, padded_vocab_size(arch.vocab_size, 1), depth=2)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-30)) for k in a)


def rel_diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-30)) for k in a}


def capture_optimizer(model):
    """A TorchAdamW whose step() only all-reduces and records the gradients (no update)."""
    from megamu.training.optimizer import OptimizerConfig, TorchAdamW

    class GradCapture(TorchAdamW):
        def step(self):
            self._all_reduce_grads()
            self.grads = {n: p.grad.detach().clone() for n, p in self.named_params}
            return 0.0, 0.0

    return GradCapture(model, OptimizerConfig(lr=1.0))


def add_triggers(samples: list[RolloutSample], logprobs: list[list[float]], n_veto: int, n_clip: int) -> None:
    """Make the first ``n_veto`` A<0 samples contain a token with ρ = e^-10 < 1e-4 (veto trigger) and the first
    ``n_clip`` A>0 samples a token with ρ = e^2 > 5 (above μ-GRPO's clip)."""
    neg = [i for i, s in enumerate(samples) if s.advantage < 0][:n_veto]
    pos = [i for i, s in enumerate(samples) if s.advantage > 0][:n_clip]
    assert len(neg) == n_veto and len(pos) == n_clip
    for i in neg:
        samples[i].behaviour_logprobs[0] = logprobs[i][0] + 10.0
    for i in pos:
        samples[i].behaviour_logprobs[-1] = logprobs[i][-1] - 2.0
