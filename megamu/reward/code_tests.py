"""The tests of a code prompt row, in the two layouts the code reward accepts.

- stdin/stdout pairs (code_contests / APPS / TACO): ``{"inputs": [str, ...], "outputs": [str, ...]}``;
- an assert program (HumanEval / MBPP): ``{"test": str, "entry_point": str}``. When ``test`` defines
  ``check(candidate)`` (HumanEval) the program ends with ``check(<entry_point>)``; otherwise (MBPP) its asserts call
  the solution by name and ``entry_point`` may be empty.

A row's tests travel as its ground truth: a JSON object (or a JSON string of one, as verl's
``reward_model.ground_truth``) becomes the canonical JSON text ``tests_json`` returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class CodeTests:
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    test: str | None = None
    entry_point: str = ""

    @property
    def is_stdio(self) -> bool:
        return self.test is None

    def __len__(self) -> int:
        return len(self.inputs) if self.is_stdio else 1


def parse_code_tests(value) -> CodeTests:
    """A tests dict (or its JSON text) -> ``CodeTests``; raises ValueError saying what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"tests are not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"tests must be a JSON object, got {type(value).__name__}")
    if "test" in value:
        test, entry = value["test"], value.get("entry_point") or ""
        if not isinstance(test, str) or not test.strip():
            raise ValueError("'test' must be a non-empty string of Python asserts")
        if not isinstance(entry, str) or (entry and not entry.isidentifier()):
            raise ValueError(f"'entry_point' must be a function name, got {entry!r}")
        if "def check(" in test and not entry:
            raise ValueError("'test' defines check(candidate) but 'entry_point' is missing")
        return CodeTests(test=test, entry_point=entry)
    if "inputs" in value or "outputs" in value:
        inputs, outputs = value.get("inputs"), value.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError("'inputs' and 'outputs' must both be lists of strings")
        if len(inputs) != len(outputs):
            raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
        if not inputs:
            raise ValueError("no test cases ('inputs' is empty)")
        if not all(isinstance(x, str) for x in inputs + outputs):
            raise ValueError("every input and output must be a string (call-based APPS tests are not supported)")
        return CodeTests(inputs=tuple(inputs), outputs=tuple(outputs))
    raise ValueError(f"tests need 'inputs'/'outputs' or 'test'/'entry_point' keys, got {sorted(value)[:10]}")


def tests_json(value) -> str:
    """Validated tests as canonical JSON text (the row's ground truth)."""
    t = parse_code_tests(value)
    if t.is_stdio:
        return json.dumps({"inputs": list(t.inputs), "outputs": list(t.outputs)}, ensure_ascii=False)
    return json.dumps({"test": t.test, "entry_point": t.entry_point}, ensure_ascii=False)
