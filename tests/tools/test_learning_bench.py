"""bench/learning.py on a tiny random model: one short run per preset, a table whose numbers are the runs' own."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.processes import run_owned
from tests.tiny import save_tiny_model

pytestmark = pytest.mark.slow  # bench/learning.py launches the trainer once per preset

REPO = Path(__file__).resolve().parents[2]


def test_learning_bench_reports_each_presets_greedy_accuracy_before_and_after(tmp_path):
    model = save_tiny_model(tmp_path / "tiny", "llama", seed=3)
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "bench.learning", "--algorithms", "grpo", "mu-grpo", "--mu", "2",
           "--num-stages", "1", "--prompts-per-update", "2", "--n-samples-per-prompt", "4", "--eval-prompts", "4",
           "--out", str(out),
           # passed through to pretrain_mu_grpo.py: the tiny model earns the digit reward, not a math one
           "--hf-checkpoint", str(model), "--reward-fn", "tests.e2e.rewards:has_digit",
           "--rollout-max-response-len", "12", "--micro-batch-size", "4", "--lr", "1e-3"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = run_owned(cmd, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    rows = {m.group(1): m for m in re.finditer(
        r"^ (\S+)\s+\|\s+(\d+) \|\s+(\d+) \|.*\| (\d\.\d{3}) -> (\d\.\d{3})$", proc.stdout, re.MULTILINE)}
    assert sorted(rows) == ["grpo", "mu-grpo"], proc.stdout
    for algorithm, m in rows.items():
        records = [json.loads(x) for x in (out / algorithm / "metrics.jsonl").read_text().splitlines()]
        evals = {r["label"]: r["accuracy"] for r in records if r["kind"] == "eval"}
        assert int(m.group(2)) == 2 and int(m.group(3)) == 2 * 2 * 4  # updates; samples = μ x B_mini x G
        assert float(m.group(4)) == round(evals["base"], 3) and float(m.group(5)) == round(evals["final"], 3)
