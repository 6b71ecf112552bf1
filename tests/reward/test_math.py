import json
import random
import time
from pathlib import Path

import pytest

from megamu.reward import extract_boxed, math_score, score_batch

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{a{b{c}}d}", "a{b{c}}d"),
        ("answer: \\boxed 7 done", "7"),
        ("\\boxed{3} and cut \\boxed{\\frac{1", None),
        ("no box here", None),
        ("\\boxed", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "response,truth,score",
    [
        ("The answer is \\boxed{18}.", "18", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
        ("\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("\\boxed{17}", "18", 0.0),
        ("18", "18", 0.0),  # no box, no reward
        ("\\boxed{}", "18", 0.0),
    ],
)
def test_math_score(response, truth, score):
    assert math_score(response, truth) == score


def _rows(name):
    path = DATA / name
    if not path.exists():
        pytest.skip(f"shared data {path} not present")
    return [json.loads(line) for line in path.open()]


def test_gold_answers_verify_and_shuffled_do_not():
    # all of MATH-500's LaTeX forms and AIME's; GSM8K's answers are plain integers, so 200 of its 1319 say as much
    rows = _rows("math500.jsonl") + _rows("aime24.jsonl") + _rows("gsm8k_test.jsonl")[:200]
    answers = [r["answer"] for r in rows]
    gold = [f"Thus the result is $\\boxed{{{a}}}$." for a in answers]
    shuffled = answers[:]
    random.Random(0).shuffle(shuffled)
    pairs = [(a, b) for a, b in zip(answers, shuffled) if a.replace(" ", "") != b.replace(" ", "")]
    responses = gold + [f"\\boxed{{{b}}}" for _, b in pairs]
    truths = answers + [a for a, _ in pairs]
    # math_score as the trainer uses it, and math-verify alone (no exact-match shortcut) on the same items.
    for reward_fn in ("megamu.reward.math:math_score", "tests.reward.hooks:verify_only"):
        scores = score_batch(responses, truths, timeout_s=10.0, num_workers=2, reward_fn=reward_fn)
        gold_rate = sum(scores[: len(rows)]) / len(rows)
        wrong_rate = sum(scores[len(rows) :]) / len(pairs)
        assert gold_rate >= 0.99, (reward_fn, gold_rate)
        assert wrong_rate <= 0.01, (reward_fn, wrong_rate)


def test_pathological_outputs_score_zero_within_timeout():
    cases = [
        "x" * 1_000_000 + "\\boxed{5}" * 0,  # 1 MB of text, no box
        "y" * 1_000_000 + "\\boxed{5",  # 1 MB, unbalanced at the end
        "\\boxed{" * 5000 + "5",  # unbalanced braces
        "}" * 10000 + "\\boxed{5}}}}",  # stray closing braces, wrong answer
        "\\boxed{" + "\\frac{1}{" * 400 + "2" + "}" * 400 + "}",  # deeply nested LaTeX
        "\\boxed{" + "(" * 300 + "1" + ")" * 300 + "+" + "x^{" * 200 + "2" + "}" * 200 + "}",
        "\\boxed{7}" * 20000,  # thousands of boxes, wrong answer
        "\\boxed{" + "9" * 5000 + "}",
    ]
    timeout = 3.0
    t0 = time.monotonic()
    scores = score_batch(cases, ["4"] * len(cases), timeout_s=timeout, num_workers=2)
    assert scores == [0.0] * len(cases)
    # Every item ends by its own deadline; two workers share the items.
    assert time.monotonic() - t0 < timeout * len(cases) / 2 + 10
