"""bench/fidelity.py --quick on a tiny random model: 2 updates per method, a report whose numbers are the runs' own."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from megamu.tiny import save_tiny_model
from tests.processes import run_owned

REPO = Path(__file__).resolve().parents[2]
METHODS = ["grpo-mu4", "mu-grpo", "mu-grpo-trigger"]


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _base(run: Path) -> float:
    return next(r["accuracy"] for r in _records(run) if r.get("label") == "base")


def test_fidelity_quick_writes_a_report_from_the_runs_metrics(tmp_path):
    model = save_tiny_model(tmp_path / "tiny", "llama", seed=3)
    out = tmp_path / "fid"
    cmd = [sys.executable, str(REPO / "bench" / "fidelity.py"), "--quick", "--out", str(out), "--methods", *METHODS,
           "--prompts-per-update", "2", "--n-samples-per-prompt", "4", "--eval-prompts", "4", "--lr", "1e-3",
           # passed through to pretrain_mu_grpo.py: the tiny model earns the digit reward, not a math one
           "--hf-checkpoint", str(model), "--reward-fn", "tests.e2e.rewards:has_digit",
           "--rollout-max-response-len", "12", "--micro-batch-size", "4"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = run_owned(cmd, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = (out / "fidelity.md").read_text()

    for label in METHODS:
        records = _records(out / label)
        assert sum(r["kind"] == "update" for r in records) == 2
        # checkpoints and exports are dropped once the run is done; the report needs only metrics and manifests
        assert not list((out / label).glob("iter_*")) and not (out / label / "hf").exists()
        evals = {r["label"]: r["accuracy"] for r in records if r["kind"] == "eval"}
        row = re.search(rf"^\| {re.escape(label)} \|.*\| (\d+) \| (\d+) \|.*\| (\d\.\d\d) -> \*\*(\d\.\d\d)\*\* \|$",
                        report, re.MULTILINE)
        assert row, f"no table row for {label}:\n{report}"
        assert int(row.group(1)) == 2 and int(row.group(2)) == 2 * 2 * 4  # updates; samples = updates x B_mini x G
        # runs on a copied stage-0 dataset skip the base evaluation; the report gives them the generator's
        base = evals["base"] if "base" in evals else _base(out / "mu-grpo")
        assert row.group(3) == f"{base:.2f}"
        assert row.group(4) == f"{evals['final']:.2f}"
    # standard GRPO refreshes its data every update in quick mode (μ = 1, 2 stages, colocated)
    assert sum(r["kind"] == "stage" for r in _records(out / "grpo-mu4")) == 2
    # the scope override reaches the trainer
    assert "'veto_scope': 'trigger'" in (out / "mu-grpo-trigger.log").read_text()
    # staged methods share one stage-0 dataset (same β, seed and prompts): byte-identical shards
    shards = [(out / m / "rollouts" / "stage_0" / "shard-00000.parquet").read_bytes()
              for m in ("mu-grpo", "mu-grpo-trigger")]
    assert shards[0] == shards[1]

    # claim 4's numbers are the two runs' final accuracies
    final = {m: next(r["accuracy"] for r in _records(out / m) if r.get("label") == "final") for m in METHODS}
    claim4 = re.search(r"^4\. .*?(\d\.\d\d) vs (\d\.\d\d) \(difference ([+-]\d\.\d\d)", report, re.MULTILINE)
    assert claim4, report
    assert claim4.group(1) == f"{final['mu-grpo']:.2f}" and claim4.group(2) == f"{final['grpo-mu4']:.2f}"
    assert claim4.group(3) == f"{final['mu-grpo'] - final['grpo-mu4']:+.2f}"

    for name in ("per_update_methods.png", "per_update_scopes.png", "accuracy_wallclock.png"):
        png = (out / "fidelity" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 200_000
        assert f"(fidelity/{name})" in report

    # a rerun reads the finished runs back instead of training again
    again = run_owned(cmd, cwd=REPO, env=env, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert again.stdout.count("finished run found") == len(METHODS)
