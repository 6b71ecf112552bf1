"""tools/evaluate.py: avg@k arithmetic, the benchmark pipeline on real problems with a scripted engine, run mode."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from megamu.engines.types import GeneratedSample
from megamu.evaluation import (
    EvalSettings,
    avg_at_k,
    evaluate_checkpoints,
    parse_benchmarks,
    run_checkpoints,
)

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data"
LONG = 4096  # the char-level test tokenizer makes a few MATH-500 prompts over 1024 tokens
needs_data = pytest.mark.skipif(not (DATA / "aime24.jsonl").is_file(), reason=f"benchmark data not found at {DATA}")


def test_avg_at_k_hand_computed():
    scores = [[1, 0, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]]
    r = avg_at_k(scores)
    # Rounds (columns): 2/3, 1/3, 2/3, 3/3; their mean is 8/12 = 2/3 = the mean over all 12 samples.
    assert r.round_means == pytest.approx((2 / 3, 1 / 3, 2 / 3, 1.0), abs=1e-15)
    assert r.mean == pytest.approx(2 / 3, abs=1e-15)
    assert r.std == pytest.approx(statistics.stdev([2 / 3, 1 / 3, 2 / 3, 1.0]), abs=1e-15)
    assert (r.n, r.k) == (3, 4)
    one = avg_at_k([[1.0], [0.0], [0.0], [1.0]])
    assert (one.mean, one.std, one.n, one.k) == (0.5, 0.0, 4, 1)


def test_avg_at_k_rejects_ragged_and_empty():
    with pytest.raises(ValueError, match="problem 1 has 1 samples"):
        avg_at_k([[1, 0], [1]])
    with pytest.raises(ValueError, match="no problems"):
        avg_at_k([])


def test_parse_benchmarks_defaults_and_errors(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"problem": "1+1", "answer": "2"}\n')
    benches = parse_benchmarks([f"aime24={f}", f"aime25={f}", f"amc23={f}", f"math500={f}", f"other={f}"],
                               ["math500=2"])
    # App. B: 16 samples for AIME24/25, 4 for AMC23 and MATH-500.
    assert [(b.name, b.samples) for b in benches] == [("aime24", 16), ("aime25", 16), ("amc23", 4), ("math500", 2),
                                                      ("other", 4)]
    with pytest.raises(ValueError, match="no such file"):
        parse_benchmarks([f"aime24={tmp_path / 'missing.jsonl'}"])
    with pytest.raises(ValueError, match="name=path"):
        parse_benchmarks([str(f)])
    with pytest.raises(ValueError, match="match no --data"):
        parse_benchmarks([f"aime24={f}"], ["aime25=3"])


def test_checkpoint_updates_and_times_with_sparse_logging(tmp_path):
    # --log-interval 2 with μ = 4: updates 1, 3 (stage 0) and 5, 7 (stage 1) are logged; the stage ends always are.
    rows = [{"kind": "update", "stage": s, "update": u, "time": 100.0 + u} for s, u in ((0, 1), (0, 3), (1, 5), (1, 7))]
    rows.insert(2, {"kind": "stage", "stage": 0, "time": 103.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("stage_0", "stage_1", "final", "iter_4", "iter_6"):
        (tmp_path / "hf" / name).mkdir(parents=True)
        (tmp_path / "hf" / name / "config.json").write_text("{}")
    (tmp_path / "hf" / "sglang_logs").mkdir()  # not a checkpoint: no config.json
    got = [(c.name, c.updates, c.time) for c in run_checkpoints(tmp_path)]
    # stage_1 = after updates 0..3 (last logged: #3 at 103 s); iter_6 = after 6 updates, last logged before: #5.
    assert got == [("stage_0", 0, 0.0), ("stage_1", 4, 103.0), ("iter_4", 4, 103.0), ("iter_6", 6, 105.0),
                   ("final", 8, 107.0)]


class ScriptedEngine:
    """Engine test double: a fixed reply per (prompt, sample index), right or wrong as ``correct(model, bench, i, j)``.

    ``prompts`` maps the prompt token ids that training would build (``load_prompts``) to (benchmark, row, gold
    answer), so a prompt built any other way fails loudly. Decoding, math-verify scoring and avg@k are the real code.
    """

    def __init__(self, hf_dir, tokenizer, prompts: dict[tuple, tuple[str, int, str]], correct):
        self.hf_dir, self.tok, self.prompts, self.correct = str(hf_dir), tokenizer, prompts, correct
        self.requests = []
        self.shut = False

    def generate(self, requests):
        self.requests += requests
        out = []
        for r in requests:
            bench, i, gold = self.prompts[tuple(r.prompt_ids)]
            for j in range(r.sampling.n):
                if self.correct(Path(self.hf_dir).name, bench, i, j):
                    text = f"Adding up, we get \\boxed{{{gold}}}."
                else:
                    text = "I think it is \\boxed{-98765}." if (i + j) % 2 else "no idea"
                ids = self.tok(text, add_special_tokens=False)["input_ids"] + [2]
                out.append(GeneratedSample(r.prompt_id, j, ids, [-0.5] * len(ids), "stop"))
        return out

    def update_weights(self, hf_dir=None, state_dict=None):
        self.hf_dir = str(hf_dir)

    def shutdown(self):
        self.shut = True


def _prompt_table(tokenizer, benches: dict[str, int]) -> dict[tuple, tuple[str, int, str]]:
    """Training prompts of the first n rows of each benchmark -> (benchmark, row, gold answer read from the file)."""
    from megamu.data.prompts import load_prompts

    table = {}
    for name, n in benches.items():
        with open(DATA / f"{name}.jsonl") as f:
            gold = [json.loads(line)["answer"] for line in f][:n]
        for i, rec in enumerate(load_prompts([str(DATA / f"{name}.jsonl")], tokenizer, max_prompt_length=LONG)[:n]):
            table[tuple(rec.prompt_ids)] = (name, i, gold[i])
    return table


@pytest.fixture(scope="module")
def scorer():
    from megamu.reward import RewardScorer

    with RewardScorer(timeout_s=10.0, num_workers=1) as s:
        yield s


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "qwen2", seed=0)


@needs_data
def test_scripted_engine_avg_at_k_on_real_problems(scorer, tiny_dir):
    from transformers import AutoTokenizer

    from megamu.evaluation import evaluate_model

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    # aime24 (n=3, k=4): problem 0 always right, problem 1 right in round 2 only, problem 2 never.
    # math500 (n=2, k=2): problem 0 right in round 1, problem 1 (gold: a LaTeX tuple) always.
    right = {("aime24", 0, j) for j in range(4)} | {("aime24", 1, 2), ("math500", 0, 1), ("math500", 1, 0),
                                                   ("math500", 1, 1)}
    engine = ScriptedEngine(tiny_dir, tok, _prompt_table(tok, {"aime24": 3, "math500": 2}),
                            lambda _m, b, i, j: (b, i, j) in right)
    benches = parse_benchmarks([f"aime24={DATA / 'aime24.jsonl'}", f"math500={DATA / 'math500.jsonl'}"],
                               ["aime24=4", "math500=2"])
    settings = EvalSettings(max_response_len=77, temperature=0.9, limit=3, max_prompt_length=LONG)
    # --limit 3 would give math500 a third problem the double has no reply for: evaluate it with limit 2.
    report, responses = evaluate_model(engine, tok, scorer, benches[:1], settings, str(tiny_dir), [2],
                                       log=lambda m: 0)
    settings2 = EvalSettings(max_response_len=77, temperature=0.9, limit=2, max_prompt_length=LONG)
    report2, responses2 = evaluate_model(engine, tok, scorer, benches[1:], settings2, str(tiny_dir), [2],
                                         log=lambda m: 0)
    aime, math = report.benchmarks["aime24"], report2.benchmarks["math500"]
    assert (aime.n, aime.k, math.n, math.k) == (3, 4, 2, 2)
    assert aime.scores == [[1, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]]
    assert aime.mean == pytest.approx(5 / 12, abs=1e-12)
    assert aime.std == pytest.approx(statistics.stdev([1 / 3, 1 / 3, 2 / 3, 1 / 3]), abs=1e-12)
    assert math.scores == [[0, 1], [1, 1]] and math.mean == pytest.approx(3 / 4, abs=1e-12)
    assert report.average == pytest.approx(5 / 12, abs=1e-12)
    assert (len(responses), len(responses2)) == (12, 4)
    # The engine saw the training-style request: k samples, the given length and temperature, EOS as a stop token.
    req = engine.requests[0]
    assert (req.sampling.n, req.sampling.max_new_tokens, req.sampling.temperature) == (4, 77, 0.9)
    assert 2 in req.sampling.stop_token_ids


@needs_data
def test_run_mode_picks_best_checkpoint_and_resumes(tmp_path, scorer, tiny_dir):
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    for name in ("stage_0", "stage_1", "stage_2"):
        shutil.copytree(tiny_dir, run / "hf" / name)
    # Two stages of 2 updates each; stage_k is the policy frozen before stage k. The last line was cut by a kill.
    updates = [{"kind": "update", "stage": s, "update": u, "time": 10.0 * (u + 1), "reward_mean": 0.1}
               for s, u in ((0, 0), (0, 1), (1, 2), (1, 3))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in updates) + '{"kind": "upd')
    ckpts = run_checkpoints(run)
    assert [(c.name, c.updates, c.time) for c in ckpts] == [("stage_0", 0, 0.0), ("stage_1", 2, 20.0),
                                                           ("stage_2", 4, 40.0)]

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    table = _prompt_table(tok, {"amc23": 2})
    # Right answers per checkpoint (of 2 problems x 2 samples): stage_0 1/4, stage_1 3/4, stage_2 2/4.
    right = {"stage_0": {(0, 0)}, "stage_1": {(0, 0), (0, 1), (1, 1)}, "stage_2": {(1, 0), (1, 1)}}
    engines: list[ScriptedEngine] = []

    def build(hf_dir):
        engines.append(ScriptedEngine(hf_dir, tok, table, lambda m, _b, i, j: (i, j) in right[m]))
        return engines[-1]

    benches = parse_benchmarks([f"amc23={DATA / 'amc23.jsonl'}"], ["amc23=2"])
    settings = EvalSettings(max_response_len=16, limit=2, max_prompt_length=LONG)
    summary = evaluate_checkpoints(ckpts, build, AutoTokenizer.from_pretrained, scorer, benches, settings,
                                   run / "eval", log=lambda m: 0)
    assert len(engines) == 1 and engines[0].shut  # one engine, weights swapped in place, shut down at the end
    assert [c["average"] for c in summary["checkpoints"]] == pytest.approx([0.25, 0.75, 0.5], abs=1e-12)
    assert (summary["best"], summary["best_average"]) == ("stage_1", pytest.approx(0.75))
    saved = json.loads((run / "eval" / "stage_1.json").read_text())
    assert (saved["updates"], saved["time"], saved["benchmarks"]["amc23"]["n"]) == (2, 20.0, 2)
    assert "**75.00**" in (run / "eval" / "summary.md").read_text()

    def no_engine(_):
        raise AssertionError("finished checkpoints must be reused, not re-evaluated")

    again = evaluate_checkpoints(ckpts, no_engine, AutoTokenizer.from_pretrained, scorer, benches, settings,
                                 run / "eval", log=lambda m: 0)
    assert again == summary


@needs_data
def test_sglang_engine_path_loads_each_checkpoint(tmp_path, scorer, tiny_dir, monkeypatch):
    """--rollout-engine sglang --sglang-url: the real HTTP client against a server speaking SGLang's schema."""
    import importlib.util

    from transformers import AutoTokenizer

    from tests.engines.schema_server import SchemaServer

    spec = importlib.util.spec_from_file_location("evaluate_tool", REPO / "tools" / "evaluate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    run = tmp_path / "run"
    for name in ("stage_0", "stage_1"):
        shutil.copytree(tiny_dir, run / "hf" / name)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    # The server starts on stage_1's weights: the evaluation must load stage_0 into it before scoring stage_0.
    # (The client sends one n=1 request per sample, so the double sees sample index 0: right answers go by problem.)
    right = {"stage_0": {(0, 0)}, "stage_1": {(0, 0), (1, 0)}}
    backend = ScriptedEngine(run / "hf" / "stage_1", tok, _prompt_table(tok, {"amc23": 2}),
                             lambda m, _b, i, j: (i, 0) in right[m])
    server = SchemaServer(backend, api_key="secret")
    monkeypatch.setenv("SGLANG_API_KEY", "secret")
    try:
        args = tool.parse_args(["--run", str(run), "--data", f"amc23={DATA / 'amc23.jsonl'}", "--samples", "amc23=2",
                                "--limit", "2", "--rollout-engine", "sglang", "--sglang-url", server.url,
                                "--max-prompt-length", str(LONG)])
        settings = EvalSettings(limit=2, max_prompt_length=LONG)
        summary = evaluate_checkpoints(run_checkpoints(run), tool.engine_factory(args), AutoTokenizer.from_pretrained,
                                       scorer, args.benchmarks, settings, run / "eval", log=lambda m: 0)
    finally:
        server.close()
    assert [c["average"] for c in summary["checkpoints"]] == pytest.approx([0.5, 1.0], abs=1e-12)
    assert summary["best"] == "stage_1"


@needs_data
def test_cli_on_tiny_model_with_local_engine(tmp_path, tiny_dir):
    out = tmp_path / "eval"
    cmd = [sys.executable, str(REPO / "tools" / "evaluate.py"), "--hf-dir", str(tiny_dir),
           "--data", f"aime24={DATA / 'aime24.jsonl'}", "--data", f"amc23={DATA / 'amc23.jsonl'}",
           "--samples", "aime24=3", "--limit", "2", "--max-response-len", "6", "--out", str(out),
           "--reward-workers", "1", "--save-responses", "--max-prompt-length", str(LONG)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "model.json").read_text())
    counts = {n: (b["n"], b["k"], len(b["scores"]), len(b["scores"][0])) for n, b in report["benchmarks"].items()}
    assert counts == {"aime24": (2, 3, 2, 3), "amc23": (2, 4, 2, 4)}
    # 6 random characters cannot hold a boxed answer: every sample scores 0.
    assert report["average"] == 0.0
    assert len((out / "model.responses.jsonl").read_text().splitlines()) == 2 * 3 + 2 * 4
    assert "| aime24 | 0.00 | 0.00 | 2 | 3 |" in proc.stdout


