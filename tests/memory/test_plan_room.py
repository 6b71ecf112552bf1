"""A plan with room (issue 50 item 2): the device is the card as nvidia-smi shows it (H200 143771 MiB, H100 81559 MiB),
and the activation and logits counts, never measured on transformer-engine's spec, carry a stated margin that a
measured-peaks file from tools/gpu_check.py shrinks. The largest token budget accepted for slime's Qwen3-4B launch
peaks at <= 139 GiB on an H200 (the issue's report: 59040 tokens planned at 140.7 GiB of a 141.0 GiB device)."""

import json
from dataclasses import replace

import pytest

from megamu.arguments import check_memory
from megamu.errors import ConfigError
from megamu.memory import measured_peaks as peaks_file
from megamu.memory.device_memory import H100_GIB, H200_GIB, parse_gpu_memory
from megamu.memory.measured_peaks import MEASURED_MARGIN, UNMEASURED_MARGIN, MeasuredTerm
from megamu.memory.memory_fixes import ROUND_TOKENS, fits, fixes
from megamu.memory.memory_plan import GIB, plan_memory
from tests.memory.test_launch_plans import SLIME_QWEN3_4B, launch, row


def largest_budget(c):
    """The largest --max-tokens-per-micro-batch megamu accepts for ``c``'s launch (the fix it names)."""
    return dict(fixes(replace(c, max_tokens_per_micro_batch=c.micro_batch_size * c.max_seq_len)))[
        "max_tokens_per_micro_batch"]


def test_the_device_is_the_card_as_nvidia_smi_shows_it():
    assert H200_GIB == pytest.approx(140.4, abs=0.05) and H200_GIB * 1024 == 143771
    assert H100_GIB * 1024 == 81559
    assert parse_gpu_memory("h200") == H200_GIB and parse_gpu_memory("H100") == H100_GIB
    assert parse_gpu_memory("80") == 80.0
    for bad in ("a100", "-3", "0"):
        with pytest.raises(ConfigError) as e:
            parse_gpu_memory(bad)
        assert e.value.field == "gpu_memory_gib" and bad in e.value.message


def test_slimes_qwen3_4b_largest_budget_peaks_below_139_gib(tmp_path, monkeypatch):
    c = launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B").config
    assert c.gpu_memory_gib == H200_GIB and c.measured_peaks is None
    budget = largest_budget(c)
    plan = plan_memory(replace(c, max_tokens_per_micro_batch=budget))
    check_memory(plan)
    act, logits = row(plan, "training", "activations, full").bytes, row(plan, "training", "logits").bytes
    margin = row(plan, "training", "margin")
    assert margin.bytes == int(UNMEASURED_MARGIN * act + UNMEASURED_MARGIN * logits)  # 15 % of each, by hand
    assert "15% of activations, 15% of logits (TE spec, not measured on a GPU)" in margin.part
    total = plan.total("training")
    assert total <= H200_GIB * GIB
    assert (total - margin.bytes) / GIB <= 139  # the counted peak leaves the margin free on the card
    # one step more is refused; the 59040 (accepted before against 141.0 GiB) is refused too
    assert not fits(replace(c, max_tokens_per_micro_batch=budget + ROUND_TOKENS))
    assert budget < 59040 and not fits(replace(c, max_tokens_per_micro_batch=59040))
    # the margin is the training phase's alone: a save holds no activations
    assert not [r for r in plan.rows() if r.phase != "training" and r.part.startswith("margin")]


def write_peaks(path, ratio_act: float, ratio_logits: float, impl: str = "transformer_engine"):
    peaks_file.write(path, [MeasuredTerm(impl, "activations", 1000, int(1000 * ratio_act)),
                            MeasuredTerm(impl, "logits", 1000, int(1000 * ratio_logits))], device="test")


def test_a_measured_peaks_file_shrinks_the_margin_or_grows_it(tmp_path, monkeypatch):
    exact, short = tmp_path / "exact.json", tmp_path / "short.json"
    write_peaks(exact, 1.0, 0.9)  # the counts held (logits over-counted: no credit below 1)
    write_peaks(short, 1.2, 1.1)  # the counts were 20 % / 10 % short
    base = launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B").config
    measured = launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B", "--measured-peaks", str(exact)).config
    worse = launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B", "--measured-peaks", str(short)).config
    b0, b1, b2 = largest_budget(base), largest_budget(measured), largest_budget(worse)
    assert b2 < b0 < b1
    plan = plan_memory(replace(measured, max_tokens_per_micro_batch=b1))
    act, logits = row(plan, "training", "activations, full").bytes, row(plan, "training", "logits").bytes
    margin = row(plan, "training", "margin")
    assert margin.bytes == int(MEASURED_MARGIN * act + MEASURED_MARGIN * logits)
    assert "(TE spec, as measured)" in margin.part
    assert (plan.total("training") - margin.bytes) / GIB <= 139
    plan = plan_memory(replace(worse, max_tokens_per_micro_batch=b2))
    a2, l2 = row(plan, "training", "activations, full").bytes, row(plan, "training", "logits").bytes
    assert row(plan, "training", "margin").bytes == int((0.2 + MEASURED_MARGIN) * a2 + (0.1 + MEASURED_MARGIN) * l2)


def test_a_measurement_of_the_local_spec_leaves_te_unmeasured(tmp_path, monkeypatch):
    local = tmp_path / "local.json"
    write_peaks(local, 1.0, 1.0, impl="local")
    te = launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B", "--measured-peaks", str(local))
    assert "15% of activations, 15% of logits (TE spec, not measured" in row(te, "training", "margin").part
    lo = launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B", "--measured-peaks", str(local),
                "--transformer-impl", "local")
    assert "5% of activations, 5% of logits (local spec, as measured)" in row(lo, "training", "margin").part


def test_an_h100_plans_against_its_81559_mib(tmp_path, monkeypatch):
    h100 = launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B", "--gpu-memory-gib", "h100")
    assert h100.config.gpu_memory_gib == H100_GIB
    assert "device 79.6 GiB (H100: 81559 MiB in nvidia-smi)" in h100.table()
    budget = largest_budget(h100.config)
    assert budget < largest_budget(launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B").config)
    assert plan_memory(replace(h100.config, max_tokens_per_micro_batch=budget)).total("training") <= H100_GIB * GIB


@pytest.mark.parametrize("content, said", [
    ("not json", "cannot read"), (json.dumps({"terms": []}), "no 'terms' list"),
    (json.dumps({"terms": [{"transformer_impl": "te", "term": "logits", "planned_bytes": 1, "measured_bytes": 1}]}),
     "terms[0]: transformer_impl 'te'"),
    (json.dumps({"terms": [{"transformer_impl": "local", "term": "logits", "planned_bytes": 0,
                            "measured_bytes": 1}]}), "terms[0]: planned_bytes and measured_bytes"),
])
def test_a_bad_measured_peaks_file_is_refused_naming_flag_file_and_entry(tmp_path, monkeypatch, content, said):
    bad = tmp_path / "peaks.json"
    bad.write_text(content)
    with pytest.raises(SystemExit) as e:
        launch(tmp_path, monkeypatch, SLIME_QWEN3_4B, "Qwen3-4B", "--measured-peaks", str(bad))
    err = str(e.value)
    assert "--measured-peaks" in err and str(bad) in err and said in err
