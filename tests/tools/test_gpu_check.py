"""tools/gpu_check.py's CPU side: argument parsing, the wheel list against the pins, the trainer flags it uses, and
its checks on the CPU (--dry-run; the trainer stage is covered by tests/e2e)."""

import json
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.tools.test_dockerfile import setup_requirements
from tools import gpu_check

REPO = Path(__file__).resolve().parents[2]


def wheel_pins() -> dict[str, str]:
    text = (REPO / "tools" / "gpu_wheels.sh").read_text()
    block = text[text.index("WHEELS=(") : text.index("\n)\n", text.index("WHEELS=("))]
    return {canonicalize_name(n): v for n, v in re.findall(r"^\s+([A-Za-z0-9_.\-]+)==(\S+)", block, flags=re.M)}


def test_wheels_agree_with_the_dockerfile_and_setup_py():
    wheels = wheel_pins()
    # the lent machine's wheels carry the CPU venv's megatron-core (the newest for Python 3.11 is also what the
    # Python 3.12 image gets from PyPI); the image builds Megatron-LM at slime's commit instead (Dockerfile)
    assert wheels["megatron-core"] == version("megatron-core")
    for req in setup_requirements()["core"]:
        name = canonicalize_name(req.name)
        if name in wheels:
            assert req.specifier.contains(wheels[name]), f"gpu_wheels.sh {name}=={wheels[name]} violates {req}"
    # every module the check needs beyond the stock image comes from a listed wheel
    assert {"megatron-core", "math-verify", "pyarrow"} <= set(wheels)
    assert len(gpu_check.NEEDED) == 3


def test_arguments():
    args = gpu_check.parse_args([])
    assert (args.dry_run, args.steps, args.seq_len, args.samples) == (False, 5, 2048, 32)
    args = gpu_check.parse_args(["--dry-run", "--only", "train", "offload"])
    assert (args.steps, args.seq_len, args.only) == (2, 48, ["train", "offload"])
    assert gpu_check.parse_args(["--only", "plan", "buckets", "ep-agree"]).only == ["plan", "buckets", "ep-agree"]
    for bad in (["--samples", "12"], ["--seq-len", "8"], ["--only", "nope"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)


def test_stage_flags_parse(tmp_path):
    from megamu.arguments import parse_args
    from megamu.runtime.device import Device
    from tests.tiny import save_tiny_model

    hf = save_tiny_model(tmp_path / "hf", "qwen2", seed=3)
    for device in (Device("cpu"), Device("cuda")):
        cfg = parse_args(gpu_check.stage_flags(hf, tmp_path / "run", device.is_cuda), device=device)
        assert cfg.plan.num_stages == 1 and cfg.plan.mu == 2 and cfg.policy.bf16 == device.is_cuda
        assert cfg.engine.kind == "local"
        assert cfg.policy.transformer_impl == ("local" if device.is_cuda else None)


def dry_run(tmp_path, *checks: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """gpu_check.py --dry-run --only CHECKS on this CPU: its output and its report's rows (it must exit 0)."""
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--dry-run", "--only", *checks,
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())["rows"]


def test_dry_run_checks_pass_on_cpu(tmp_path):
    proc, rows = dry_run(tmp_path, "train", "offload", "checkpoint")
    assert [r["check"] for r in rows] == ["train", "offload", "checkpoint", "context"]
    assert all(r["ok"] for r in rows[:3]) and rows[3]["skipped"] and not rows[3]["ok"]  # the context: CUDA only
    assert re.search(r"^offload\s+PASS", proc.stdout, flags=re.M)


def test_plan_rows_refuse_an_under_estimate():
    """The plan passes only when neither the trainer state nor the step's peak is above what it planned."""
    from tools.gpu_check_path import LOOSE, PlanPoint, compare

    point = dict(micro_batch_size=2, recompute=None, planned_state=100, planned_step=50)
    assert compare(PlanPoint(**point))[0]  # nothing measured (CPU): the plan alone
    ok, verdict = compare(PlanPoint(**point, measured_state=90, measured_step=50))
    assert ok and "covers" in verdict and "loose" not in verdict
    assert not compare(PlanPoint(**point, measured_state=101, measured_step=10))[0]
    ok, verdict = compare(PlanPoint(**point, measured_state=100, measured_step=51))
    assert not ok and "step" in verdict
    assert "loose" in compare(PlanPoint(**point, measured_state=50, measured_step=150 // LOOSE - 50 - 1))[1]


def test_path_checks_run_on_cpu(tmp_path):
    proc, rows = dry_run(tmp_path, "plan", "buckets", "ep-agree")
    assert [r["check"] for r in rows] == ["plan mb2", "plan mb2-rc", "plan mb4", "plan mb4-rc", "plan te", "buckets",
                                          "ep-agree"]
    by = {r["check"]: r for r in rows}
    # TE cannot import without CUDA: the row says so and is not a pass
    assert by["plan te"]["skipped"] and not by["plan te"]["ok"]
    assert by["plan te"]["result"] in ("transformer_engine is not installed", "Transformer Engine runs on CUDA only")
    assert re.search(r"^plan te\s+SKIP", proc.stdout, flags=re.M)
    # EP 2 ran (a gloo world of 2 through megatron's alltoall dispatcher), not EP 1
    assert by["ep-agree"]["ok"] and not by["ep-agree"]["skipped"] and by["ep-agree"]["result"].startswith("EP 2:")
    assert all(r["ok"] for r in rows if not r["skipped"])


def test_ep_agree_row_judges_the_ranks_rows():
    from tools.gpu_check_path import ep_agree_verdict

    good = [[3, 2, 0, 0.0, 1.5], [3, 2, 3, 4.0, 2.0]]
    assert ep_agree_verdict(good)[0]
    assert not ep_agree_verdict([[0, 2, 0, 0.0, 1.5], [3, 2, 3, 4.0, 2.0]])[0]  # rank 0 entered no pass: a hang
    assert not ep_agree_verdict([[3, 2, 0, 0.1, 1.5], [3, 2, 3, 4.0, 2.0]])[0]  # padding changed the weights
    assert not ep_agree_verdict([[3, 1, 0, 0.0, 1.5], [3, 2, 3, 4.0, 2.0]])[0]  # log-prob passes differ


def test_ep_agree_skips_on_one_gpu(monkeypatch):
    """On a one-GPU machine the row is a skip with the reason, never a pass (EP 1 enters no collective)."""
    import torch

    from tools.gpu_check_path import ep_agreement

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ok, reason = ep_agreement(cuda=True)
    assert ok is None and "needs 2 GPUs" in reason


@pytest.mark.slow
def test_reference_rows_run_on_cpu(tmp_path):
    """The rows issue 50 added, on the CPU: the reshard (TP 1 save loaded at TP 2 in a gloo world) and megamu against
    transformers pass; TE, the CUDA IPC test and the SGLang push skip with the reason, never pass; nothing measured,
    so no measured-peaks file."""
    peaks = tmp_path / "peaks.json"
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--dry-run", "--only", "reshard",
                           "logprobs", "ipc", "server", "--out", str(out), "--measured-peaks", str(peaks)],
                          capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    by = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(by) == ["reshard", "logprobs", "te", "ipc", "server", "peaks"]
    assert by["reshard"]["ok"] and "loaded at TP 2" in by["reshard"]["result"]
    assert by["logprobs"]["ok"] and "of its bound" in by["logprobs"]["result"]
    assert all(by[c]["skipped"] and not by[c]["ok"] for c in ("te", "ipc", "server", "peaks"))
    assert not peaks.exists()