def test_engine_dtype_comes_from_the_checkpoint(tmp_path, monkeypatch):
    """A bf16 export is served in bfloat16 (a float32 server would refuse its weights at the second checkpoint's
    layout check); --rollout-dtype still wins."""
    import importlib.util

    import megamu.engines

    spec = importlib.util.spec_from_file_location("evaluate_tool", REPO / "tools" / "evaluate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    built = []
    monkeypatch.setattr(megamu.engines, "build_engine", lambda cfg, hf_dir: built.append((cfg.dtype, hf_dir)))
    for name, dtype in (("bf16", "bfloat16"), ("fp32", "float32")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"dtype": dtype}))
    (tmp_path / "x.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    base = ["--hf-dir", str(tmp_path / "bf16"), "--data", f"x={tmp_path / 'x.jsonl'}", "--rollout-engine", "sglang",
            "--sglang-url", "http://127.0.0.1:1"]
    tool.engine_factory(tool.parse_args(base))(tmp_path / "bf16")
    tool.engine_factory(tool.parse_args(base))(tmp_path / "fp32")
    tool.engine_factory(tool.parse_args(base + ["--rollout-dtype", "float32"]))(tmp_path / "bf16")
    assert [d for d, _ in built] == ["bfloat16", "float32", "float32"]


