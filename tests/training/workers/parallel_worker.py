"""torchrun --nproc_per_node 2 worker: DP=2 gradient invariance, TP=1 vs TP=2 updates, checkpoints TP2 -> TP1 -> TP2.

Usage: parallel_worker.py HF_DIR CKPT_DIR (HF_DIR must already hold the tiny model).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megamu.algo import AGGREGATIONS, ALGORITHM_PRESETS, AlgoConfig  # noqa: E402
from megamu.convert.tp import full_state_dict  # noqa: E402
from megamu.model import build_model  # noqa: E402
from megamu.runtime import parallel  # noqa: E402
from megamu.training import (  # noqa: E402
    OptimizerConfig,
    build_optimizer,
    compute_logprobs,
    load_checkpoint,
    save_checkpoint,
    train_step,
)
from tests.training.helpers import (  # noqa: E402
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

MU = ALGORITHM_PRESETS["mu-grpo"]
CFG = OptimizerConfig(lr=1e-3, lr_warmup_iters=0)


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def retile(tp: int) -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel.init_distributed(tensor_model_parallel_size=tp)


def full(model, arch) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in full_state_dict(model, arch)}


def close_logprobs(a: list[list[float]], b: list[list[float]], rtol: float) -> float:
    worst = max(abs(x - y) / max(1.0, abs(y)) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    assert worst <= rtol, worst
    return worst


def main(hf_dir: str, ckpt_dir: str) -> None:
    torch.set_num_threads(1)
    parallel.init_distributed(tensor_model_parallel_size=1)  # world 2: TP=1, DP=2
    # 1. DP=2 reproduces policy_loss over the whole minibatch (computed locally, in one call). In fp64 (but for the
    # fp32 cross entropy, see fp64_model_rtol), so that what is compared is the loss scaling, not rounding.
    model, arch = tiny_model(hf_dir, params_dtype=torch.float64)
    rtol = fp64_model_rtol(arch)
    samples = make_samples(4, 4, arch.vocab_size, seed=1)
    lp = compute_logprobs(model, samples, micro_batch_size=3)
    set_behaviour(samples, lp, noise=0.4)
    add_triggers(samples, lp, n_veto=2, n_clip=2)
    for aggregation in AGGREGATIONS:
        algo = AlgoConfig.preset("grpo", veto_threshold=1e-4, aggregation=aggregation)
        model.zero_grad(set_to_none=True)
        ref_loss, ref_stats = reference_loss(model, samples, algo)
        ref_loss.backward()
        ref = grads(model)
        opt = capture_optimizer(model)
        m = train_step(model, opt, samples, algo, micro_batch_size=3)
        diff = max_rel_diff(opt.grads, ref)
        assert diff <= rtol, (aggregation, rel_diffs(opt.grads, ref))
        assert abs(m["loss"] - ref_loss.item()) <= rtol * max(1.0, abs(ref_loss.item())), (m["loss"], ref_loss)
        for k in ("clip_fraction", "veto_token_fraction", "veto_sequence_fraction", "ratio_neg_adv_mean", "approx_kl"):
            assert abs(m[k] - ref_stats[k]) <= rtol * max(1.0, abs(ref_stats[k])), (aggregation, k, m[k], ref_stats[k])
        # the lower tail of log ρ is a quantile over the whole minibatch (megamu.algo.tail), gathered over the ranks
        neg = [(s, cur) for s, cur in zip(samples, lp) if s.advantage < 0]
        tokens = torch.tensor([a - b for s, cur in neg for a, b in zip(cur, s.behaviour_logprobs)], dtype=torch.float64)
        # compute_logprobs rounds log-probs to fp32: each log ρ here is off by at most 2 eps32 x the largest |log p|
        largest = max(abs(x) for s, cur in neg for x in (*cur, *s.behaviour_logprobs))
        bound = 2 * torch.finfo(torch.float32).eps * largest
        assert abs(m["neg_adv_log_ratio_p10"] - float(torch.quantile(tokens, 0.1))) <= bound, m
        log(f"DP=2 {aggregation}: max rel grad diff {diff:.2e}")

    # 2. one μ-GRPO update at TP=1 (DP=2) ... (fp64 again: TP only reorders sums, see fp64_model_rtol)
    model, arch = tiny_model(hf_dir, params_dtype=torch.float64)
    opt = build_optimizer(model, CFG)
    m1 = train_step(model, opt, samples, MU, micro_batch_size=3)
    p1 = full(model, arch)

    # ... and at TP=2 (DP=1) from the same weights; then a checkpoint and a second, uninterrupted update
    retile(2)
    model2, _ = tiny_model(hf_dir, params_dtype=torch.float64)
    opt2 = build_optimizer(model2, CFG)
    m2 = train_step(model2, opt2, samples, MU, micro_batch_size=3)
    p2 = full(model2, arch)
    diff = max_rel_diff(p2, p1)
    assert diff <= rtol, diff
    assert abs(m2["loss"] - m1["loss"]) <= rtol and abs(m2["grad_norm"] / m1["grad_norm"] - 1) <= rtol, (m1, m2)
    log(f"TP=2 vs TP=1 after one update: max rel param diff {diff:.2e}")
    lp_tp2 = compute_logprobs(model2, samples, micro_batch_size=4)
    save_checkpoint(ckpt_dir, 1, model2, arch, opt2, extra={"stage": 1, "update_offset": 1})
    # each TP rank wrote its own shards (torch_dist names them __<rank>_<i>.distcp)
    files = {f.name.split("_")[2] for f in (Path(ckpt_dir) / "iter_0000001").glob("__*_*.distcp")}
    assert files == {"0", "1"}, files
    train_step(model2, opt2, samples, MU, micro_batch_size=3)
    p2_second = full(model2, arch)

    # 3. load the TP=2 checkpoint at TP=1 into fresh random weights: same log-probs, same second update
    retile(1)
    torch.manual_seed(7)
    model3 = build_model(arch, params_dtype=torch.float64)
    opt3 = build_optimizer(model3, CFG)
    extra = load_checkpoint(ckpt_dir, model3, arch, opt3)
    assert extra == {"stage": 1, "update_offset": 1, "iteration": 1}, extra
    worst = close_logprobs(compute_logprobs(model3, samples, micro_batch_size=4), lp_tp2, rtol)
    log(f"TP=2 checkpoint loaded at TP=1: max rel Δ log-prob {worst:.2e}")
    train_step(model3, opt3, samples, MU, micro_batch_size=3)
    diff = max_rel_diff(full(model3, arch), p2_second)
    assert diff <= rtol, diff  # the Adam moments were resharded correctly (zeros or a wrong split would show ~1e-2)
    log(f"second update after TP2->TP1 resume vs uninterrupted TP=2: max rel param diff {diff:.2e}")
    lp_tp1 = compute_logprobs(model3, samples, micro_batch_size=4)
    save_checkpoint(ckpt_dir, 2, model3, arch, opt3, extra={"stage": 1, "update_offset": 2})

    # 4. and back: the TP=1 checkpoint at TP=2
    retile(2)
    torch.manual_seed(8)
    model4 = build_model(arch, params_dtype=torch.float64)
    opt4 = build_optimizer(model4, CFG)
    assert load_checkpoint(ckpt_dir, model4, arch, opt4)["iteration"] == 2
    worst = close_logprobs(compute_logprobs(model4, samples, micro_batch_size=4), lp_tp1, rtol)
    log(f"TP=1 checkpoint loaded at TP=2: max rel Δ log-prob {worst:.2e}")
    assert opt4.state_dict()["iteration"] == 2
    log("OK")
    parallel.destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:3])
