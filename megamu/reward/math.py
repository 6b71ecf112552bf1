"""Math answer reward: the last \\boxed{...} of a response, checked against the gold answer with math-verify.

math-verify's own timeouts use SIGALRM, so call ``math_score`` in a worker process (see ``megamu.reward.pool``),
never from a thread.
"""

from __future__ import annotations

import re

# Gold answers of the math benchmarks are far shorter; longer "answers" only cost sympy time and are never right.
MAX_ANSWER_CHARS = 1000


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested and escaped braces handled), or of ``\\boxed x``; None if absent
    or if the last box is unbalanced (a reply cut off mid-answer)."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = start + len("\\boxed")
    n = len(text)
    while i < n and text[i] == " ":
        i += 1
    if i >= n:
        return None
    if text[i] != "{":
        # "\boxed 5": the token up to the next space or math delimiter.
        end = i
        while end < n and text[end] not in " \n\t$":
            end += 1
        return text[i:end] or None
    depth, j = 0, i
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2  # \{ and \} are literal braces
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


def _normalize(s: str) -> str:
    return "".join(s.split()).strip("$").rstrip(".")


def verify_answer(pred: str, ground_truth: str) -> bool:
    """math-verify equivalence of a predicted answer string and the gold answer string (both LaTeX fragments)."""
    from math_verify import parse, verify

    gold = parse("\\boxed{" + ground_truth + "}") or parse("$" + ground_truth + "$")
    target = parse("\\boxed{" + pred + "}")
    if not gold or not target:
        return False
    return bool(verify(gold, target))


def math_score(response: str, ground_truth: str) -> float:
    """1.0 when the last \\boxed{} of ``response`` equals ``ground_truth`` (exactly or per math-verify), else 0.0."""
    pred = extract_boxed(response)
    if pred is None or not pred.strip() or len(pred) > MAX_ANSWER_CHARS:
        return 0.0
    if _normalize(pred) == _normalize(ground_truth):
        return 1.0
    try:
        return 1.0 if verify_answer(pred, ground_truth) else 0.0
    except Exception:  # noqa: BLE001 - a reward must never take the run down; unparseable means wrong
        return 0.0


GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_answer(text: str) -> str | None:
    """The number after the first ``#### `` (GSM8K's answer line), commas and ``$`` removed, a sentence's final period
    dropped; None without one. The rule of verl's ``extract_solution(method="strict")``
    (verl/utils/reward_score/gsm8k.py), which also checks the reply's format; the period is megamu's addition."""
    m = GSM8K_ANSWER.search(text)
    if m is None:
        return None
    return m.group(1).replace(",", "").replace("$", "").rstrip(".") or None


def gsm8k_score(response: str, ground_truth: str) -> float:
    """1.0 when the reply's ``#### N`` answer is the ground truth's number (a bare number, or GSM8K's full solution
    ending in ``#### N``), else 0.0 (verl's gsm8k ``compute_score`` with format_score 0)."""
    answer = gsm8k_answer(response)
    truth = gsm8k_answer(ground_truth) if "####" in ground_truth else ground_truth.strip().replace(",", "")
    return 1.0 if answer is not None and answer == truth else 0.0


def deepscaler_score(response: str, ground_truth: str) -> float:
    """slime's ``--rm-type deepscaler`` (THUDM/slime slime/rollout/rm_hub/deepscaler.py,
    ``get_deepscaler_rule_based_reward``): only the text after the last ``</think>`` (else after the first
    ``###Response``) is graded, and a reply with neither scores 0. The grading is ``math_score``'s (the last
    \\boxed{} vs the answer, math-verify) where slime's uses its mathd / sympy checks."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    return math_score(solution, str(ground_truth))
