"""The lab task, its held-out split, the lab model's build and the evaluator behind the fidelity bench."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from bench.lab import model as lab_model
from bench.lab.evaluate import _decode, _prompt_ids, accuracy, load
from bench.lab.task import boxed, correct, problems, read_rows, solution, write_split
from megamu.reward.math import math_score
from tests.tiny import save_tiny_model

TINY = lab_model.LabSpec(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, digits=4, max_steps=3, eval_every=1, probe_from=0, probe_problems=4,
                         target_accuracy=0.0)


@pytest.mark.parametrize("digits", [1, 3, 4, 6])
def test_solution_is_column_addition_that_ends_in_the_sum(digits):
    rng = random.Random(digits)
    for _ in range(50):
        a, b = rng.randint(10 ** (digits - 1), 10**digits - 1), rng.randint(0, 10**digits - 1)
        *columns, last = solution(a, b).split("\n")
        assert len(columns) == digits and last == f"\\boxed{{{a + b}}}"
        carry, written = 0, []
        for i, line in enumerate(columns):  # rightmost column first, the carry of the previous line added in
            x, y, c, s = map(int, re.fullmatch(r"(\d)\+(\d)\+(\d)=(\d+)", line).groups())
            assert (x, y, c) == (a // 10**i % 10, b // 10**i % 10, carry) and s == x + y + c
            carry = s // 10
            written.append(s % 10)
        assert int(str(carry) + "".join(map(str, reversed(written)))) == a + b


def test_replies_are_44_to_49_tokens_and_the_trainers_reward_agrees_with_the_lab_check():
    lengths = set()
    for a, b in problems(200, seed=5):
        text = solution(a, b)
        # one char token each: 4 lines "x+y+c=s" (7 chars, 8 when s >= 10), 4 newlines, "\boxed{}" and the sum
        carries = sum(int(t.split("=")[1]) >= 10 for t in text.split("\n")[:4])
        assert len(text) == 4 * 7 + carries + 4 + 8 + len(str(a + b))
        lengths.add(len(text))
        assert correct(text, str(a + b)) and math_score(text, str(a + b)) == 1.0
        wrong = text.replace(f"{{{a + b}}}", f"{{{a + b + 1}}}")
        assert not correct(wrong, str(a + b)) and math_score(wrong, str(a + b)) == 0.0
    assert min(lengths) >= 44 and max(lengths) <= 49
    assert boxed("no box") is None and boxed("\\boxed{12") is None


def test_split_is_disjoint_seeded_and_in_the_trainers_row_layout(tmp_path):
    train, held = write_split(tmp_path / "a", 300, 50, seed=3)
    again = write_split(tmp_path / "b", 300, 50, seed=3)
    assert train.read_bytes() == again[0].read_bytes() and held.read_bytes() == again[1].read_bytes()
    tr, ho = read_rows(train), read_rows(held)
    assert len(tr) == 300 and len(ho) == 50 and len(set(tr)) == 300
    assert not set(p for p, _ in tr) & set(p for p, _ in ho)
    for prompt, gold in tr + ho:
        x, y = map(int, prompt.split("+"))
        assert int(gold) == x + y and len(str(x)) == len(str(y)) == 4
    from megamu.data.prompts import load_prompts

    tok = save_tiny_model(tmp_path / "tiny", "llama")
    from transformers import AutoTokenizer

    records = load_prompts([str(held)], AutoTokenizer.from_pretrained(tok))
    # verl layout: the trainer appends no instruction, so its prompt ids are the evaluator's
    assert [r.answer for r in records] == [g for _, g in ho]
    assert records[0].prompt_ids == _prompt_ids(AutoTokenizer.from_pretrained(tok), ho[0][0])


def test_a_reloaded_lab_folder_keeps_one_token_per_char_including_newlines(tmp_path):
    lab_model.train(TINY, tmp_path / "m", log=lambda _: None)
    _, tok = load(tmp_path / "m")
    text = solution(4821, 3907)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text


def test_build_is_deterministic_cached_and_recorded(tmp_path):
    one = lab_model.lab_model_dir(TINY, tmp_path / "c1", log=lambda _: None)
    two = lab_model.lab_model_dir(TINY, tmp_path / "c2", log=lambda _: None)
    assert one.name == two.name == f"lab-{TINY.key()}"
    assert (one / "model.safetensors").read_bytes() == (two / "model.safetensors").read_bytes()
    record = json.loads((one / "lab_build.json").read_text())
    assert record["steps"] == 1 and record["spec"] == json.loads(json.dumps(TINY.__dict__))  # target 0: first probe
    stamp = (one / "model.safetensors").stat().st_mtime_ns
    assert lab_model.lab_model_dir(TINY, tmp_path / "c1") == one
    assert (one / "model.safetensors").stat().st_mtime_ns == stamp  # found, not rebuilt
    assert not list((tmp_path / "c1").glob(".lab-*"))  # no temporary folder left behind


def test_fine_tuning_lowers_the_loss_on_the_task(tmp_path):
    spec = lab_model.LabSpec(**{**TINY.__dict__, "max_steps": 40, "eval_every": 20, "target_accuracy": 1.0,
                                "lr": 3e-3})
    lines = []
    with pytest.raises(RuntimeError, match="sampled accuracy"):
        lab_model.train(spec, tmp_path / "m", log=lines.append)
    losses = [float(re.search(r"loss (\S+)", x).group(1)) for x in lines]
    assert len(losses) == 2 and losses[1] < losses[0]


def test_decoding_matches_transformers_generate_greedy(tmp_path):
    model, tok = load(save_tiny_model(tmp_path / "tiny", "llama", seed=1))
    prompt = torch.tensor([_prompt_ids(tok, p) for p in ("1234+5678", "9999+1111", "4321+8765")])
    ours = _decode(model, prompt, tok.eos_token_id, True, 20, torch.Generator())
    ref = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[:, prompt.shape[1]:].tolist()
    eos = tok.eos_token_id
    for o, r in zip(ours, ref):
        cut = lambda x: x[:x.index(eos) + 1] if eos in x else x  # noqa: E731 (generate pads after EOS)
        assert cut(o) == cut(r)


def test_accuracy_scores_each_reply_and_counts_truncation(tmp_path):
    model, tok = load(save_tiny_model(tmp_path / "tiny", "llama", seed=2))
    rows = [("12+34", "46"), ("1+2", "3"), ("55+55", "110")]
    got = accuracy(model, tok, rows, greedy=True, max_new_tokens=8)
    replies = []
    for p, _ in rows:  # one row at a time, through transformers: the reference
        ids = torch.tensor([_prompt_ids(tok, p)])
        out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        replies.append(out)
    stopped = [tok.eos_token_id in r for r in replies]
    assert got.n == 3 and got.truncated == pytest.approx(sum(not s for s in stopped) / 3)
    lengths = [r.index(tok.eos_token_id) if s else len(r) for r, s in zip(replies, stopped)]
    assert got.mean_length == pytest.approx(sum(lengths) / 3)
    assert got.accuracy == 0.0  # a random model boxes no sum


# The weights sha256 of TINY's build, recorded on the machine that wrote this test (AMD EPYC). A golden value on
# purpose: the build is meant to give the same float32 weights on every CPU (float64 training, issue 34), and only a
# checksum taken elsewhere can show that it does; a CPU that fails here would also be refused the pinned lab model.
TINY_SHA256 = "2daccf1201358a107e41e9ad00884a6e35b3e718ced8980dbd23321a4d118765"


def test_the_build_is_the_same_on_every_cpu(tmp_path):
    folder = lab_model.lab_model_dir(TINY, tmp_path, log=lambda _: None, pinned={TINY.key(): TINY_SHA256})
    assert json.loads((folder / "lab_build.json").read_text())["weights_sha256"] == TINY_SHA256


def test_weights_that_differ_from_the_pinned_or_recorded_checksum_are_refused(tmp_path):
    folder = lab_model.lab_model_dir(TINY, tmp_path, log=lambda _: None)
    with pytest.raises(RuntimeError, match="pinned reference build"):
        lab_model.lab_model_dir(TINY, tmp_path, pinned={TINY.key(): "0" * 64})
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3  # a cache edited (or copied from another machine) after its build
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="not the one its build recorded"):
        lab_model.lab_model_dir(TINY, tmp_path, pinned={})


def test_the_checksum_covers_names_shapes_and_bytes(tmp_path):
    from safetensors.torch import save_file

    for name, tensors in (("a", {"w": torch.ones(2, 3)}), ("b", {"v": torch.ones(2, 3)}),
                          ("c", {"w": torch.ones(3, 2)}), ("d", {"w": torch.ones(2, 3, dtype=torch.float64)})):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
    sums = {lab_model.weights_sha256(tmp_path / n) for n in "abcd"}
    assert len(sums) == 4
