"""metrics.jsonl's truncation on resume, and the wandb tracker offline (read back from wandb's own file)."""

import json
import time

import pytest

from megamu.observability.metrics import MetricsLogger, read_metrics
from megamu.observability.tracking import TrackerConfig, make_tracker
from tests.wandb_records import history_rows


def test_truncate_keeps_evaluations_of_policies_before_the_checkpoint(tmp_path):
    m = MetricsLogger(str(tmp_path), None, enabled=True)
    for rec in ({"kind": "eval", "stage": 0, "update": 0, "label": "base"},
                {"kind": "eval", "stage": 1, "update": 4, "label": "update 4"},
                {"kind": "eval", "stage": 2, "update": 8, "label": "update 8"},
                {"kind": "eval", "stage": 0, "label": "old record without update"}):
        m.log(**rec)
    m.truncate(stage=1, update=6)  # resumed mid-stage 1: D_1 exists, its start's evaluation is not redone
    assert [r["label"] for r in read_metrics(tmp_path)] == ["base", "update 4", "old record without update"]
    m.truncate(stage=1, update=4)  # resumed at stage 1's start: its evaluation runs again with its rollout
    assert [r["label"] for r in read_metrics(tmp_path)] == ["base", "old record without update"]


def test_wandb_offline_gets_every_record_and_a_table(tmp_path):
    pytest.importorskip("wandb")
    cfg = TrackerConfig(wandb=True, project="megamu-test", mode="offline")
    m = MetricsLogger(str(tmp_path), None, enabled=True, tracker=make_tracker(cfg, tmp_path, {"lr": 1e-3}))
    for u in range(3):
        m.log("update", step=u + 1, update=u, loss=0.5 / (u + 1), reward_mean=0.25 * u, label="text is not logged")
    m.log("stage", step=0, stage=0, reward_mean=0.125)
    m.log("eval", step=3, tag="eval/aime", set="aime", accuracy=0.5, pass1=0.375)
    m.table("samples/stage_0", ["prompt", "response", "reward"], [["1+1=", "2", 1.0], ["2+2=", "5", 0.0]])
    m.close()
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    (log,) = tmp_path.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    rows = history_rows(log)
    for _ in range(100):  # wandb's service process may finish writing its log just after finish() returned
        if len(rows) >= 6:
            break
        time.sleep(0.2)
        rows = history_rows(log)
    updates = [r for r in rows if "update/loss" in r]
    assert [(r["update/step"], r["update/loss"], r["update/reward_mean"]) for r in updates] == [
        (u + 1, 0.5 / (u + 1), 0.25 * u) for u in range(3)]
    assert not any("update/label" in r for r in rows)
    assert any(r.get("stage/reward_mean") == 0.125 and r["stage/step"] == 0 for r in rows)
    assert any(r.get("eval/aime/pass1") == 0.375 and r["eval/aime/step"] == 3 for r in rows)
    (table,) = tmp_path.glob(f"wandb/offline-run-*-{run_id}/files/media/table/samples/stage_0*.table.json")
    saved = json.loads(table.read_text())
    assert saved["columns"] == ["prompt", "response", "reward"] and saved["data"][1] == ["2+2=", "5", 0.0]
    # the same run directory resumes the same wandb run
    again = make_tracker(cfg, tmp_path, {})
    assert again.run.id == run_id
    again.close()
