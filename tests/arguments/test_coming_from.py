"""docs/coming-from-slime-verl.md stays true: its megamu launches (slime's run-qwen3-4B.sh as written, verl's GSM8K
GRPO recipe translated) pass pretrain_mu_grpo.py --dry-run on the models' public configs (tests/fixtures/hf) and fit
the memory plan on 8 x H200; slime's flags are the script's own, and every flag or key of both scripts has its row in
the page's tables."""

import os
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "coming-from-slime-verl.md"
HF = REPO / "tests" / "fixtures" / "hf"
MODELS = {"/root/Qwen3-4B": HF / "Qwen3-4B", "Qwen/Qwen2-7B-Instruct": HF / "Qwen2-7B-Instruct"}

def blocks() -> dict[str, str]:
    """The page's code blocks: the dry-run ones by their marker's name, the others as "source 1", "source 2"."""
    text = PAGE.read_text()
    out, n = {}, 0
    for m in re.finditer(r"(?:<!-- dry-run: (.+?) \(.*?\) -->\n)?```bash\n(.*?)```", text, re.S):
        if m.group(1):
            out[m.group(1)] = m.group(2)
        else:
            n += 1
            out[f"source {n}"] = m.group(2)
    return out


def words(block: str) -> list[str]:
    return shlex.split(block.replace("\\\n", " "))


def after(argv: list[str], program: str) -> list[str]:
    return argv[argv.index(program) + 1:]


def dry_run(block: str, tmp_path, monkeypatch, capsys) -> str:
    """The block's pretrain_mu_grpo.py flags as torchrun would start them, model paths on the fixtures, run and
    checkpoint folders in tmp_path; returns what rank 0 prints."""
    import pretrain_mu_grpo

    argv = words(block)
    launcher = argv[:argv.index("pretrain_mu_grpo.py")]
    per_node = int(launcher[launcher.index("--nproc_per_node") + 1])
    nodes = int(launcher[launcher.index("--nnodes") + 1]) if "--nnodes" in launcher else 1
    monkeypatch.setenv("WORLD_SIZE", str(per_node * nodes))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    monkeypatch.setenv("RANK", "0")
    flags = after(argv, "pretrain_mu_grpo.py")
    for flag in ("--hf-checkpoint", "--save", "--load"):
        if flag in flags:
            i = flags.index(flag) + 1
            flags[i] = str(MODELS[flags[i]]) if flag == "--hf-checkpoint" else str(tmp_path / flag.strip("-"))
    pretrain_mu_grpo.main([*flags, "--dry-run"])  # exits with the error if a flag or the memory plan is refused
    return capsys.readouterr().out


def phase_totals(out: str) -> dict[str, str]:
    """Each memory-plan phase's total line (after the plan's header: a phase name, its rows, its total)."""
    totals, phase = {}, None
    table = out[out.index("memory plan per GPU"):].splitlines()[1:]
    for line in table:
        if re.match(r"^  total\s+[\d.]+\s+/", line):
            totals[phase] = line
        elif line and not line.startswith(" "):
            phase = line
    return totals


@pytest.mark.parametrize("name", ["slime Qwen3-4B", "verl Qwen2-7B GSM8K"])
def test_the_pages_launches_pass_the_dry_run_and_fit_eight_h200(name, tmp_path, monkeypatch, capsys):
    out = dry_run(blocks()[name], tmp_path, monkeypatch, capsys)
    assert "memory plan per GPU (GiB; device 140.4 GiB (H200: 143771 MiB in nvidia-smi); trainer TP" in out
    totals = phase_totals(out)
    assert {"training", "rollout (colocated)", "push (colocated refresh)"} <= set(totals)
    assert all(t.endswith("fits") for t in totals.values()), totals
    if name.startswith("slime"):  # slime's script as written: slime's GRPO, in bf16
        assert "without --algorithm -> --algorithm grpo: slime's GRPO, ratio clipped to [0.8, 1.28]" in out
        assert "note: precision: bf16, as slime trains unless told --fp16" in out


def test_slimes_flags_are_the_scripts_own(tmp_path):
    """The megamu command is slime's train.py flags as written, nothing added (bf16 and slime's GRPO are what they
    mean there): the flags of scripts/run-qwen3-4B.sh and scripts/models/qwen3-4B.sh (THUDM/slime 624b824), in the
    script's order."""
    page = blocks()
    slime = after(words(page["source 1"]), "train.py")
    megamu = after(words(page["slime Qwen3-4B"]), "pretrain_mu_grpo.py")
    assert megamu == slime
    assert slime[:3] == ["--actor-num-nodes", "1", "--actor-num-gpus-per-node"] and "--qk-layernorm" in slime


# scripts/models/qwen3-4B.sh's MODEL_ARGS: one row of the table ("model flags (--swiglu ... --qk-layernorm)")
MODEL_ROW = {"--swiglu", "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
             "--group-query-attention", "--num-query-groups", "--use-rotary-position-embeddings",
             "--disable-bias-linear", "--normalization", "--norm-epsilon", "--rotary-base", "--vocab-size",
             "--kv-channels", "--qk-layernorm"}


def test_every_flag_and_key_has_its_row_in_the_tables():
    text = PAGE.read_text()
    slime_table = text.split("| slime flag | megamu |")[1].split("## verl")[0]
    verl_table = text.split("| verl key | megamu |")[1]
    slime_flags = {w for w in after(words(blocks()["source 1"]), "train.py") if w.startswith("--")}
    assert MODEL_ROW <= slime_flags
    missing = [f for f in slime_flags - MODEL_ROW if not re.search(rf"[`| ]{re.escape(f)}[ `/]", slime_table)]
    assert not missing, missing
    keys = [w.split("=")[0].rsplit(".", 1)[-1] for w in words(blocks()["source 2"]) if "=" in w]
    assert len(keys) == 37  # the recipe's overrides, each with its row
    assert not [k for k in keys if k not in verl_table]


def test_the_page_dry_runs_what_this_test_reads():
    assert set(blocks()) == {"source 1", "slime Qwen3-4B", "source 2", "verl Qwen2-7B GSM8K", "source 3",
                             "verl Qwen2.5-32B DAPO"}  # the DAPO pair: tests/arguments/test_coming_from_dapo.py
    assert os.path.isfile(MODELS["/root/Qwen3-4B"] / "config.json")


def test_the_readmes_dry_run_prints_what_the_readme_says(tmp_path, monkeypatch, capsys):
    """The README's dry run: its plan for 8 x H200 (bf16, as slime trains), 42.4 GiB while training and 99.5 GiB
    during rollout."""
    import pretrain_mu_grpo

    readme = (REPO / "README.md").read_text()
    command = re.search(r"```bash\n(\.venv/bin/python pretrain_mu_grpo\.py --dry-run .*?)```", readme, re.S).group(1)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    pretrain_mu_grpo.main([*after(words(command), "pretrain_mu_grpo.py"), "--save", str(tmp_path / "run")])
    totals = phase_totals(capsys.readouterr().out)
    assert ("42.4 GiB while training (2.8 of them the margin for the counts no GPU has measured) and 99.5 GiB during "
            "rollout") in readme.replace("\n", " ")
    assert totals["training"].split()[1] == "42.39" and totals["rollout (colocated)"].split()[1] == "99.48"
    assert all(t.endswith("fits") for t in totals.values())
