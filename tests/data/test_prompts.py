import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megamu.data import (
    DEFAULT_INSTRUCTION,
    DEMO_FEW_SHOT,
    DEMO_INSTRUCTION,
    PromptDataError,
    addition_problems,
    load_prompts,
)

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_rows_with_instruction_and_chat_template(tmp_path, tok):
    rows = [{"problem": "What is 1 + 1?", "answer": 2}, {"problem": "Say hi", "answer": "hi"}]
    f = _jsonl(tmp_path / "p.jsonl", rows)
    recs = load_prompts([f], tok)
    assert [r.prompt_id for r in recs] == [0, 1]
    assert recs[0].answer == "2" and recs[0].problem == "What is 1 + 1?"
    expected = f"<|im_start|>user\nWhat is 1 + 1? {DEFAULT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(recs[0].prompt_ids) == expected


def test_few_shot_turn_comes_first(tmp_path, tok):
    f = _jsonl(tmp_path / "p.jsonl", addition_problems(1, seed=0))
    rec = load_prompts([f], tok, instruction=DEMO_INSTRUCTION, few_shot=DEMO_FEW_SHOT)[0]
    (user, assistant), = DEMO_FEW_SHOT
    assert tok.decode(rec.prompt_ids) == (
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"
        f"<|im_start|>user\n{rec.problem} {DEMO_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_verl_parquet_and_custom_keys(tmp_path, tok):
    table = pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": "Compute 3*3. Put it in \\boxed{}."}],
         "reward_model": {"ground_truth": "9", "style": "rule"}, "data_source": "x"},
    ])
    pq.write_table(table, tmp_path / "verl.parquet")
    rec = load_prompts([str(tmp_path / "verl.parquet")], tok)[0]
    assert rec.answer == "9"
    assert tok.decode(rec.prompt_ids) == (
        "<|im_start|>user\nCompute 3*3. Put it in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )
    pq.write_table(pa.Table.from_pylist([{"question": "Q?", "final": "5"}]), tmp_path / "k.parquet")
    rec, = load_prompts([str(tmp_path / "k.parquet")], tok, prompt_key="question", answer_key="final", instruction="")
    assert (rec.problem, rec.answer) == ("Q?", "5")
    assert tok.decode(rec.prompt_ids) == "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"


def test_bad_rows_name_file_and_row(tmp_path, tok):
    f = _jsonl(tmp_path / "bad.jsonl", [
        {"problem": "ok", "answer": "1"},
        {"problem": "no answer"},
        "{not json",
        {"problem": "x" * 500, "answer": "1"},
        {"question": "wrong key", "answer": "1"},
    ])
    with pytest.raises(PromptDataError) as e:
        load_prompts([f], tok, max_prompt_length=200)
    msg = str(e.value)
    assert "4 bad prompt row(s)" in msg
    for row, why in [(2, "'answer'"), (3, "invalid JSON"), (4, "longer|over --max-prompt-length"), (5, "'problem'")]:
        assert re.search(rf"{re.escape(f)}: row {row}: .*({why})", msg), (row, msg)
    with pytest.warns(UserWarning, match="skipped 4 bad prompt row"):
        recs = load_prompts([f], tok, max_prompt_length=200, skip_bad_rows=True)
    assert [r.problem for r in recs] == ["ok"]
    with pytest.raises(PromptDataError, match="no such prompt file"):
        load_prompts([str(tmp_path / "missing.jsonl")], tok)


def test_every_shared_data_file_loads(tmp_path, tok):
    if not DATA.exists():
        pytest.skip(f"shared data {DATA} not present")
    for f in sorted(DATA.glob("*.jsonl")):
        head = tmp_path / f.name  # the first rows of each file keep the test fast; the schema is per file
        head.write_text("".join(line for _, line in zip(range(200), f.open())))
        recs = load_prompts([str(head)], tok, max_prompt_length=100_000)
        assert len(recs) == min(200, sum(1 for _ in f.open())), f
        assert all(r.answer and r.problem for r in recs)


def test_addition_problems():
    rows = addition_problems(200, seed=4)
    assert rows == addition_problems(200, seed=4) and rows != addition_problems(200, seed=5)
    for r in rows:
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", r["problem"]).groups())
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert r["answer"] == str(a + b)
    ones = addition_problems(100, seed=0, digits=1)
    assert {int(x) for r in ones for x in re.findall(r"\d+", r["problem"])} <= set(range(10))


def test_builtin_task_holds_out_every_eval_prompt_when_training_uses_fewer(tmp_path, tok):
    from megamu.arguments import parse_args
    from megamu.data.stage_prompts import Prompts

    # 1 stage x 12 updates x 4 prompts = 48 training prompts, fewer than the 100 held-out problems asked for
    cfg = parse_args(["--save", str(tmp_path / "run"), "--num-stages", "1", "--mu", "12", "--prompts-per-update", "4",
                      "--eval-prompts", "100"])
    prompts = Prompts(cfg.prompts, tok)
    assert len(prompts.held_out) == 100
    assert len(prompts.for_stage(0)) == 48
    assert not {p.problem for p in prompts.held_out} & {p.problem for p in prompts.train}


def test_a_prompt_whose_reply_would_overrun_the_context_is_a_bad_row(tmp_path, tok):
    f = _jsonl(tmp_path / "ctx.jsonl", [{"problem": "short", "answer": "1"}, {"problem": "y" * 150, "answer": "2"}])
    lengths = [len(r.prompt_ids) for r in load_prompts([f], tok, max_prompt_length=1000)]
    context = lengths[1] + 9  # row 2 fits with a 9-token reply, not with a 10-token one
    assert len(load_prompts([f], tok, context_length=context, max_response_len=9)) == 2
    with pytest.raises(PromptDataError, match=rf"row 2: prompt is {lengths[1]} tokens: with "
                                              rf"--rollout-max-response-len 10 .*context of {context}"):
        load_prompts([f], tok, context_length=context, max_response_len=10)
