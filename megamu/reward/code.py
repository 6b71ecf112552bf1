"""Code reward: run the last fenced Python block of a response against a prompt's tests (``megamu.reward.code_tests``).

Each execution is one sandboxed process (``megamu.reward.sandbox``, or a remote sandbox service through
``megamu.reward.remote``): an assert program (HumanEval / MBPP) runs once with its tests; a stdin/stdout problem runs
once per case, fed only that case's input, so the expected outputs never enter the sandbox. An assert program passes
only if it exits 0 *and* its last stdout line is a random token printed after the tests, so ``sys.exit(0)`` or
``os._exit(0)`` before the asserts fails.

Call it in a reward worker (``megamu.reward.pool``): the pool scores a batch in parallel with per-item timeouts.
"""

from __future__ import annotations

import math
import re
import secrets
import time

from megamu.reward.code_tests import CodeTests, parse_code_tests
from megamu.reward.sandbox import RunResult, SandboxLimits, run_python

CODE_MODES = ("all", "fraction")
# ```python / ```py / ```python3 (any case), up to the next fence; the last one is the answer.
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.IGNORECASE | re.DOTALL)
FLOAT_TOLERANCE = 1e-6  # stdout tokens that are both numbers (not both integers) compare at this abs/rel tolerance


def extract_code(response: str) -> str | None:
    """The last ```python fenced block of ``response`` (None without one, or if it is empty)."""
    blocks = _FENCE.findall(response)
    if not blocks or not blocks[-1].strip():
        return None
    return blocks[-1]


def _token_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    if a.lstrip("+-").isdigit() and b.lstrip("+-").isdigit():
        return False
    return math.isclose(x, y, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)


def outputs_match(actual: str, expected: str) -> bool:
    """Judge comparison: equal whitespace-separated tokens (line breaks and spacing ignored), numbers with a
    tolerance."""
    a, b = actual.split(), expected.split()
    return len(a) == len(b) and all(_token_equal(x, y) for x, y in zip(a, b))


def assert_program(solution: str, tests: CodeTests, marker: str) -> str:
    """The solution, then the tests, then the marker line that only a program that got through the tests prints."""
    call = f"\ncheck({tests.entry_point})\n" if tests.entry_point and "def check(" in tests.test else "\n"
    return f"{solution}\n\n{tests.test}\n{call}print({marker!r}, flush=True)\n"


def _run(source: str, stdin: str | None, limits: SandboxLimits, sandbox_url: str | None) -> RunResult:
    if sandbox_url:
        from megamu.reward.remote import remote_run

        return remote_run(sandbox_url, source, stdin=stdin, limits=limits)
    return run_python(source, stdin=stdin, limits=limits)


def code_score(response: str, tests, *, timeout_s: float = 10.0, mode: str = "all", sandbox_url: str | None = None,
               budget_s: float | None = None, memory_mb: int = 1024) -> float:
    """1.0 if the last fenced Python block of ``response`` passes every test, else 0.0; with ``mode="fraction"`` the
    fraction of stdin/stdout cases passed (an assert program counts as one test).

    ``tests``: a tests dict or its JSON text (a row's ground truth). ``timeout_s``: wall-clock limit of each
    execution (the CPU limit is the same, rounded up). ``budget_s``: stop starting new cases after this long (cases
    not run count as failed), so the item finishes before the pool's per-item timeout.
    """
    if mode not in CODE_MODES:
        raise ValueError(f"mode must be one of {CODE_MODES}, got {mode!r}")
    parsed = parse_code_tests(tests)
    solution = extract_code(response)
    if solution is None:
        return 0.0
    limits = SandboxLimits(wall_s=timeout_s, cpu_s=max(1, math.ceil(timeout_s)), memory_bytes=memory_mb << 20)
    if not parsed.is_stdio:
        marker = "megamu-tests-passed-" + secrets.token_hex(16)
        r = _run(assert_program(solution, parsed, marker), None, limits, sandbox_url)
        lines = r.stdout.rstrip("\n").rsplit("\n", 1)
        return 1.0 if r.returncode == 0 and lines[-1] == marker else 0.0
    start, passed = time.monotonic(), 0
    for inp, expected in zip(parsed.inputs, parsed.outputs):
        if budget_s is not None and time.monotonic() - start > budget_s:
            break
        r = _run(solution, inp, limits, sandbox_url)
        ok = r.returncode == 0 and outputs_match(r.stdout, expected)
        passed += ok
        if not ok and mode == "all":
            return 0.0
    return passed / len(parsed) if mode == "fraction" else float(passed == len(parsed))
