"""Evaluation during training (--eval-interval, named sets, sampled pass@1) and wandb offline, end to end on the tiny
model, including a kill and resume: every evaluation appears once, and wandb holds what metrics.jsonl holds."""

import json
import time

import pytest

from tests.e2e.runs import flags, launch, records
from tests.wandb_records import history_rows

SETS = ["held-out", "sums"]


def eval_flags(tmp_path) -> list[str]:
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{a} + {a + 1}", "answer": str(2 * a + 1)}) + "\n"
                            for a in range(3)))
    return ["--eval-interval", "4", "--eval-prompt-data", "sums", str(data), "--n-samples-per-eval-prompt", "2",
            "--use-wandb", "--wandb-mode", "offline"]


def check_evaluations(save):
    evals = records(save, "eval")
    assert [(e["label"], e["update"], e["set"]) for e in evals] == [
        (label, update, s) for label, update in (("base", 0), ("update 4", 4), ("final", 8)) for s in SETS]
    for e in evals:
        assert e["n"] == (4 if e["set"] == "held-out" else 3) and e["k"] == 2
        assert 0 <= e["pass1"] <= e["pass_at_k"] <= 1  # the mean of k replies never beats "any of the k"
        assert 0 <= e["accuracy"] <= 1
    return evals


@pytest.mark.slow
def test_evaluations_at_stage_starts_on_named_sets_with_wandb(tiny, tmp_path):
    save = tmp_path / "run"
    launch(flags(tiny, save, *eval_flags(tmp_path)))
    evals = check_evaluations(save)
    run_id = (save / "wandb_run_id").read_text().strip()
    (log,) = save.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    for _ in range(100):  # wandb's service process may finish its log just after the trainer exited
        rows = history_rows(log)
        if sum("update/loss" in r for r in rows) == len(records(save, "update")):
            break
        time.sleep(0.2)
    logged = [(r["eval/sums/step"], r["eval/sums/pass1"]) for r in rows if "eval/sums/pass1" in r]
    assert logged == [(e["update"], e["pass1"]) for e in evals if e["set"] == "sums"]
    assert [r["update/loss"] for r in rows if "update/loss" in r] == [u["loss"] for u in records(save, "update")]
    tables = sorted(p.name.split("_")[1] for p in save.glob("wandb/offline-run-*/files/media/table/samples/*.json"))
    assert tables == ["0", "1"]  # one table of generations per stage


@pytest.mark.slow
def test_resumed_run_keeps_each_evaluation_once(tiny, tmp_path):
    """Killed between stages, resumed, killed mid-stage-1, resumed to the end (two tests of one kill each, before:
    one chain launches 3 trainers instead of 4 and resumes from both points)."""
    save = tmp_path / "run"
    for crash in ("stage:0", "update:6"):
        crashed = launch(flags(tiny, save, *eval_flags(tmp_path)), env={"MEGAMU_CRASH_AFTER": crash}, check=False)
        assert crashed.returncode != 0, f"{crash}: the crash hook did not fire"
    launch(flags(tiny, save, *eval_flags(tmp_path)))
    check_evaluations(save)
