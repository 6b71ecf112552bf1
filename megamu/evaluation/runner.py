"""Evaluate one policy (an HF folder) on math benchmarks with any rollout engine, and report avg@k per benchmark.

Prompts are built exactly as in training (``load_prompts``: same instruction, chat template and prompt length), the
reward is the training reward (``RewardScorer``, math-verify by default), and sample j of every problem forms
"round" j, so avg@k and its spread over rounds come from ``avg_at_k``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megamu.data.prompts import DEFAULT_INSTRUCTION
from megamu.engines.types import Engine, GeneratedSample, GenerateRequest, SamplingParams
from megamu.evaluation.metrics import avg_at_k

# App. B: pass@1 averaged over 16 samples for AIME24/25 and over 4 for AMC23/24 and MATH-500.
DEFAULT_SAMPLES = {"aime24": 16, "aime25": 16, "amc23": 4, "amc24": 4, "math500": 4}
FALLBACK_SAMPLES = 4


@dataclass(frozen=True)
class Benchmark:
    name: str
    path: str
    samples: int


@dataclass(frozen=True)
class EvalSettings:
    """Everything that changes the numbers; a saved report is reused only when its settings are equal."""

    max_response_len: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    limit: int | None = None
    max_prompt_length: int = 1024
    skip_bad_rows: bool = False  # drop problems whose prompt is over max_prompt_length (n in the report shows it)
    prompt_key: str = "problem"
    answer_key: str = "answer"
    instruction: str = DEFAULT_INSTRUCTION  # the training run's (its data/prompt_settings.json)
    few_shot: tuple[tuple[str, str], ...] = ()
    chat_template: bool | None = None
    reward_fn: str = "megamu.reward.math:math_score"


@dataclass
class BenchmarkResult:
    name: str
    path: str
    mean: float
    std: float
    n: int
    k: int
    round_means: list[float]
    scores: list[list[float]]  # [problem][sample]: kept so any other statistic can be recomputed later
    truncation_rate: float
    t_generate: float


@dataclass
class EvalReport:
    model: str
    settings: dict
    benchmarks: dict[str, BenchmarkResult]
    average: float  # unweighted mean over benchmarks, the paper's "Avg."
    t_eval: float
    checkpoint: str | None = None
    updates: int | None = None  # policy updates behind this checkpoint (run evaluation only)
    time: float | None = None  # run wall-clock seconds at which this policy existed (run evaluation only)
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> EvalReport:
        benches = {k: BenchmarkResult(**v) for k, v in d["benchmarks"].items()}
        return EvalReport(**{**d, "benchmarks": benches})


def parse_benchmarks(data: list[str], samples: list[str] = ()) -> list[Benchmark]:
    """``--data name=path`` (repeatable) and ``--samples name=k`` overrides -> benchmarks in the order given."""
    ks: dict[str, int] = {}
    for spec in samples:
        name, sep, k = spec.partition("=")
        if not sep or not k.strip().isdigit() or int(k) < 1:
            raise ValueError(f"--samples expects name=k with k >= 1, got {spec!r}")
        ks[name.strip()] = int(k)
    out: list[Benchmark] = []
    for spec in data:
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--data expects name=path.jsonl, got {spec!r}")
        if not Path(path).is_file():
            raise ValueError(f"--data {name}: no such file {path}")
        if any(b.name == name for b in out):
            raise ValueError(f"--data {name} given twice")
        out.append(Benchmark(name, path, ks.pop(name, DEFAULT_SAMPLES.get(name, FALLBACK_SAMPLES))))
    if ks:
        raise ValueError(f"--samples names {sorted(ks)} match no --data benchmark ({[b.name for b in out]})")
    if not out:
        raise ValueError("no benchmark given: pass --data name=path.jsonl (e.g. aime24=../shared/data/aime24.jsonl)")
    return out


def _group(samples: list[GeneratedSample], requests: list[GenerateRequest], k: int, name: str) -> list[list]:
    """Samples indexed [request][sample_index], checking the engine returned exactly k per request."""
    by_id = {r.prompt_id: i for i, r in enumerate(requests)}
    grid: list[list] = [[None] * k for _ in requests]
    for s in samples:
        i = by_id.get(s.prompt_id)
        if i is None or not 0 <= s.sample_index < k or grid[i][s.sample_index] is not None:
            raise RuntimeError(f"{name}: unexpected sample from the engine (prompt {s.prompt_id}, #{s.sample_index})")
        grid[i][s.sample_index] = s
    missing = sum(x is None for row in grid for x in row)
    if missing:
        raise RuntimeError(f"{name}: engine returned {len(samples)} samples, {missing} of {len(requests) * k} missing")
    return grid


def evaluate_benchmark(engine: Engine, tokenizer, scorer, bench: Benchmark, settings: EvalSettings,
                       stop_ids: list[int], *, samples_per_call: int = 2048,
                       log=print) -> tuple[BenchmarkResult, list[dict]]:
    """Generate k samples per problem, score them with ``scorer.score``; returns the result and the responses."""
    from megamu.data.prompts import load_prompts

    records = load_prompts([bench.path], tokenizer, prompt_key=settings.prompt_key, answer_key=settings.answer_key,
                           max_prompt_length=settings.max_prompt_length, skip_bad_rows=settings.skip_bad_rows,
                           instruction=settings.instruction, few_shot=list(settings.few_shot),
                           chat_template=settings.chat_template)
    if settings.limit is not None:
        records = records[: settings.limit]
    sampling = SamplingParams(temperature=settings.temperature, top_p=settings.top_p,
                              max_new_tokens=settings.max_response_len, n=bench.samples,
                              stop_token_ids=list(stop_ids), seed=settings.seed)
    requests = [GenerateRequest(r.prompt_id, r.prompt_ids, sampling) for r in records]
    t0 = time.perf_counter()
    grid: list[list[GeneratedSample]] = []
    # Calls only pace the progress log: each is large enough to keep every server (or the local batch) full.
    chunk = max(1, samples_per_call // bench.samples)
    for start in range(0, len(requests), chunk):
        part = requests[start : start + chunk]
        grid += _group(engine.generate(part), part, bench.samples, bench.name)
        log(f"  {bench.name}: generated {min(start + chunk, len(requests))}/{len(requests)} problems "
            f"x {bench.samples} samples ({time.perf_counter() - t0:.0f}s)")
    t_generate = time.perf_counter() - t0
    flat = [s for row in grid for s in row]
    texts = tokenizer.batch_decode([s.output_ids for s in flat], skip_special_tokens=True)
    gold = [r.answer for r in records for _ in range(bench.samples)]
    rewards = scorer.score(texts, gold)
    scores = [rewards[i * bench.samples : (i + 1) * bench.samples] for i in range(len(records))]
    agg = avg_at_k(scores)
    result = BenchmarkResult(
        name=bench.name, path=str(bench.path), mean=agg.mean, std=agg.std, n=agg.n, k=agg.k,
        round_means=list(agg.round_means), scores=scores,
        truncation_rate=sum(s.finish_reason == "length" for s in flat) / len(flat), t_generate=t_generate,
    )
    responses = [
        {"benchmark": bench.name, "prompt_id": r.prompt_id, "sample": j, "answer": r.answer, "reward": scores[i][j],
         "finish_reason": grid[i][j].finish_reason, "response": texts[i * bench.samples + j]}
        for i, r in enumerate(records) for j in range(bench.samples)
    ]
    return result, responses


def evaluate_model(engine: Engine, tokenizer, scorer, benchmarks: list[Benchmark], settings: EvalSettings,
                   model: str, stop_ids: list[int], *, log=print) -> tuple[EvalReport, list[dict]]:
    """Evaluate the policy currently loaded in ``engine`` on every benchmark."""
    t0 = time.perf_counter()
    results: dict[str, BenchmarkResult] = {}
    responses: list[dict] = []
    for bench in benchmarks:
        results[bench.name], rows = evaluate_benchmark(engine, tokenizer, scorer, bench, settings, stop_ids, log=log)
        responses += rows
        r = results[bench.name]
        log(f"  {bench.name}: avg@{r.k} = {100 * r.mean:.1f}% (std {100 * r.std:.1f}, n={r.n})")
    average = sum(r.mean for r in results.values()) / len(results)
    report = EvalReport(model=str(model), settings=asdict(settings), benchmarks=results, average=average,
                        t_eval=time.perf_counter() - t0)
    return report, responses


def markdown_table(report: EvalReport) -> str:
    """Per benchmark: mean pass@1 over k samples, std over sample rounds, n problems, k samples (percent)."""
    lines = [f"model: `{report.model}`" + (f" (checkpoint {report.checkpoint})" if report.checkpoint else ""), "",
             "| benchmark | avg@k pass@1 (%) | std over rounds (%) | n | k |", "|---|---:|---:|---:|---:|"]
    for r in report.benchmarks.values():
        lines.append(f"| {r.name} | {100 * r.mean:.2f} | {100 * r.std:.2f} | {r.n} | {r.k} |")
    lines.append(f"| **average** | **{100 * report.average:.2f}** | | | |")
    return "\n".join(lines) + "\n"
