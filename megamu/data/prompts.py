"""Prompt datasets: JSONL / JSON array / Parquet rows of (problem, answer), verl's rows (chat ``prompt``,
``reward_model.ground_truth``, ``data_source``, ``extra_info``) or slime's (--input-key messages, --label-key).

A code row's answer is its tests (``megamu.reward.code_tests``): a JSON object, or a JSON string of one. It is checked
like any answer and travels as canonical JSON text; such rows get ``code_instruction`` instead of the math one.

Every row is checked and tokenized before any generation starts, so a bad row fails the run in seconds with its
file and row number instead of hours later.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from megamu.reward.code_tests import tests_json
from megamu.reward.signatures import RowMeta

# The paper's instruction, appended to every problem after a space.
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# Code rows: the reward runs the last ```python block of the reply (megamu.reward.code).
CODE_INSTRUCTION = "Write your complete solution as one Python program in a single ```python code block."


class PromptDataError(ValueError):
    """A prompt file or row that cannot be used; the message names the file and row."""


@dataclass
class PromptRecord:
    prompt_id: int
    prompt_ids: list[int]
    answer: str
    problem: str
    meta: RowMeta = field(default_factory=RowMeta)  # the row's data_source and extra_info, for the reward


def _read_rows(path: Path) -> list[dict]:
    """Rows of a .jsonl/.json/.parquet file as dicts; a line that is not a JSON object becomes an error row."""
    if not path.exists():
        raise PromptDataError(f"{path}: no such prompt file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix not in (".jsonl", ".json"):
        raise PromptDataError(f"{path}: unsupported prompt file type {path.suffix!r} (use .jsonl or .parquet)")
    if path.suffix == ".json" and _starts_with_bracket(path):
        return _json_array_rows(path)
    with path.open(encoding="utf-8") as f:
        return [_parse_line(line) for line in f]


def _parse_line(line: str) -> dict:
    """One JSONL line as a row; what is not a JSON object becomes an error row."""
    if not line.strip():
        return {"__error__": "empty line"}
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return {"__error__": f"invalid JSON ({e.msg} at column {e.colno})"}
    return row if isinstance(row, dict) else {"__error__": f"expected a JSON object, got {type(row).__name__}"}


def _first_rows(path: Path, n: int) -> list[dict]:
    """The first ``n`` rows of a prompt file as ``_read_rows`` gives them, reading no more of a JSONL or Parquet
    file than those rows (a JSON array is parsed whole: JSON has no partial parse)."""
    if not path.exists():
        raise PromptDataError(f"{path}: no such prompt file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            batch = next(pq.ParquetFile(path).iter_batches(batch_size=n), None)
        except Exception as e:  # pyarrow's errors for a file that is not Parquet (ArrowInvalid, OSError)
            raise PromptDataError(f"{path}: not a readable Parquet file ({e})") from None
        return [] if batch is None else batch.to_pylist()
    if path.suffix == ".json" and _starts_with_bracket(path):
        return _json_array_rows(path)[:n]
    if path.suffix not in (".jsonl", ".json"):
        return _read_rows(path)  # the unsupported-type error
    with path.open(encoding="utf-8") as f:
        return [_parse_line(line) for line in islice(f, n)]


def first_rows_errors(files: list[str], prompt_key: str, answer_key: str, n: int = 8) -> list[str]:
    """'file: row k: reason' for each of the first ``n`` rows of each file that cannot be a prompt (bad JSON, not an
    object, no problem or answer under the keys); a file that cannot be read at all is one line. What a dry run
    checks: the training run reads and tokenizes every row before its first rollout (``load_prompts``)."""
    errors = []
    for file in files:
        path = Path(file)
        try:
            rows = _first_rows(path, n)
        except (PromptDataError, UnicodeDecodeError) as e:
            errors.append(str(e) if isinstance(e, PromptDataError) else f"{path}: not UTF-8 text ({e.reason})")
            continue
        if not rows:
            errors.append(f"{path}: no rows")
        for row_no, row in enumerate(rows, start=1):
            try:
                _row_to_messages(row, prompt_key, answer_key, DEFAULT_INSTRUCTION)
            except (ValueError, KeyError, TypeError) as e:
                errors.append(f"{path}: row {row_no}: {e}")
    return errors


def _starts_with_bracket(path: Path) -> bool:
    with path.open(encoding="utf-8") as f:
        head = f.read(4096).lstrip("\ufeff \t\r\n")
    return head.startswith("[")


def _json_array_rows(path: Path) -> list[dict]:
    """A .json file holding one JSON array of row objects (what verl's and slime's JSON exports often are)."""
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PromptDataError(f"{path}: invalid JSON array ({e.msg} at line {e.lineno}, column {e.colno})") from e
    return [row if isinstance(row, dict) else {"__error__": f"expected a JSON object, got {type(row).__name__}"}
            for row in rows]


def _answer_text(value) -> tuple[str | None, bool]:
    """(answer text, whether it is a code row's tests); the text is None when missing or empty. Raises ValueError
    for tests that are malformed."""
    if isinstance(value, dict) or (isinstance(value, str) and value.lstrip().startswith("{") and _is_object(value)):
        return tests_json(value), True
    return _plain_answer(value), False


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _plain_answer(value) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return str(int(value)) if float(value).is_integer() else str(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def _lookup(row: dict, key: str):
    """``row[key]``; a dotted key reaches into nested columns (``reward_model.ground_truth``)."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _chat(value) -> list[dict]:
    """A verl or slime message row's prompt: a non-empty list of {role, content}."""
    if not value or not all(isinstance(m, dict) and "role" in m and isinstance(m.get("content"), str) for m in value):
        raise ValueError("a message prompt must be a non-empty list of {role, content} messages")
    return [dict(role=m["role"], content=m["content"]) for m in value]


def row_meta(row: dict, problem: str) -> RowMeta:
    """verl's ``data_source`` and ``extra_info`` (slime's ``metadata``) of a row, for the reward function."""
    extra = row.get("extra_info", row.get("metadata"))
    if isinstance(extra, str) and _is_object(extra):
        extra = json.loads(extra)
    return RowMeta(str(row.get("data_source") or ""), extra if isinstance(extra, dict) else {}, problem)


def _row_to_messages(row: dict, prompt_key: str, answer_key: str, instruction: str,
                     code_instruction: str = CODE_INSTRUCTION) -> tuple[list[dict], str, str, RowMeta]:
    """(chat messages of the question, problem text, answer, the row's meta) of one row; raises ValueError with the
    reason. The prompt is text (the instruction is appended) or chat messages, verl's ``prompt`` column or slime's
    --input-key with --apply-chat-template (they carry their own instruction). The answer is --answer-key's (a dotted
    key reaches into a struct), else verl's ``reward_model.ground_truth``."""
    if "__error__" in row:
        raise ValueError(row["__error__"])
    prompt = row[prompt_key] if prompt_key in row else row.get("prompt")
    value, is_code = _answer_text(_lookup(row, answer_key))
    if value is None and _lookup(row, answer_key) is None:
        value, is_code = _answer_text(_lookup(row, "reward_model.ground_truth"))
    if value is None:
        raise ValueError(f"missing or empty {answer_key!r} and no 'reward_model.ground_truth' (keys: "
                         f"{sorted(row)[:10]}; see --answer-key / --label-key)")
    if isinstance(prompt, list):
        messages = _chat(prompt)
        problem = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
        return messages, problem, value, row_meta(row, problem)
    problem = row.get(prompt_key)
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"missing or empty {prompt_key!r} (keys: {sorted(row)[:10]}; see --prompt-key / --input-key)")
    # A code problem is often code itself: its instruction goes on a line of its own.
    instruction, sep = (code_instruction, "\n\n") if is_code else (instruction, " ")
    content = f"{problem.strip()}{sep}{instruction}" if instruction else problem.strip()
    return [{"role": "user", "content": content}], problem, value, row_meta(row, problem)


