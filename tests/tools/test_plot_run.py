"""tools/plot_run.py on a synthetic run: every figure is written as a valid PNG."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk (PNG spec: magic, then length, b'IHDR', width, height)."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _synthetic_run(run: Path) -> None:
    rows = []
    for u in range(60):
        stage = u // 20
        rows.append({"kind": "update", "stage": stage, "update": u, "time": 5.0 * u, "loss": 0.1,
                     "reward_mean": 0.3 + 0.005 * u + 0.05 * math.sin(u), "veto_token_fraction": 0.01 * (u % 20) / 20,
                     "veto_sequence_fraction": 0.02 * (u % 20) / 20, "ratio_neg_adv_mean": 1.0 + 0.001 * (u % 20)})
        if u % 20 == 19:
            rows.append({"kind": "stage", "stage": stage, "time": 5.0 * u, "t_rollout": 30.0, "t_train": 70.0,
                         "reward_mean": 0.4})
    rows.append({"kind": "run", "t_total": 300.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval").mkdir()
    for k in range(3):
        report = {"checkpoint": f"stage_{k}", "updates": 20 * k, "time": 100.0 * k, "average": 0.2 + 0.1 * k,
                  "benchmarks": {"aime24": {"mean": 0.1 + 0.05 * k}, "math500": {"mean": 0.3 + 0.15 * k}}}
        (run / "eval" / f"stage_{k}.json").write_text(json.dumps(report))
    (run / "eval" / "summary.json").write_text(json.dumps({"best": "stage_2"}))


def test_plot_run_writes_pngs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _synthetic_run(run)
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "plot_run.py"), str(run), "--out", str(tmp_path / "p")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pngs = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert pngs == ["accuracy_vs_time.png", "reward.png", "stability.png"]
    for name in pngs:
        w, h = _png_size(tmp_path / "p" / name)
        assert w >= 300 and h >= 200


def test_plot_run_without_eval_reports_and_veto(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # A GRPO run: no veto statistics, no evaluation yet. Reward and E[rho|A<0] still plot; accuracy is skipped.
    rows = [{"kind": "update", "stage": u // 4, "update": u, "time": float(u), "reward_mean": 0.5,
             "ratio_neg_adv_mean": 1.0} for u in range(12)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "plot_run.py"), str(run)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["reward.png", "stability.png"]
    assert "accuracy vs wall-clock: no data" in proc.stdout

    # The trainer's own held-out evaluations (the demo's before/after) stand in for missing evaluation reports.
    with (run / "metrics.jsonl").open("a") as f:
        for stage, t in ((0, 0.5), (3, 12.0)):
            f.write(json.dumps({"kind": "eval", "stage": stage, "label": "x", "accuracy": 0.2, "n": 50, "time": t}))
            f.write("\n")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "plot_run.py"), str(run)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _png_size(run / "plots" / "accuracy_vs_time.png")[0] >= 300


def test_stage_starts_and_smooth():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import plot_run
    finally:
        sys.path.remove(str(REPO / "tools"))
    ups = [{"update": u, "stage": s} for u, s in enumerate([0, 0, 0, 1, 1, 2])]
    assert plot_run.stage_starts(ups) == [3, 5]
    assert plot_run.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_the_smoothed_reward_is_smoothed_and_a_run_of_minutes_is_drawn_in_minutes():
    """The demo's 32 updates: the "smoothed" curve averages 4 updates (a window of 1 drew the raw curve twice);
    its 9-minute run is labelled in minutes, a 5-hour run in hours."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import plot_run
    finally:
        sys.path.remove(str(REPO / "tools"))
    assert [plot_run.smoothing_window(n) for n in (1, 3, 32, 100, 4096)] == [1, 3, 4, 5, 204]
    raw = [0.0, 1.0] * 16
    smoothed = plot_run.smooth(raw, plot_run.smoothing_window(len(raw)))
    assert smoothed[3:] == [0.5] * 29  # the alternating rewards averaged out once the window is full
    assert plot_run.time_axis([0.0, 270.0, 540.0]) == ([0.0, 4.5, 9.0], "wall-clock (minutes)")
    assert plot_run.time_axis([0.0, 18000.0]) == ([0.0, 5.0], "wall-clock (hours)")
