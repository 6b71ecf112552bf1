"""Code prompt rows: tests as the answer (JSON object or verl JSON string), code instruction, bad rows reported."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megamu.data import PromptDataError, load_prompts
from megamu.data.code_task import code_problems
from megamu.data.prompts import CODE_INSTRUCTION, DEFAULT_INSTRUCTION
from megamu.tiny import build_char_tokenizer

STDIO = {"inputs": ["1\n"], "outputs": ["2\n"]}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_code_rows_carry_their_tests_as_json_and_get_the_code_instruction(tmp_path, tok):
    rows = [{"problem": "Print n + 1.", "tests": STDIO}, {"problem": "What is 1 + 1?", "tests": "2"}]
    recs = load_prompts([_jsonl(tmp_path / "c.jsonl", rows)], tok, answer_key="tests")
    assert json.loads(recs[0].answer) == STDIO
    assert tok.decode(recs[0].prompt_ids) == (
        f"<|im_start|>user\nPrint n + 1.\n\n{CODE_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    # a plain answer is still a math row, unchanged
    assert recs[1].answer == "2" and DEFAULT_INSTRUCTION in tok.decode(recs[1].prompt_ids)


def test_verl_parquet_with_json_ground_truth(tmp_path, tok):
    table = pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "Solve it in Python."}],
                                   "reward_model": {"ground_truth": json.dumps(STDIO), "style": "rule"}}])
    pq.write_table(table, tmp_path / "code.parquet")
    rec, = load_prompts([str(tmp_path / "code.parquet")], tok)
    assert json.loads(rec.answer) == STDIO


def test_bad_code_rows_name_file_and_row(tmp_path, tok):
    f = _jsonl(tmp_path / "bad.jsonl", [
        {"problem": "ok", "tests": STDIO},
        {"problem": "mismatch", "tests": {"inputs": ["1"], "outputs": []}},
        {"problem": "no check target", "tests": {"test": "def check(candidate):\n    assert candidate(1)"}},
        {"problem": "bad json", "tests": "{\"inputs\": [1], \"outputs\": [\"1\"]}"},
    ])
    with pytest.raises(PromptDataError) as e:
        load_prompts([f], tok, answer_key="tests")
    msg = str(e.value)
    assert "3 bad prompt row(s)" in msg
    assert f"{f}: row 2: 1 inputs but 0 outputs" in msg
    assert f"{f}: row 3:" in msg and "entry_point" in msg
    assert f"{f}: row 4:" in msg and "string" in msg
    with pytest.warns(UserWarning, match="skipped 3 bad prompt row"):
        assert len(load_prompts([f], tok, answer_key="tests", skip_bad_rows=True)) == 1


def test_shipped_code_task_loads(tmp_path, tok):
    rows = code_problems(6, seed=1)
    recs = load_prompts([_jsonl(tmp_path / "task.jsonl", rows)], tok, answer_key="tests")
    assert [json.loads(r.answer) for r in recs] == [r["tests"] for r in rows]
