"""train_step against policy_loss over the whole minibatch in one call (world of one; DP/TP in test_parallel.py)."""

import math

import numpy as np
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
    rel_diffs,
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
    algo = AlgoConfig.preset("grpo", veto_threshold=1e-4, aggregation=aggregation)
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
    # the lower tail of log ρ on A < 0 tokens (megamu.algo.tail), from the same per-token values in numpy
    neg = [(s, cur) for s, cur in zip(samples, lp) if s.advantage < 0]
    neg_log_ratios = [a - b for s, cur in neg for a, b in zip(cur, s.behaviour_logprobs)]
    assert first["neg_adv_log_ratio_p10"] == pytest.approx(float(np.quantile(neg_log_ratios, 0.1)), abs=1e-5)
    assert first["neg_adv_reply_below_tau"] == pytest.approx(len(vetoed) / len(neg))
    assert first["loss"] == pytest.approx(start, rel=1e-5)
    assert first["lr"] == 3e-3 and first["grad_norm"] > 0 and first["n_tokens"] == n_tok
    for _ in range(4):
        train_step(model, opt, samples, algo, micro_batch_size=6)
    with torch.no_grad():
        end = float(reference_loss(model, samples, algo)[0])
    assert end < start - 0.5, (start, end)
    load_hf_into_model(model, arch, hf)


@pytest.mark.parametrize("share_prompts", [False, True])
def test_response_logprobs_and_entropy_match_softmax_of_full_logits(tiny, share_prompts):
    from megamu.training import pack, response_logprobs

    model, arch, _ = tiny
    samples = make_samples(2, 3, arch.vocab_size, seed=9, response_len=(1, 9))
    batch = pack(samples, share_prompts)
    with torch.no_grad():
        logp, entropy = response_logprobs(model, batch, temperature=0.8, with_entropy=True)
    for i, s in enumerate(samples):  # reference: every position's logits of the sample alone, softmax in fp64
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            z = model(ids, torch.arange(ids.shape[1])[None], None)[0, :, : arch.vocab_size].double() / 0.8
        p, r = len(s.prompt_ids), len(s.response_ids)
        ref = torch.log_softmax(z[p - 1 : p - 1 + r], -1)
        assert batch.response_mask[i].sum() == r
        torch.testing.assert_close(logp[i, :r].double(), ref.gather(-1, ids[0, p:, None])[:, 0], rtol=0, atol=2e-5)
        torch.testing.assert_close(entropy[i, :r].double(), -(ref.exp() * ref).sum(-1), rtol=0, atol=2e-5)


def test_shared_prompts_give_the_per_sample_gradient_in_fp64(distributed, tmp_path):
    # fp64 weights (the local spec's norms stay fp32): the two layouts differ only in summation order. Bounds: the
    # dtype's epsilon times the tokens a gradient sums over, far below any real difference (a response seeing another
    # response, a wrong RoPE position: ~1e-2)
    model, arch = tiny_model(tmp_path / "hf", params_dtype=torch.float64)
    samples = make_samples(3, 4, arch.vocab_size, seed=4, response_len=(1, 10))
    from megamu.training import pack, response_logprobs

    with torch.no_grad():
        one, one_h = response_logprobs(model, pack(samples), with_entropy=True)
        shared, shared_h = response_logprobs(model, pack(samples, share_prompts=True), with_entropy=True)
    assert shared.dtype == torch.float64
    torch.testing.assert_close(shared, one, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(shared_h, one_h, rtol=1e-12, atol=1e-12)
    per_sample = compute_logprobs(model, samples, micro_batch_size=5)
    assert compute_logprobs(model, samples, micro_batch_size=5, share_prompts=True) == per_sample  # both fp32-rounded
    set_behaviour(samples, per_sample, noise=0.4)
    add_triggers(samples, per_sample, n_veto=1, n_clip=1)
    algo = ALGORITHM_PRESETS["mu-grpo"]
    metrics = {}
    for share, mbs in ((False, 4), (True, 4), (True, 12)):  # groups whole or split over micro-batches
        opt = capture_optimizer(model)
        metrics[share, mbs] = train_step(model, opt, samples, algo, micro_batch_size=mbs, share_prompts=share)
        if not share:
            ref = opt.grads
        else:
            n_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
            for name, diff in rel_diffs(opt.grads, ref).items():
                assert diff <= torch.finfo(ref[name].dtype).eps * n_tokens, (mbs, name, diff)
    for key in ("loss", "entropy", "clip_fraction", "veto_token_fraction", "ratio_mean", "log_ratio_min"):
        for run in ((True, 4), (True, 12)):
            assert metrics[run][key] == pytest.approx(metrics[False, 4][key], rel=1e-10, abs=1e-12), (key, run)


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


@pytest.mark.parametrize("share_prompts", [False, True])
def test_pad_fraction_counts_padded_positions_of_the_micro_batches(tiny, share_prompts):
    from megamu.rollout.records import RolloutSample

    model, arch, _ = tiny
    algo = ALGORITHM_PRESETS["mu-grpo"]
    # one row per sample: 2 + response tokens = 3, 5, 8, 4, sorted into micro-batches of two [3, 4], [5, 8]: read
    # 2*4 + 2*8 = 24 positions for 20 tokens. Shared rows (one sample per prompt id here) hold the prompt and the
    # response without its last token: 2, 4, 7, 3 -> [2, 3], [4, 7]: read 2*3 + 2*7 = 20 for 16.
    lengths = [1, 3, 6, 2]
    samples = [RolloutSample(i, 0, [5, 6], list(range(7, 7 + r)), [-1.0] * r, 1.0, 0.5 if i % 2 else -0.5, "stop")
               for i, r in enumerate(lengths)]
    m = train_step(model, capture_optimizer(model), samples, algo, micro_batch_size=2, share_prompts=share_prompts)
    assert m["n_micro_batches"] == 2 and m["pad_fraction"] == pytest.approx(4 / 20 if share_prompts else 4 / 24)
    one = train_step(model, capture_optimizer(model), samples, algo, micro_batch_size=1)
    assert one["pad_fraction"] == 0.0
    skipped = [RolloutSample(0, 0, [5, 6], [7], [-1.0], 1.0, 0.0, "stop")]  # A = 0: nothing is forwarded
    assert train_step(model, capture_optimizer(model), skipped, algo, micro_batch_size=1,
                      skip_zero_advantage=True)["pad_fraction"] == 0.0


def test_scoring_only_the_response_tokens_gives_the_same_values_there(tiny):
    from megamu.model import score_tokens
    from megamu.training import pack

    model, arch, _ = tiny
    samples = make_samples(2, 3, arch.vocab_size, seed=9, response_len=(1, 9))
    batch = pack(samples)
    assert not batch.response_mask.all()  # the frame has padding, which the scored call skips
    with torch.no_grad():
        full = score_tokens(model, batch.input_ids, batch.score_index, batch.targets, temperature=0.7,
                            with_entropy=True)
        part = score_tokens(model, batch.input_ids, batch.score_index, batch.targets, temperature=0.7,
                            with_entropy=True, scored=batch.response_mask)
    mask = batch.response_mask
    for a, b in zip(full, part):  # same fp32 math on fewer rows: rounding only
        torch.testing.assert_close(b[mask], a[mask], rtol=0, atol=1e-5)
        assert torch.count_nonzero(b[~mask]) == 0
