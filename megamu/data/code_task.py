"""Seeded short coding problems with tests: the code reward's CPU task (shipped, so tests need no download).

Half are function-writing problems with assert tests (HumanEval style), half read stdin and print (code_contests
style). Expected values come from a reference implementation run here, so every row is correct by construction;
``reference_solution`` gives a fenced solution that passes, for tests of the reward itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class _Function:
    name: str
    doc: str  # with {k} for the problem's constant
    signature: str
    body: str  # reference body, with {k}
    ref: Callable  # (k, *args) -> result
    arg: Callable  # rng -> args tuple


FUNCTIONS = [
    _Function("add_k", "returns x plus {k}", "x: int", "return x + {k}", lambda k, x: x + k,
              lambda r: (r.randint(-50, 50),)),
    _Function("count_multiples", "returns how many numbers in xs are multiples of {k}", "xs: list",
              "return sum(1 for v in xs if v % {k} == 0)", lambda k, xs: sum(1 for v in xs if v % k == 0),
              lambda r: ([r.randint(0, 30) for _ in range(r.randint(0, 6))],)),
    _Function("repeat_word", "returns the string s repeated {k} times", "s: str", "return s * {k}",
              lambda k, s: s * k, lambda r: ("".join(r.choice("abc") for _ in range(r.randint(0, 3))),)),
    _Function("max_plus_k", "returns the largest number of the non-empty list xs plus {k}", "xs: list",
              "return max(xs) + {k}", lambda k, xs: max(xs) + k,
              lambda r: ([r.randint(-20, 20) for _ in range(r.randint(1, 5))],)),
]

STDIO = [
    ("Read integers a and b (one line, separated by a space) and print a * b + {k}.",
     "a, b = map(int, input().split())\nprint(a * b + {k})", lambda k, r: (r.randint(-9, 9), r.randint(-9, 9)),
     lambda k, a, b: a * b + k, lambda a, b: f"{a} {b}\n"),
    ("Read a line of lowercase letters and print how many times the letter 'a' occurs in it, plus {k}.",
     "print(input().count('a') + {k})", lambda k, r: ("".join(r.choice("abc") for _ in range(r.randint(1, 8))),),
     lambda k, s: s.count("a") + k, lambda s: f"{s}\n"),
]

NUM_CASES = 3


def code_problems(n: int, seed: int) -> list[dict]:
    """``n`` rows {"problem", "tests", "solution"} (tests as in ``megamu.reward.code_tests``; solution: reference
    code). The constant k and the test arguments are drawn from ``seed``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(1, 9)
        if i % 2 == 0:
            f = FUNCTIONS[rng.randrange(len(FUNCTIONS))]
            args = [f.arg(rng) for _ in range(NUM_CASES)]
            asserts = "\n".join(f"    assert candidate({', '.join(map(repr, a))}) == {f.ref(k, *a)!r}" for a in args)
            rows.append({
                "problem": f"Write a Python function `{f.name}({f.signature})` that {f.doc.format(k=k)}.",
                "tests": {"test": f"def check(candidate):\n{asserts}\n", "entry_point": f.name},
                "solution": f"def {f.name}({f.signature}):\n    {f.body.format(k=k)}\n",
            })
        else:
            text, body, arg, ref, render = STDIO[rng.randrange(len(STDIO))]
            args = [arg(k, rng) for _ in range(NUM_CASES)]
            rows.append({
                "problem": text.format(k=k),
                "tests": {"inputs": [render(*a) for a in args], "outputs": [f"{ref(k, *a)}\n" for a in args]},
                "solution": body.format(k=k) + "\n",
            })
    return rows


def reference_solution(row: dict) -> str:
    """A response a model could give: the row's reference solution in a ```python block."""
    return f"Here is my solution.\n```python\n{row['solution']}```\n"

