"""bench/fidelity.py: the verdict rules on made-up runs, and --quick end to end on a lab model built in seconds."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from tests.processes import run_owned

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from fidelity_report import RunResult, sweep_choice, verdicts  # noqa: E402


def _run(method: str, accs: list[float], mu: int = 256, lr: float = 1e-4, ratio: float = 1.0, n: int = 200):
    evals = [{"update": 64 * i, "accuracy": a, "n": n, "mean_length": 46.0, "truncated": 0.0}
             for i, a in enumerate(accs)]
    return RunResult(save=Path("."), method=method, mu=mu, seed=1, lr=lr, updates=1024, samples=16384, evals=evals,
                     series={"ratio_neg_adv_mean": [ratio] * 100}, stage_of_update=[i // 25 for i in range(100)])


def test_learned_and_collapsed_follow_the_stated_rules():
    se = math.sqrt(0.5 * 0.5 / 200)  # 0.0354
    assert _run("grpo", [0.5, 0.5 + 2.1 * se]).learned and not _run("grpo", [0.5, 0.5 + 1.9 * se]).learned
    assert _run("x", [0.5, 0.5 - 3.1 * se]).collapsed and not _run("x", [0.5, 0.5 - 2.9 * se]).collapsed
    assert _run("x", [0.2, 0.9, 0.44]).collapsed and not _run("x", [0.2, 0.9, 0.46]).collapsed  # half the best


def test_the_lr_rule_takes_the_largest_stable_lr_that_learned():
    runs = [_run("grpo", [0.5, 0.7, 0.7], mu=4, lr=1e-4), _run("grpo", [0.5, 0.8, 0.8], mu=4, lr=3e-4),
            _run("grpo", [0.5, 0.9, 0.1], mu=4, lr=1e-3), _run("grpo", [0.5, 0.5, 0.5], mu=4, lr=1e-5)]
    assert sweep_choice(runs) == 3e-4
    assert sweep_choice(runs[2:]) is None


def test_claims_read_the_runs():
    runs = [_run("grpo", [0.5, 0.8, 0.8], mu=4), _run("grpo-relaxed", [0.5, 0.8, 0.1], ratio=0.3),
            _run("mu-grpo-trigger", [0.5, 0.7, 0.2], ratio=0.5), _run("mu-grpo", [0.5, 0.8, 0.79], ratio=1.02),
            _run("mu-grpo-suffix", [0.5, 0.8, 0.8]), _run("mu-grpo-nontrigger-suffix", [0.5, 0.8, 0.8], ratio=0.95),
            _run("grpo-high-staleness", [0.5, 0.6, 0.6])]
    a, b, c, d, e, f = verdicts(runs, 1e-4, 256, 4)
    assert "**holds**" in a and "**holds**" in b and "**holds**" in c and "**holds**" in d
    assert "**holds**" in e and "difference -0.010" in e  # 0.79 - 0.80
    assert "**holds**" in f
    runs[3] = _run("mu-grpo", [0.5, 0.8, 0.6], ratio=1.02)  # 0.2 below grpo: more than 2 SE (0.085)
    assert "**does not hold**" in verdicts(runs, 1e-4, 256, 4)[4]
    runs[1] = _run("grpo-relaxed", [0.5, 0.8, 0.1], ratio=0.9)  # collapsed, but E[ρ|A<0] did not fall
    assert "**does not hold**" in verdicts(runs, 1e-4, 256, 4)[3]
    assert "**not run**" in verdicts(runs[:1], 1e-4, 256, 4)[0]


QUICK_METHODS = ("grpo", "grpo-relaxed", "mu-grpo-trigger")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("fid")
    # three of the nine methods (each run is a trainer process, ~15 s here; every preset also runs in
    # tests/e2e/test_pretrain.py): the low-μ baseline, the relaxed clip (both figures' subject) and a veto scope
    cmd = [sys.executable, str(REPO / "bench" / "fidelity.py"), "--quick", "--out", str(out / "o"), "--lr", "1e-3",
           "--lab-cache", str(out / "cache"), "--methods", *QUICK_METHODS,
           # passed through to pretrain_mu_grpo.py: a reward the few-hundred-weight model earns at random, so groups
           # have mixed rewards and every method's loss runs (it boxes no sums)
           "--reward-fn", "tests.e2e.rewards:has_digit", "--micro-batch-size", "16"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    first = run_owned(cmd, cwd=REPO, env=env, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    again = run_owned(cmd, cwd=REPO, env=env, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    return out / "o", first, again


def test_quick_runs_each_method_at_the_same_samples(quick):
    out, _, _ = quick
    rows = json.loads((out / "summary.json").read_text())
    sys.path.insert(0, str(REPO / "bench"))
    from fidelity import BY_LABEL

    assert set(QUICK_METHODS) <= set(BY_LABEL) and sorted(r["method"] for r in rows) == sorted(QUICK_METHODS)
    for r in rows:
        save = out / "runs" / r["method"] / f"mu{r['mu']}-s1-lr0.001"
        records = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
        stages = [x for x in records if x["kind"] == "stage"]
        assert sum(x["kind"] == "update" for x in records) == r["updates"] == 4
        assert r["samples"] == 4 * 2 * 8  # updates x B_mini x G, the same for every method
        assert r["mu"] == (1 if r["method"] in ("grpo", "mu-grpo-mu4") else 2) and len(stages) == 4 // r["mu"]
        assert not (save / "hf").exists() and not list(save.glob("iter_*"))  # exports scored, then dropped
        evals = json.loads((save / "lab_eval.json").read_text())["evals"]
        assert [e["update"] for e in evals] == [0, 2, 4]  # the base model, then every --eval-every updates
        assert r["final_accuracy"] == evals[-1]["accuracy"] and r["held_out"] == evals[0]["n"] == 8
        assert r["best_accuracy"] == max(e["accuracy"] for e in evals[1:])
    log = (out / "runs" / "mu-grpo-trigger" / "mu2-s1-lr0.001" / "trainer.log").read_text()
    assert "'veto_scope': 'trigger'" in log


def test_quick_report_has_the_figures_and_every_claim(quick):
    out, _, _ = quick
    report = (out / "fidelity.md").read_text()
    for name in ("fig2_clip.png", "fig3_scopes.png", "per_update.png"):
        png = (out / "fidelity" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and f"(fidelity/{name})" in report
    for claim in "abcdef":
        assert f"- ({claim}) " in report
    rows = json.loads((out / "summary.json").read_text())
    grpo = next(r for r in rows if r["method"] == "grpo")
    assert f"| grpo | 1 | 1 | 0.001 | 4 | 64 | {grpo['base_accuracy']:.3f} / " in report


def test_a_second_sitting_reads_finished_runs_back(quick):
    out, first, again = quick
    n = len(QUICK_METHODS)
    assert again.stdout.count("finished run found: read back") == n
    assert first.stdout.count("μ = ") == n and again.stdout.count("μ = ") == 0  # nothing trained the second time


def test_stage_end_ratio_is_the_lowest_stage_end_median():
    r = _run("grpo-relaxed", [0.5, 0.1])
    # 4 stages of 25 updates; stage 1 drifts to 0.5 over its last quarter, then β is reset and ρ is back at 1
    r.series["ratio_neg_adv_mean"] = [1.0] * 25 + [1.0] * 18 + [0.5] * 7 + [1.0] * 25 + [1.0, math.nan] * 12 + [1.0]
    assert r.stage_end() == 0.5 and r.late("ratio_neg_adv_mean") == 1.0
