"""A dry run reads the first rows of each data file (issue 49 item 7): bad JSON, a row that is no object, a row
without the problem or answer key, or a file that is not Parquet stops it, naming the flag, the file and the row; good
JSONL, JSON-array and Parquet files (verl's rows included) pass, and only the first rows are read."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megamu.arguments import parse_args
from megamu.data.prompts import first_rows_errors
from tests.data.test_user_rows import VERL_ROW

GOOD = {"problem": "1 + 1?", "answer": "2"}


def dry_run(tmp_path, *data: str, extra=()):
    return parse_args(["--prompt-data", ",".join(data), "--save", str(tmp_path / "run"), "--dry-run", *extra])


def refused(tmp_path, *data: str, extra=()) -> str:
    with pytest.raises(SystemExit) as e:
        dry_run(tmp_path, *data, extra=extra)
    return str(e.value)


def test_good_files_pass(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "b.json").write_text(json.dumps([GOOD, GOOD]))
    pq.write_table(pa.Table.from_pylist([VERL_ROW]), tmp_path / "c.parquet")
    dry_run(tmp_path, str(tmp_path / "a.jsonl"), str(tmp_path / "b.json"), str(tmp_path / "c.parquet"))


def test_bad_json_names_the_flag_the_file_and_the_row(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n{'problem': 'single quotes'}\n")
    message = refused(tmp_path, str(f))
    assert message.startswith("pretrain_mu_grpo.py: error: --prompt-data: ")
    assert f"{f}: row 3: invalid JSON" in message


def test_a_csv_passed_as_jsonl_and_a_text_file_as_parquet_are_refused(tmp_path):
    csv = tmp_path / "train.jsonl"
    csv.write_text("problem,answer\n1 + 1?,2\n")
    assert f"{csv}: row 1: invalid JSON" in refused(tmp_path, str(csv))
    fake = tmp_path / "train.parquet"
    fake.write_text("not parquet")
    assert f"{fake}: not a readable Parquet file" in refused(tmp_path, str(fake))


def test_a_row_without_its_keys_or_not_an_object(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"question": "1 + 1?", "answer": "2"}) + "\n" + json.dumps([1, 2]) + "\n")
    message = refused(tmp_path, str(f))
    assert f"{f}: row 1: missing or empty 'problem'" in message and f"{f}: row 2: expected a JSON object" in message
    # an evaluation file is read the same way, and named by its own flag
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps(GOOD) + "\n")
    message = refused(tmp_path, str(ok), extra=["--eval-prompt-data", "dev", str(f)])
    assert message.startswith("pretrain_mu_grpo.py: error: --eval-prompt-data: ") and f"{f}: row 1" in message


def test_only_the_first_rows_are_read(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(GOOD) + "\n" for _ in range(8)) + "not json\n")
    assert first_rows_errors([str(f)], "problem", "answer", n=8) == []
    assert first_rows_errors([str(f)], "problem", "answer", n=9) == [f"{f}: row 9: invalid JSON (Expecting value "
                                                                     "at column 1)"]
