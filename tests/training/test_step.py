"""train_step against policy_loss over the whole minibatch in one call (world of one; DP/TP in test_parallel.py)."""

import math

import pytest
import torch

from megamu.algo import AGGREGATIONS, ALGORITHM_PRESETS, AlgoConfig
from megamu.model import forward_logprobs
from megamu.training import OptimizerConfig, build_optimizer, compute_logprobs, train_step
from tests.training.helpers import (
    add_triggers,
    capture_optimizer,
    fp64_model_rtol,
    grads,
    make_samples,
    max_rel_diff,
    reference_loss,
    set_behaviour,
    tiny_model,
)


@pytest.fixture(scope="module")
def tiny(distributed, tmp_path_factory):
    hf = tmp_path_factory.mktemp("tiny") / "hf"
    model, arch = tiny_model(hf)
    return model, arch, hf


@pytest.fixture(scope="module")
def tiny64(distributed, tmp_path_factory):
    """The same tiny model in fp64: gradient-invariance tests compare loss scaling, not fp32 rounding (numerics.py)."""
    hf = tmp_path_factory.mktemp("tiny64") / "hf"
    model, arch = tiny_model(hf, params_dtype=torch.float64)
    return model, arch, hf


def _batch(model, arch):
    samples = make_samples(4, 4, arch.vocab_size, seed=1)
    lp = compute_logprobs(model, samples, micro_batch_size=5)
    set_behaviour(samples, lp, noise=0.4)
    add_triggers(samples, lp, n_veto=2, n_clip=2)
    return samples, lp


@pytest.fixture
def batch(tiny):
    return _batch(*tiny[:2])


@pytest.fixture
def batch64(tiny64):
    return _batch(*tiny64[:2])


def test_compute_logprobs_matches_forward_logprobs(tiny):
    model, arch, _ = tiny
    samples = make_samples(2, 3, arch.vocab_size, seed=5)
    got = compute_logprobs(model, samples, micro_batch_size=2, temperature=0.7)
    for s, values in zip(samples, got):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp, _ = forward_logprobs(model, ids, temperature=0.7)
        p = len(s.prompt_ids)
        assert len(values) == len(s.response_ids)
        torch.testing.assert_close(torch.tensor(values), logp[0, p - 1 :], rtol=0, atol=1e-5)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_reproduce_minibatch_gradient(tiny64, batch64, aggregation):
    model, arch, _ = tiny64
    samples, _ = batch64
    rtol = fp64_model_rtol(arch)
    algo = AlgoConfig("test", clip_low=0.2, clip_high=0.2, veto_threshold=1e-4, aggregation=aggregation)
    model.zero_grad(set_to_none=True)
    ref_loss, ref_stats = reference_loss(model, samples, algo)
    ref_loss.backward()
    ref = grads(model)
    assert ref_stats["clip_fraction"] > 0 and ref_stats["veto_sequence_fraction"] > 0

    # one micro-batch, four, and a token budget that gives micro-batches of uneven sizes
    for kwargs, n_micro in ((dict(micro_batch_size=16), 1), (dict(micro_batch_size=4), 4),
                            (dict(micro_batch_size=16, max_tokens_per_micro_batch=40), None)):
        opt = capture_optimizer(model)
        m = train_step(model, opt, samples, algo, **kwargs)
        assert m["n_micro_batches"] == n_micro if n_micro else m["n_micro_batches"] > 4
        assert max_rel_diff(opt.grads, ref) <= rtol, (aggregation, n_micro)
        assert m["loss"] == pytest.approx(ref_loss.item(), rel=rtol, abs=rtol)
        for k in ("clip_fraction", "veto_token_fraction", "veto_sequence_fraction", "ratio_mean",
                  "ratio_neg_adv_mean", "log_ratio_min", "approx_kl"):
            assert m[k] == pytest.approx(ref_stats[k], rel=rtol, abs=rtol), (k, n_micro)


