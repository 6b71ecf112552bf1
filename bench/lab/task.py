"""The lab task: multi-digit addition written column by column with carries, then the answer in \\boxed{}.

A prompt is ``"4821+3907"`` (as a verl-style chat row, so the trainer adds no instruction text); the reference reply
works from the rightmost column to the left, one line per column, ``digit+digit+carry=sum``, then reads the sum back:

    1+7+0=8
    2+0+0=2
    8+9+0=17
    4+3+1=8
    \\boxed{8728}

Four-digit operands give replies of 44-49 characters (one token each with the char tokenizer), so responses have a
prefix (the column sums) and a suffix (the read-back and the box) like the paper's reasoning traces, and a wrong
answer can come from any step. The answer is an integer, so the trainer's math reward (last \\boxed{}) scores it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DIGITS = 4


def max_reply_chars(digits: int) -> int:
    """The longest reference reply for ``digits``-digit operands: ``digits`` lines ``x+y+c=ss`` (8 chars at most)
    and their newlines, then ``\\boxed{}`` around a sum of up to ``digits + 1`` digits."""
    return digits * 9 + len("\\boxed{}") + digits + 1


def solution(a: int, b: int) -> str:
    """The reference reply for ``a + b`` (both non-negative, any number of digits)."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    lines, carry = [], 0
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        s = x + y + carry
        lines.append(f"{x}+{y}+{carry}={s}")
        carry = s // 10
    return "\n".join(lines) + f"\n\\boxed{{{a + b}}}"


def problems(n: int, seed: int, digits: int = DIGITS,
             exclude: set[tuple[int, int]] = frozenset()) -> list[tuple[int, int]]:
    """``n`` distinct seeded operand pairs with exactly ``digits`` digits each, none of them in ``exclude``."""
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    if n > (hi - lo + 1) ** 2 - len(exclude):
        raise ValueError(f"cannot draw {n} distinct {digits}-digit problems")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set(exclude)
    out: list[tuple[int, int]] = []
    while len(out) < n:
        pair = (rng.randint(lo, hi), rng.randint(lo, hi))
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}"


def row(a: int, b: int) -> dict:
    """A verl-layout prompt row: the trainer renders the chat messages as they are (no instruction appended)."""
    return {"prompt": [{"role": "user", "content": prompt_text(a, b)}], "reward_model": {"ground_truth": str(a + b)}}


def write_split(out_dir: Path, n_train: int, n_held_out: int, seed: int, digits: int = DIGITS) -> tuple[Path, Path]:
    """``train.jsonl`` and ``held_out.jsonl`` under ``out_dir``; no held-out problem appears in the training file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    held = problems(n_held_out, seed + 1, digits)
    train = problems(n_train, seed, digits, exclude=set(held))
    paths = out_dir / "train.jsonl", out_dir / "held_out.jsonl"
    for path, pairs in zip(paths, (train, held)):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(row(a, b)) + "\n" for a, b in pairs))
        tmp.replace(path)
    return paths


def read_rows(path: Path) -> list[tuple[str, str]]:
    """(prompt text, gold answer) of each row of a file written by :func:`write_split`."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [(r["prompt"][-1]["content"], r["reward_model"]["ground_truth"]) for r in rows]


def boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` of ``text`` (no nesting: the lab's answers are integers), else None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = text.find("}", start)
    return text[start + len("\\boxed{"):end] if end >= 0 else None


def correct(response: str, gold: str) -> bool:
    return boxed(response) == gold
