"""bench/fidelity.py: the pre-registered rules on made-up runs, and --quick end to end on a tiny lab model."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from bench.lab import plan
from bench.lab.report import verdicts
from bench.lab.summary import Run, stage_end
from tests.processes import run_owned

REPO = Path(__file__).resolve().parents[2]


def _run(method: str, accs: list[float], mu: int = 1024, lr: float = 3e-5, ratio: float = 1.0, n: int = 128,
         clip: float = 5e-4, seed: int = 1, updates: int = 4096, k: int = 4) -> Run:
    step = updates // (len(accs) - 1)
    evals = [{"update": step * i, "sampled": x, "greedy": x, "n": n, "k": k} for i, x in enumerate(accs)]
    config = {"method": method, "mu": mu, "stages": updates // mu, "seed": seed, "lr": lr, "updates": updates,
              "k": k, "lab_model": {}}
    return Run({"key": f"{method}/{mu}/{seed}/{lr}", "config": config, "evals": evals,
                "run_mean": {"clip_fraction": clip}, "stage_end_ratio_neg_adv": ratio})


def test_learned_collapsed_and_peak_follow_the_stated_rules():
    se = math.sqrt(0.5 * 0.5 / 128)
    assert plan.learned(_run("grpo", [0.5, 0.5 + 2.1 * se])) and not plan.learned(_run("grpo", [0.5, 0.5 + 1.9 * se]))
    assert plan.collapsed(_run("x", [0.5, 0.5 - 3.1 * se])) and not plan.collapsed(_run("x", [0.5, 0.5 - 2.9 * se]))
    assert plan.collapsed(_run("x", [0.2, 0.9, 0.44])) and not plan.collapsed(_run("x", [0.2, 0.9, 0.46]))
    peak_se = math.sqrt(0.8 * 0.2 / 128)
    assert plan.holds_peak(_run("x", [0.2, 0.8, 0.8 - 1.9 * peak_se]))
    assert not plan.holds_peak(_run("x", [0.2, 0.8, 0.8 - 2.1 * peak_se]))


def test_gate_needs_the_clip_band_and_a_gain_after_half_the_updates():
    se_nk = math.sqrt(0.5 * 0.5 / (128 * 4))

    def gate(accs, clip=5e-4):
        runs = {("grpo", 1, plan.LR_START): _run("grpo", accs, mu=4, clip=clip)}
        return plan.gate(lambda label, seed, lr, m=None: runs.get((label, seed, lr)))[0]

    assert gate([0.1, 0.3, 0.5, 0.5 + 2.1 * se_nk, 0.4]) == "pass"  # the late best counts, not the final
    assert gate([0.1, 0.3, 0.5, 0.5 + 1.9 * se_nk, 0.5]) == "fail"
    assert gate([0.1, 0.3, 0.5, 0.9, 0.9], clip=2e-3) == "pending"  # out of the band: another lr decides


def test_the_lr_rule_follows_the_registered_order():
    def search(results: dict[float, tuple[float, list[float]]]):
        runs = {}
        for lr, (clip, accs) in results.items():
            for label, seed in plan.RULE_RUNS:
                runs[label, seed, lr] = _run(label, accs, mu=4, lr=lr, clip=clip if label == "grpo" else 0.0)
        return plan.lr_search(lambda label, seed, lr, m=None: runs.get((label, seed, lr)))[:2]

    good, collapse = [0.2, 0.6, 0.7], [0.2, 0.7, 0.1]
    assert search({}) == (None, plan.LR_START)
    assert search({3e-5: (5e-4, good)}) == (None, 1e-4)  # a pass: the larger candidate is tried
    assert search({3e-5: (5e-4, good), 1e-4: (3e-3, good)}) == (3e-5, None)  # 1e-4 clips too much
    assert search({3e-5: (5e-4, good), 1e-4: (9e-4, good)}) == (1e-4, None)
    assert search({3e-5: (5e-4, collapse)}) == (None, 1e-5)
    assert search({3e-5: (5e-4, collapse), 1e-5: (3e-4, good)}) == (1e-5, None)
    assert search({3e-5: (5e-4, collapse), 1e-5: (1e-4, good)}) == (None, None)  # the rule has no lr


def test_claims_read_the_runs():
    runs = [_run("grpo", [0.2, 0.8, 0.8], mu=4), _run("grpo-relaxed", [0.2, 0.8, 0.1], ratio=0.3),
            _run("mu-grpo-trigger", [0.2, 0.7, 0.05], ratio=0.5), _run("mu-grpo", [0.2, 0.8, 0.79], ratio=1.02),
            _run("mu-grpo-suffix", [0.2, 0.8, 0.8]), _run("mu-grpo-nontrigger-suffix", [0.2, 0.8, 0.8], ratio=0.95),
            _run("grpo-high-staleness", [0.2, 0.5, 0.5]), _run("mu-grpo", [0.2, 0.5, 0.5], mu=4096),
            _run("mu-grpo-tau1e-6", [0.2, 0.79, 0.79]), _run("mu-grpo-tau1e-2", [0.2, 0.5, 0.5])]
    out = verdicts(runs, 3e-5, 1024, 4, 4096)
    pending = [v for v in out if "**pending**" in v]
    assert len(pending) == 1 and "(g)" in pending[0] and "grpo-relaxed" in pending[0]  # no 1-stage relaxed run
    assert all("**holds**" in v for v in out if v not in pending), out
    runs[3] = _run("mu-grpo", [0.2, 0.6, 0.6], ratio=1.02)  # 0.2 below grpo: more than 2 SE (0.1)
    assert "**does not hold**" in verdicts(runs, 3e-5, 1024, 4, 4096)[4]
    runs[1] = _run("grpo-relaxed", [0.2, 0.8, 0.1], ratio=0.9)  # collapsed, but E[ρ|A<0] did not fall
    assert "**does not hold**" in verdicts(runs, 3e-5, 1024, 4, 4096)[3]
    assert "**pending**" in verdicts(runs[:1], 3e-5, 1024, 4, 4096)[0]


def test_stage_end_ratio_is_the_lowest_stage_end_median():
    stage = [i // 25 for i in range(100)]
    # 4 stages of 25 updates; stage 1 drifts to 0.5 over its last quarter, then β is reset and ρ is back at 1
    values = [1.0] * 25 + [1.0] * 18 + [0.5] * 7 + [1.0] * 25 + [1.0, math.nan] * 12 + [1.0]
    assert stage_end(stage, values) == 0.5


AD_HOC = ("mu-grpo-trigger",)  # a veto scope: its flag must reach the trainer (every preset: tests/e2e)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("fid")
    base = [sys.executable, str(REPO / "bench" / "fidelity.py"), "--quick", "--out", str(out / "o"),
            "--lab-cache", str(out / "cache"),
            # passed through to pretrain_mu_grpo.py (and into the run keys): a reward the few-hundred-weight model
            # earns at random, so groups have mixed rewards and every method's loss runs (it boxes no sums)
            "--reward-fn", "tests.e2e.rewards:has_digit", "--micro-batch-size", "16"]
    # each run is a trainer process (~10 s here; every preset also runs in tests/e2e/test_pretrain.py): one staged
    # method ad hoc (a veto scope), then the plan's first run (grpo at μ = 1, colocated), then the ad-hoc one again
    ad_hoc = [*base, "--lr", "1e-3", "--methods", *AD_HOC]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = []
    for cmd in (ad_hoc, [*base, "--plan", "--max-runs", "1"], ad_hoc):
        procs.append(run_owned(cmd, cwd=REPO, env=env, timeout=600))
        assert procs[-1].returncode == 0, procs[-1].stdout[-2000:] + procs[-1].stderr[-3000:]
    return out / "o", procs


@pytest.mark.slow
def test_quick_runs_write_summaries_with_sampled_and_greedy_accuracy(quick):
    out, _ = quick
    summaries = {json.loads(p.read_text())["key"]: json.loads(p.read_text()) for p in (out / "summaries").glob("*")}
    assert sorted(k.split("/")[0] for k in summaries) == sorted([*AD_HOC, "grpo"])
    for key, s in summaries.items():
        c = s["config"]
        assert key.startswith(f"{c['method']}/mu{c['mu']}x{c['stages']}-s{c['seed']}-lr{c['lr']:g}-")
        assert c["updates"] == s["updates_done"] == 4 and c["stages"] == 4 // c["mu"]
        assert c["lab_model"]["weights_sha256"] == json.loads((out / "lab_build.json").read_text())["weights_sha256"]
        assert "tests.e2e.rewards:has_digit" in c["extra"]
        assert [e["update"] for e in s["evals"]] == [0, 2, 4] and all(e["n"] == 8 and e["k"] == 2 for e in s["evals"])
        assert all(0 <= e["sampled"] <= 1 and 0 <= e["greedy"] <= 1 for e in s["evals"])
        assert len(s["curve"]["update"]) == 4 and set(s["curve"]) >= {"clip_fraction", "neg_adv_log_ratio_p10"}
        save = out / "runs" / key
        assert not (save / "hf").exists() and not list(save.glob("iter_*"))  # exports scored, then dropped
    grpo = next(s for k, s in summaries.items() if k.startswith("grpo/"))
    assert grpo["config"]["lr"] == plan.LR_START and grpo["config"]["mode"] == "colocated"
    log = next((out / "runs").glob("mu-grpo-trigger/*/trainer.log")).read_text()
    assert "'veto_scope': 'trigger'" in log


def test_the_key_changes_with_every_setting_that_changes_the_run():
    from bench.lab import driver as fidelity

    a = fidelity.parse(["--quick", "--out", "/nonexistent"])
    a.lab = {"weights_sha256": "x"}
    key = fidelity.key_of(a, "mu-grpo", 1, 3e-5)
    names = {key.name(a)}
    for change in (lambda: setattr(a, "extra", ["--flag"]), lambda: a.lab.update(weights_sha256="y"),
                   lambda: setattr(a, "k", 8), lambda: setattr(a, "held_out", 9)):
        change()
        names.add(key.name(a))
    names |= {fidelity.key_of(a, "mu-grpo-tau1e-2", 1, 3e-5).name(a), fidelity.key_of(a, "mu-grpo", 1, 3e-5, 4).name(a)}
    a.updates = 8
    names.add(fidelity.key_of(a, "mu-grpo", 1, 3e-5).name(a))
    assert len(names) == 8


@pytest.mark.slow
def test_quick_report_has_the_rules_the_gate_and_every_run(quick):
    out, _ = quick
    report = (out / "fidelity.md").read_text()
    assert plan.RULES in report and "## Gate" in report and "lr of the set" in report
    assert "--plan" in report and "## History" in report
    for name in ("lr_rule.png", "other.png"):
        png = (out / "fidelity" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and f"(fidelity/{name})" in report
    for method in (*AD_HOC, "grpo"):
        assert f"| {method} | " in report


@pytest.mark.slow
def test_a_second_sitting_reads_finished_runs_back(quick):
    _, (first, plan_run, again) = quick
    assert again.stdout.count("finished run found: read back") == len(AD_HOC)
    assert first.stdout.count("μ = ") == len(AD_HOC) and again.stdout.count("μ = ") == 0
    assert plan_run.stdout.count("μ = ") == 1  # --max-runs 1


def test_when_the_rule_finds_no_lr_the_plan_stops_unless_one_is_set_by_hand():
    from bench.lab import driver as fidelity

    a = fidelity.parse(["--quick", "--out", "/nonexistent", "--plan"])
    a.lab, a.key_of = {}, lambda *args: fidelity.key_of(a, *args)
    # 3e-5: grpo s1 passes the gate but drops from its peak; 1e-5: its clip fraction is below the band
    runs = [_run("grpo", [0.1, 0.5, 0.6, 0.9, 0.7], mu=1, updates=4, lr=3e-5),
            _run("grpo", [0.1, 0.5, 0.7, 0.8], mu=1, updates=4, lr=1e-5, clip=3e-5)]
    for r in runs:
        r.s["key"] = a.key_of("grpo", 1, r.lr).name(a)
    assert plan.next_keys(a, runs) == []
    a.lr = 3e-5
    todo = [(k.method.label, k.seed, k.lr) for k in plan.next_keys(a, runs)]
    assert todo == [("grpo", 2, 3e-5), ("mu-grpo-mu4", 1, 3e-5), ("mu-grpo-mu4", 2, 3e-5)]  # App. C.4 first


def _curve_run(method: str, seed: int, veto_by_stage: list[float], stages: int = 4, points: int = 8) -> Run:
    r = _run(method, [0.1, 0.2], seed=seed)
    per = points // stages
    r.s["curve"] = {"update": [(i + 1) * 4096 // points for i in range(points)],
                    "veto_token_fraction": [veto_by_stage[i // per] for i in range(points)]}
    r.s["config"]["prompts_per_update"] = 2
    return r


def test_the_tau_rule_interpolates_the_stage_one_veto_rate_log_log():
    # stage-1 fractions 1 % at τ 1e-4 and 100 % at 1e-2 (seed means): one decade of rate per decade of τ, so the
    # target rate r* is reached at τ = 1e-4 * r* / 0.01 (hand-computed), then rounded to one significant digit
    runs = [_curve_run("mu-grpo", 1, [0.008, 0.5, 0.5, 0.5]), _curve_run("mu-grpo", 2, [0.012, 0.0, 0.0, 0.0]),
            _curve_run("mu-grpo-tau1e-2", 1, [1.0, 0.1, 0.1, 0.1])]
    tau, how = plan.tau_by_veto_rate(runs)
    exact = 1e-4 * plan.VETO_TARGET / 0.01
    assert tau == float(f"{exact:.0e}") and f"{exact:.2e}" in how
    assert math.isclose(plan.VETO_TARGET, math.sqrt(0.0707 * 0.1524))
    runs[2].s["config"]["tag"] = "timed"  # a round-two run is not round one's evidence
    with pytest.raises(ValueError, match="mu-grpo-tau1e-2"):
        plan.tau_by_veto_rate(runs)


def test_curve_readings_use_the_whole_curve():
    from bench.lab import curves as cv

    accs = [0.1, 0.5, 0.2, 0.6, 0.3, 0.4, 0.9, 0.7, 0.5]  # evaluations every 512 of 4096 updates
    r = _run("mu-grpo", accs)
    # the last quarter of 4096 updates: the evaluations after update 3072 (3584 and 4096), not 3072's 0.9
    assert cv.last_window_evals(r) == 2 and math.isclose(cv.last_stage_mean(r), (0.7 + 0.5) / 2)
    assert math.isclose(cv.area(r), sum(accs[1:]) / 8) and cv.minimum(r) == 0.2
    for e, t in zip(r.s["evals"], range(0, 900, 100)):
        e["time"] = float(t)
    assert cv.time_to(r, 0.55) == 300.0 and cv.time_to(r, 0.95) is None
    twin = _run("mu-grpo-tau1e-6", accs)
    kept, dropped = cv.deduplicated([r, twin, _run("mu-grpo", accs[:-1] + [0.51], seed=2)])
    assert len(kept) == 2 and dropped == {twin.s["key"]: r.s["key"]}


def test_round_two_runs_every_arms_first_seed_before_any_second():
    from bench.lab import driver as fidelity

    a = fidelity.parse(["--out", "/nonexistent", "--round2"])
    a.lab = {"weights_sha256": "x"}
    a.key_of = lambda *args: fidelity.key_of(a, *args)
    keys = plan.round2_keys(a, [])
    seeds = [k.seed for k in keys]
    assert seeds == sorted(seeds) and set(seeds) == set(plan.ROUND2_SEEDS)
    first = [(k.method.label, k.mu, k.prompts_per_update(a), k.updates, k.lr, k.tag) for k in keys if k.seed == 1]
    assert first[:3] == [("grpo", 4, 2, 4096, 3e-5, "timed"), ("mu-grpo", 1024, 2, 4096, 3e-5, "timed"),
                         ("grpo-high-staleness", 1024, 2, 4096, 3e-5, "timed")]
    assert first[3][0] == plan.TAU_RULE_METHOD and ("mu-grpo", 256, 8, 1024, 3e-5, "") in first
    assert ("grpo-high-staleness", 64, 32, 256, 3e-5, "") in first
    # equal data: every arm but minibatch-8x8-mu1024 (4x) sees 8192 prompts, in 4 stages (staged) or stages of μ = 4
    # updates (GRPO); evaluations at the same samples
    for k in keys:
        assert k.updates * k.prompts_per_update(a) == 8192 * (4 if k.prompts_per_update(a) == 8 and k.mu == 1024 else 1)
        assert k.stages == (k.updates // 4 if k.mu == 4 else 4)
        if k.updates * k.prompts_per_update(a) == 8192:
            assert k.eval_every(a) * k.prompts_per_update(a) == 512
    assert len({k.name(a) for k in keys}) == len(keys)
    # a run key of round one (no tag) is not read back as round two's baseline
    assert fidelity.key_of(a, "mu-grpo", 1, 3e-5).name(a) != keys[1].name(a)