def render_prompt(tokenizer, messages: list[dict], few_shot: list[tuple[str, str]] = (),
                  chat_template: bool | None = None) -> list[int]:
    """Token ids of ``few_shot`` turns then ``messages``, through the chat template when the tokenizer has one
    (``chat_template`` None) or when told to (True; False: the turns' text joined by blank lines)."""
    turns = []
    for user, assistant in few_shot:
        turns += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    # A leading system message stays first.
    if messages and messages[0]["role"] == "system":
        turns = [messages[0], *turns]
        messages = messages[1:]
    turns += messages
    if getattr(tokenizer, "chat_template", None) if chat_template is None else chat_template:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n\n".join(t["content"] for t in turns)
    return list(tokenizer(text)["input_ids"])


def load_prompts(
    files: list[str],
    tokenizer,
    *,
    prompt_key: str = "problem",
    answer_key: str = "answer",
    max_prompt_length: int = 1024,
    skip_bad_rows: bool = False,
    instruction: str = DEFAULT_INSTRUCTION,
    few_shot: list[tuple[str, str]] = (),
    code_instruction: str = CODE_INSTRUCTION,
    context_length: int | None = None,
    max_response_len: int = 0,
    chat_template: bool | None = None,
) -> list[PromptRecord]:
    """Read, validate and tokenize all prompts; prompt ids are 0..N-1 in file then row order (rows are 1-based).

    With ``context_length``, a prompt whose tokens plus ``max_response_len`` exceed the model's context is a bad row:
    its reply could run into positions the model never saw (and a server refuses it hours into a rollout)."""
    if isinstance(files, (str, Path)):
        files = [files]
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise PromptDataError(f"--apply-chat-template: the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has "
                              "no chat template")
    records: list[PromptRecord] = []
    bad: list[str] = []
    for file in files:
        path = Path(file)
        for row_no, row in enumerate(_read_rows(path), start=1):
            try:
                messages, problem, answer, meta = _row_to_messages(row, prompt_key, answer_key, instruction,
                                                                   code_instruction)
                ids = render_prompt(tokenizer, messages, few_shot, chat_template)
                if len(ids) > max_prompt_length:
                    raise ValueError(f"prompt is {len(ids)} tokens, over --max-prompt-length {max_prompt_length}")
                if context_length is not None and len(ids) + max_response_len > context_length:
                    raise ValueError(f"prompt is {len(ids)} tokens: with --rollout-max-response-len "
                                     f"{max_response_len} that is over the model's context of {context_length}")
            except ValueError as e:
                bad.append(f"{path}: row {row_no}: {e}")
                continue
            records.append(PromptRecord(len(records), ids, answer, problem, meta))
    if bad and not skip_bad_rows:
        more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise PromptDataError(
            f"{len(bad)} bad prompt row(s) (use --skip-bad-rows to skip them):\n  " + "\n  ".join(bad[:10]) + more
        )
    if bad:
        warnings.warn(f"skipped {len(bad)} bad prompt row(s); first: {bad[0]}", stacklevel=2)
    if not records:
        raise PromptDataError(f"no usable prompts in {[str(f) for f in files]}")
    return records


def stop_token_ids(tokenizer) -> list[int]:
    """The stop rule shared by training and evaluation: the tokenizer's EOS (engines add the model's own EOS ids)."""
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
