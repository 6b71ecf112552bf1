"""Seeded arithmetic problems: the CPU demo's task (two-digit addition)."""

from __future__ import annotations

import random

# The demo's prompt: the paper's long instruction roughly doubles reply length and lowers SmolLM2's base rate, and
# one worked example turn takes format compliance from ~0 to ~0.7 (measured when the demo model was chosen).
DEMO_INSTRUCTION = "Give the final answer in \\boxed{}."
DEMO_FEW_SHOT: list[tuple[str, str]] = [
    ("What is 2 + 3? Give the final answer in \\boxed{}.", "2 + 3 = 5. The final answer is \\boxed{5}."),
]


def addition_problems(n: int, seed: int, digits: int = 2) -> list[dict]:
    """``n`` rows {"problem": "What is a + b?", "answer": "a+b"}; operands have ``digits`` digits (1 digit: 0..9)."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        rows.append({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows
