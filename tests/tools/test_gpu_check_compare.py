"""tools/gpu_check.py's rows fail on a planted defect (issue 50 item 6): each row's verdict is a function of CPU
tensors (tools/gpu_check_compare.py), fed here the defect it exists to catch -- a wrong weight mapping, a log-prob
off by 8 bf16 eps, a bit flipped in a reloaded or resharded tensor, a peak above the plan, an MFU below the floor, a
GPU test that failed or only skipped -- and, for contrast, what a correct bf16 pipeline gives."""

import json
from pathlib import Path

import pytest
import torch

from megamu.memory import measured_peaks
from tools.gpu_check_compare import (
    EPS_BF16,
    MFU_FLOOR,
    compare_bitwise,
    compare_logprobs,
    compare_peaks,
    logprob_bounds,
    mfu_verdict,
    pytest_verdict,
)


def reference(seed: int = 0, tokens: int = 256, vocab: int = 1000, spread: float = 2.0):
    """fp64 logits of ``spread`` and the log-probs of random targets under them."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, vocab, generator=g, dtype=torch.float64) * spread
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    return logits, targets, logp


def test_a_bf16_pipeline_passes_and_8_eps_off_fails():
    logits, targets, ref = reference()
    scale = logits.abs().amax(-1)
    # the bf16 pipeline's last rounding: logits held in bf16, log-softmax in fp32 -- within the bound
    ours = torch.log_softmax(logits.to(torch.bfloat16).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    ok, verdict = compare_logprobs(ours, ref, scale, n_layers=2)
    assert ok, verdict
    # every log-prob off by 8 eps (a systematic shift: a wrong temperature or scale)
    assert not compare_logprobs(ref + 8 * EPS_BF16, ref, scale, n_layers=2)[0]
    # one log-prob off by 8 eps where its bound is tighter (logits of size < 1: below 2 u (1 + 1) (2 + 1) = 6 eps)
    small = reference(spread=0.2)
    one = small[2].clone()
    one[17] += 8 * EPS_BF16
    assert logprob_bounds(small[0].abs().amax(-1), 2)[0].max() < 8 * EPS_BF16
    assert compare_logprobs(small[2], small[2], small[0].abs().amax(-1), 2)[0]
    assert not compare_logprobs(one, small[2], small[0].abs().amax(-1), 2)[0]
    # a NaN or a shape mismatch is never a pass
    nan = ref.clone()
    nan[0] = float("nan")
    assert not compare_logprobs(nan, ref, scale, 2)[0]
    assert not compare_logprobs(ref[:10], ref, scale, 2)[0]


def swap_gate_and_up(src: Path, dst: Path) -> None:
    """A copy of the HF folder ``src`` with layer 0's gate and up projections exchanged: a wrong weight mapping."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
        if gate in tensors:
            tensors[gate], tensors[up] = tensors[up], tensors[gate]
            save_file(tensors, f, metadata={"format": "pt"})


def test_the_logprobs_row_catches_a_wrong_weight_mapping(tmp_path, distributed):
    from megamu.model import ModelArch
    from tests.tiny import save_tiny_model
    from tools import gpu_check_rows as rows

    hf = save_tiny_model(tmp_path / "hf", "qwen3", seed=1)
    swap_gate_and_up(hf, tmp_path / "swapped")
    ok, verdict = rows.logprobs_check(hf, cuda=False, seq=48)  # the row itself, on the CPU: a pass
    assert ok, verdict
    ids = rows.sample_ids(ModelArch.from_hf(hf).vocab_size, seq=48)
    ref, scale = rows._reference(hf, False, ids)
    ours, layers = rows._megamu_logprobs(tmp_path / "swapped", False, "local", ids)  # megamu mapped wrongly
    ok, verdict = compare_logprobs(ours, ref, scale, layers)
    assert not ok, verdict


def test_bitwise_rows_catch_one_ulp_a_missing_tensor_and_a_dtype():
    want = {"a": torch.randn(5, 3), "b": torch.randn(7, dtype=torch.float64)}
    assert compare_bitwise(want, {k: v.clone() for k, v in want.items()})[0]
    flipped = {k: v.clone() for k, v in want.items()}
    flipped["a"][2, 1] = torch.nextafter(flipped["a"][2, 1], torch.tensor(float("inf")))
    ok, verdict = compare_bitwise(want, flipped)
    assert not ok and "differ (1): ['a']" in verdict
    assert not compare_bitwise(want, {"a": want["a"]})[0]
    assert not compare_bitwise(want, {"a": want["a"], "b": want["b"].float()})[0]
    assert not compare_bitwise(want, {**want, "c": torch.zeros(1)})[0]


def test_a_peak_above_the_plan_fails_its_row():
    from tools import gpu_check_path as path

    planned = {"activations": 100 * 2**20, "logits": 50 * 2**20}
    assert compare_peaks(planned, {"activations": 100 * 2**20, "logits": 49 * 2**20})[0]
    ok, verdict = compare_peaks(planned, {"activations": 90 * 2**20, "logits": 51 * 2**20})
    assert not ok and "ABOVE the plan: logits" in verdict
    # the plan row as gpu_check builds it: state and step within, but the logits above their own term
    point = path.PlanPoint(2, None, planned_state=1000, planned_step=150 * 2**20, measured_state=900,
                           measured_step=140 * 2**20, planned_logits=50 * 2**20, measured_logits=60 * 2**20)
    measured: list = []
    row = path.plan_row("plan mb2", point, measured)
    assert not row.ok and "ABOVE the plan: logits" in row.detail
    assert [(t.term, t.planned_bytes, t.measured_bytes) for t in measured] == [
        ("activations", 100 * 2**20, 80 * 2**20), ("logits", 50 * 2**20, 60 * 2**20)]
    fine = path.PlanPoint(2, None, 1000, 150 * 2**20, 900, 140 * 2**20, 50 * 2**20, 40 * 2**20)
    assert path.plan_row("plan mb2", fine, []).ok


