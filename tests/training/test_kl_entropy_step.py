"""train_step with the KL and entropy terms against policy_loss over the whole minibatch in one call (fp64 tiny
model): micro-batching, the terms' gradients, their logged values, and A = 0 samples, which these terms train."""

import pytest
import torch

from megamu.algo import AGGREGATIONS, ALGORITHM_PRESETS
from megamu.training import compute_logprobs, train_step
from tests.training.helpers import (
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
def models(distributed, tmp_path_factory):
    """The policy and a reference policy with other weights (a policy some updates away from its reference)."""
    root = tmp_path_factory.mktemp("kl")
    policy, arch = tiny_model(root / "policy", params_dtype=torch.float64)
    reference, _ = tiny_model(root / "reference", seed=1, params_dtype=torch.float64)
    return policy, reference, arch


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_reproduce_the_regularised_minibatch_gradient(models, aggregation):
    policy, reference, arch = models
    samples = make_samples(4, 4, arch.vocab_size, seed=2)
    set_behaviour(samples, compute_logprobs(policy, samples, micro_batch_size=5), noise=0.3)
    for s, lp in zip(samples, compute_logprobs(reference, samples, micro_batch_size=5)):
        s.ref_logprobs = lp
    assert any(s.advantage == 0.0 for s in samples)  # all-equal groups: trained by the KL and entropy terms
    algo = ALGORITHM_PRESETS["grpo"].with_overrides(aggregation=aggregation, use_kl_loss=True, kl_coef=0.3,
                                                    kl_type="low_var_kl", entropy_coef=0.05)
    rtol = fp64_model_rtol(arch)
    policy.zero_grad(set_to_none=True)
    ref_loss, ref_stats = reference_loss(policy, samples, algo)
    ref_loss.backward()
    expected = grads(policy)
    assert ref_stats["kl_loss"] > 0 and ref_stats["entropy_loss"] > 0
    assert ref_loss.item() == pytest.approx(ref_stats["pg_loss"] + 0.3 * ref_stats["kl_loss"]
                                            - 0.05 * ref_stats["entropy_loss"], rel=1e-12)

    for micro_batch_size in (16, 3):
        opt = capture_optimizer(policy)
        # skip_zero_advantage is asked for and must not apply: A = 0 samples carry KL and entropy gradients
        m = train_step(policy, opt, samples, algo, micro_batch_size=micro_batch_size, skip_zero_advantage=True)
        assert max_rel_diff(opt.grads, expected) <= rtol, micro_batch_size
        assert m["trained_sample_fraction"] == 1.0
        for k in ("loss", "pg_loss", "kl_loss", "entropy_loss"):
            assert m[k] == pytest.approx(ref_stats[k] if k != "loss" else ref_loss.item(), rel=rtol, abs=rtol), k


def test_the_terms_move_the_gradient_and_vanish_at_zero(models):
    policy, reference, arch = models
    samples = make_samples(3, 4, arch.vocab_size, seed=4)
    set_behaviour(samples, compute_logprobs(policy, samples, micro_batch_size=5), noise=0.3)
    plain = ALGORITHM_PRESETS["grpo"]
    opt = capture_optimizer(policy)
    m_plain = train_step(policy, opt, samples, plain, micro_batch_size=4)
    g_plain = opt.grads
    assert "kl_loss" not in m_plain
    for s, lp in zip(samples, compute_logprobs(reference, samples, micro_batch_size=5)):
        s.ref_logprobs = lp
    opt = capture_optimizer(policy)
    zero = plain.with_overrides(use_kl_loss=True, kl_coef=0.0, entropy_coef=0.0)
    m_zero = train_step(policy, opt, samples, zero, micro_batch_size=4)
    assert all(torch.equal(opt.grads[k], g_plain[k]) for k in g_plain) and m_zero["loss"] == m_plain["loss"]
    assert m_zero["kl_loss"] != 0  # k1 (the default estimator) scored and logged, not trained on
    opt = capture_optimizer(policy)
    train_step(policy, opt, samples, plain.with_overrides(use_kl_loss=True, kl_coef=1.0), micro_batch_size=4)
    assert max_rel_diff(opt.grads, g_plain) > 1e-3
