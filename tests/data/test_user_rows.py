"""Issue #33, item 3: verl's and slime's rows read as their users write them; JSON arrays; instruction and template
flags. The references are the rows themselves and the tokenizer's own chat template."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megamu.arguments import parse_args
from megamu.data import DEFAULT_INSTRUCTION, PromptDataError, load_prompts
from megamu.reward.signatures import RowMeta

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # tests.tiny's char tokenizer's template

VERL_ROW = {  # verl's examples/data_preprocess/gsm8k.py layout
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "Natalia sold 48 clips. Let's think step by step."}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "72"},
    "extra_info": {"split": "train", "index": 3},
}


def test_verl_rows_with_verls_own_prompt_key(tmp_path, tok):
    """verl's data.prompt_key=prompt: the column is present and holds messages; data_source and extra_info reach the
    reward."""
    pq.write_table(pa.Table.from_pylist([VERL_ROW]), tmp_path / "train.parquet")
    for key in ("prompt", "problem"):  # given as verl writes it, or left at megamu's default
        rec, = load_prompts([str(tmp_path / "train.parquet")], tok, prompt_key=key)
        assert rec.answer == "72"
        assert tok.decode(rec.prompt_ids) == CHAT.format(VERL_ROW["prompt"][0]["content"])
        assert rec.meta == RowMeta("openai/gsm8k", {"split": "train", "index": 3}, VERL_ROW["prompt"][0]["content"])


def test_slime_message_rows_with_input_and_label_keys(tmp_path, tok):
    """slime: --input-key prompt --label-key label --apply-chat-template, rows of messages, a metadata column."""
    row = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
           "label": "4", "metadata": {"level": 1}}
    f = tmp_path / "dapo.jsonl"
    f.write_text(json.dumps(row) + "\n")
    cfg = parse_args(["--prompt-data", str(f), "--input-key", "prompt", "--label-key", "label",
                      "--apply-chat-template", "--save", str(tmp_path / "run"), "--dry-run"])
    assert (cfg.prompts.prompt_key, cfg.prompts.answer_key, cfg.prompts.chat_template) == ("prompt", "label", True)
    rec, = load_prompts([str(f)], tok, prompt_key="prompt", answer_key="label", chat_template=True)
    want = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    assert tok.decode(rec.prompt_ids) == want and rec.answer == "4"
    assert rec.meta.extra_info == {"level": 1} and rec.problem == "2+2?"


def test_a_json_array_file_is_rows_not_json_lines(tmp_path, tok):
    rows = [{"problem": "1+1?", "answer": 2}, {"problem": "2+3?", "answer": "5"}]
    f = tmp_path / "rows.json"
    f.write_text(json.dumps(rows, indent=2))
    assert [(r.problem, r.answer) for r in load_prompts([str(f)], tok)] == [("1+1?", "2"), ("2+3?", "5")]
    (tmp_path / "bad.json").write_text('[{"problem": "x", "answer": 1},')
    with pytest.raises(PromptDataError, match="bad.json: invalid JSON array"):
        load_prompts([str(tmp_path / "bad.json")], tok)
    (tmp_path / "mixed.json").write_text('[{"problem": "x", "answer": 1}, 3]')
    with pytest.raises(PromptDataError, match="mixed.json: row 2: expected a JSON object, got int"):
        load_prompts([str(tmp_path / "mixed.json")], tok)


def test_instruction_and_chat_template_flags(tmp_path, tok):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"problem": "3*3?", "answer": 9}) + "\n")
    default, = load_prompts([str(f)], tok)
    assert tok.decode(default.prompt_ids) == CHAT.format(f"3*3? {DEFAULT_INSTRUCTION}")
    own, = load_prompts([str(f)], tok, instruction="Answer in one word.")
    assert tok.decode(own.prompt_ids) == CHAT.format("3*3? Answer in one word.")
    raw, = load_prompts([str(f)], tok, instruction="", chat_template=False)
    assert tok.decode(raw.prompt_ids) == "3*3?"
    cfg = parse_args(["--prompt-data", str(f), "--instruction", "", "--no-apply-chat-template", "--save",
                      str(tmp_path / "run"), "--dry-run"])
    assert (cfg.prompts.instruction, cfg.prompts.chat_template) == ("", False)


def test_a_row_without_an_answer_names_both_keys(tmp_path, tok):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "solution": "x"}) + "\n")
    with pytest.raises(PromptDataError, match="row 1: missing or empty 'answer' and no 'reward_model.ground_truth'"):
        load_prompts([str(f)], tok)


def test_asking_for_a_chat_template_the_tokenizer_lacks_is_an_error(tmp_path, tok):
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = None
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"problem": "1+1?", "answer": 2}) + "\n")
    with pytest.raises(PromptDataError, match="--apply-chat-template: the tokenizer .* has no chat template"):
        load_prompts([str(f)], plain, chat_template=True)
    rec, = load_prompts([str(f)], plain, instruction="")  # by default: plain text, as before
    assert plain.decode(rec.prompt_ids, skip_special_tokens=True) == "1+1?"