def test_run_mode_builds_prompts_as_the_training_run_did(tmp_path):
    """A run with its own instruction, prompt column and no chat template: tools/evaluate.py --run builds each
    benchmark prompt token for token as the run's Prompts built its evaluation sets (they used to get the paper's
    instruction and the 'problem' column whatever the run had)."""
    from megamu.data.prompts import load_prompts
    from megamu.data.stage_prompts import Prompts, PromptsConfig
    from megamu.evaluation.runner import EvalSettings
    from megamu.run.run_dir import RunDir
    from tests.tiny import build_char_tokenizer

    sys.path.insert(0, str(REPO / "tools"))
    import evaluate as evaluate_tool

    rows = tmp_path / "q.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{a}+{a}=?", "answer": str(2 * a)}) + "\n" for a in range(6)))
    run = tmp_path / "run"
    tok = build_char_tokenizer()
    cfg = PromptsConfig(files=(str(rows),), prompts_per_stage=2, held_out=0, seed=0, data_dir=RunDir(run).data,
                        prompt_key="question", instruction=" Answer in one word.", chat_template=False,
                        max_prompt_length=300, max_response_len=96, eval_sets=(("q", str(rows)),))
    trained = Prompts(cfg, tok).eval_sets["q"]
    args = evaluate_tool.parse_args(["--run", str(run), "--data", f"q={rows}"])
    assert (args.prompt_key, args.instruction, args.chat_template, args.max_prompt_length, args.max_response_len) == (
        "question", " Answer in one word.", False, 300, 96)
    s = EvalSettings(prompt_key=args.prompt_key, answer_key=args.answer_key, instruction=args.instruction,
                     few_shot=args.few_shot, chat_template=args.chat_template, max_prompt_length=args.max_prompt_length)
    built = load_prompts([str(rows)], tok, prompt_key=s.prompt_key, answer_key=s.answer_key,
                         max_prompt_length=s.max_prompt_length, instruction=s.instruction, few_shot=list(s.few_shot),
                         chat_template=s.chat_template)
    assert [r.prompt_ids for r in built] == [r.prompt_ids for r in trained]
    assert " Answer in one word." in tok.decode(built[0].prompt_ids)
    # a flag given here wins over the run's
    assert evaluate_tool.parse_args(["--run", str(run), "--data", f"q={rows}", "--instruction", ""]).instruction == ""