def test_the_measured_terms_file_is_what_a_launch_reads(tmp_path):
    import tools.gpu_check as gpu_check

    terms = [measured_peaks.MeasuredTerm("local", "activations", 100, 103),
             measured_peaks.MeasuredTerm("local", "logits", 50, 40)]
    rows = []
    gpu_check.write_measured(str(tmp_path / "none.json"), [], rows)  # the CPU measured nothing: no file
    assert rows[0].skipped and not (tmp_path / "none.json").exists()
    measured_peaks.write(tmp_path / "peaks.json", terms, device="test")
    loaded = measured_peaks.load(tmp_path / "peaks.json")
    assert loaded.margin("local", "activations") == pytest.approx(0.03 + measured_peaks.MEASURED_MARGIN)
    assert loaded.margin("local", "logits") == measured_peaks.MEASURED_MARGIN
    assert loaded.margin("transformer_engine", "logits") == measured_peaks.UNMEASURED_MARGIN
    assert json.loads((tmp_path / "peaks.json").read_text())["device"] == "test"


def test_the_train_row_fails_below_its_mfu_floor():
    assert mfu_verdict(MFU_FLOOR * 3)[0]
    ok, verdict = mfu_verdict(MFU_FLOOR / 2)
    assert not ok and "below the floor" in verdict
    assert not mfu_verdict(float("nan"))[0]


def test_a_gpu_test_run_passes_only_when_all_its_tests_passed():
    assert pytest_verdict(0, "..\n2 passed in 3.1s\n", expected=2) == (True, "2 passed")
    assert pytest_verdict(1, "F.\n1 failed, 1 passed in 3.1s\n", expected=2)[0] is False
    assert pytest_verdict(0, "ss\n2 skipped in 0.1s\n", expected=2)[0] is None  # a skip, never a pass
    assert pytest_verdict(0, ".s\n1 passed, 1 skipped in 0.1s\n", expected=2)[0] is False
    assert pytest_verdict(2, "interrupted: 1 error\n", expected=2)[0] is False


def test_the_server_row_fails_when_the_push_did_not_land_or_the_probe_is_blind():
    from tools.gpu_check_compare import PROBE_TOLERANCE, push_verdict

    assert push_verdict(0.8, 2e-5, PROBE_TOLERANCE)[0]
    ok, verdict = push_verdict(0.8, 0.8, PROBE_TOLERANCE)  # the server kept its old weights
    assert not ok and "does not serve the pushed weights" in verdict
    ok, verdict = push_verdict(1e-5, 1e-5, PROBE_TOLERANCE)  # old and new weights indistinguishable by the probe
    assert not ok and "cannot tell" in verdict
    assert not push_verdict(0.8, float("nan"), PROBE_TOLERANCE)[0]


@pytest.mark.slow  # the reshard row starts a torchrun world
def test_the_offload_checkpoint_and_reshard_rows_fail_on_a_flipped_bit(tmp_path, monkeypatch, distributed):
    """The rows themselves on the CPU (gpu_check --dry-run's model), once as they are and once with one element of
    one weight moved by one ulp where the row's hand-off would have done it."""
    import megamu.training
    import tools.gpu_check as gpu_check
    from megamu.model import unwrap

    def flip(model) -> None:
        p = next(unwrap(model).parameters())
        with torch.no_grad():
            p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(float("inf"), dtype=p.dtype))

    args = gpu_check.parse_args(["--dry-run"])
    model, arch, opt = gpu_check.build(args, False)
    assert gpu_check.check_train(args, False, model, arch, opt).ok  # Adam state for the rows below
    assert gpu_check.check_offload(False, model, opt, tmp_path / "spill").ok
    reload = opt.reload
    monkeypatch.setattr(opt, "reload", lambda: (reload(), flip(model)))
    row = gpu_check.check_offload(False, model, opt, tmp_path / "spill2")
    assert not row.ok and "differ (1)" in row.result
    monkeypatch.undo()

    assert gpu_check.check_checkpoint(args, False, model, arch, opt, tmp_path / "ckpt").ok
    load = megamu.training.load_checkpoint

    def bad_load(folder, fresh, *rest):
        out = load(folder, fresh, *rest)
        flip(fresh)
        return out

    monkeypatch.setattr(megamu.training, "load_checkpoint", bad_load)
    row = gpu_check.check_checkpoint(args, False, model, arch, opt, tmp_path / "ckpt2")
    assert not row.ok and "differ (1)" in row.detail
    monkeypatch.undo()

    saved = dict(args.saved_weights)
    name = next(iter(saved))
    wrong = saved[name].clone()
    wrong.view(-1)[0] += 1.0
    args.saved_weights = {**saved, name: wrong}  # the TP 2 load against a tensor the save never held
    (tmp_path / "ckpt").rename(tmp_path / "ckpt-keep")
    (tmp_path / "ckpt2").rename(tmp_path / "ckpt")
    row = gpu_check.check_reshard(args, tmp_path)
    assert not row.ok and f"differ (1): ['{name}']" in row.result