def test_mu_grpo_updates_lower_loss_and_report_veto_and_clip(tiny, batch):
    model, arch, hf = tiny
    samples, lp = batch
    algo = ALGORITHM_PRESETS["mu-grpo"]
    # direct computation of the first update's statistics (θ = the rollout policy + the planted triggers)
    n_tok = sum(len(s.response_ids) for s in samples)
    vetoed = [s for s, cur in zip(samples, lp) if s.advantage < 0
              and any(a - b < math.log(1e-4) for a, b in zip(cur, s.behaviour_logprobs))]
    clipped = sum((a - b > math.log(5.0)) * (s.advantage > 0) for s, cur in zip(samples, lp)
                  for a, b in zip(cur, s.behaviour_logprobs))
    assert len(vetoed) == 2 and clipped >= 2

    from megamu.convert.checkpoint import load_hf_into_model

    load_hf_into_model(model, arch, hf)  # other tests may have moved the shared model
    opt = build_optimizer(model, OptimizerConfig(lr=3e-3, clip_grad=1.0))
    with torch.no_grad():
        start = float(reference_loss(model, samples, algo)[0])
    first = train_step(model, opt, samples, algo, micro_batch_size=6)
    assert first["veto_sequence_fraction"] == pytest.approx(len(vetoed) / len(samples))
    assert first["veto_token_fraction"] == pytest.approx(sum(len(s.response_ids) for s in vetoed) / n_tok)
    assert first["clip_fraction"] == pytest.approx(clipped / n_tok)
    assert first["loss"] == pytest.approx(start, rel=1e-5)
    assert first["lr"] == 3e-3 and first["grad_norm"] > 0 and first["n_tokens"] == n_tok
    for _ in range(4):
        train_step(model, opt, samples, algo, micro_batch_size=6)
    with torch.no_grad():
        end = float(reference_loss(model, samples, algo)[0])
    assert end < start - 0.5, (start, end)
    load_hf_into_model(model, arch, hf)


def test_response_logprobs_and_chunked_entropy_match_softmax(tiny, monkeypatch):
    import megamu.training.step as step_module
    from megamu.training import pack, response_logprobs

    model, arch, _ = tiny
    samples = make_samples(2, 2, arch.vocab_size, seed=9, response_len=(5, 9))
    batch = pack(samples)
    monkeypatch.setattr(step_module, "ENTROPY_CHUNK_ELEMENTS", 3 * 128)  # 3 positions per chunk (padded vocab 128)
    with torch.no_grad():
        logp, entropy = response_logprobs(model, batch, temperature=0.8, with_entropy=True)
        ids = batch.input_ids
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        z = model(ids, pos, None)[:, batch.first_column : -1, : arch.vocab_size].double() / 0.8
    ref_logp = torch.log_softmax(z, -1).gather(-1, ids[:, batch.first_column + 1 :, None])[..., 0]
    ref_entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    mask = batch.response_mask
    torch.testing.assert_close(logp[mask].double(), ref_logp[mask], rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy[mask].double(), ref_entropy[mask], rtol=0, atol=2e-5)


def test_skipping_zero_advantage_samples_leaves_the_gradient_unchanged(tiny64, batch64):
    model, arch, _ = tiny64
    samples, _ = batch64
    for s in samples[4:8]:  # a whole group with equal rewards: A = 0 for each of its samples
        s.advantage = 0.0
    algo = ALGORITHM_PRESETS["mu-grpo"]
    full = capture_optimizer(model)
    m_full = train_step(model, full, samples, algo, micro_batch_size=4)
    skip = capture_optimizer(model)
    m_skip = train_step(model, skip, samples, algo, micro_batch_size=4, skip_zero_advantage=True)
    rtol = fp64_model_rtol(arch)
    assert max_rel_diff(skip.grads, full.grads) <= rtol
    assert m_skip["loss"] == pytest.approx(m_full["loss"], rel=rtol, abs=rtol)
    assert m_skip["trained_sample_fraction"] == pytest.approx(12 / 16)
    assert m_skip["n_micro_batches"] < m_full["n_micro_batches"]
