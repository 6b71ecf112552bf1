"""Benchmark evaluation of policies and runs: avg@k (App. B), checkpoints of a run, reports."""

from megamu.evaluation.driver import evaluate_checkpoints, summary_markdown
from megamu.evaluation.metrics import AvgAtK, avg_at_k
from megamu.evaluation.run import Checkpoint, read_metrics, run_checkpoints, update_records
from megamu.evaluation.runner import (
    DEFAULT_SAMPLES,
    Benchmark,
    BenchmarkResult,
    EvalReport,
    EvalSettings,
    evaluate_benchmark,
    evaluate_model,
    markdown_table,
    parse_benchmarks,
)

__all__ = [
    "DEFAULT_SAMPLES",
    "AvgAtK",
    "Benchmark",
    "BenchmarkResult",
    "Checkpoint",
    "EvalReport",
    "EvalSettings",
    "avg_at_k",
    "evaluate_benchmark",
    "evaluate_checkpoints",
    "evaluate_model",
    "markdown_table",
    "parse_benchmarks",
    "read_metrics",
    "run_checkpoints",
    "summary_markdown",
    "update_records",
]
