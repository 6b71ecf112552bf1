"""Evaluate a list of checkpoints with one engine (weights swapped in place), saving each report as soon as it exists.

A report already on disk with the same settings and benchmarks is reused, so an interrupted evaluation of a long run
resumes where it stopped and never redoes (or loses) finished checkpoints.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from megamu.data.prompts import stop_token_ids
from megamu.engines.types import Engine
from megamu.evaluation.run import Checkpoint
from megamu.evaluation.runner import Benchmark, EvalReport, EvalSettings, evaluate_model, markdown_table
from megamu.runtime.atomic import atomic_write_text


def _saved_report(path: Path, settings: EvalSettings, benchmarks: list[Benchmark]) -> EvalReport | None:
    if not path.is_file():
        return None
    try:
        report = EvalReport.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError, KeyError):
        return None
    saved = [(b.name, b.path, b.k) for b in report.benchmarks.values()]
    as_saved = json.loads(json.dumps(asdict(settings)))  # tuples come back from JSON as lists
    same = report.settings == as_saved and saved == [(b.name, str(b.path), b.samples) for b in benchmarks]
    return report if same else None


def summary_markdown(reports: list[EvalReport]) -> str:
    """One row per checkpoint (pass@1 %, avg@k per benchmark), the best average in bold, then its detailed table."""
    names = list(reports[0].benchmarks)
    best = max(reports, key=lambda r: r.average)
    lines = ["| checkpoint | updates | time (h) | " + " | ".join(names) + " | average |",
             "|---|---:|---:|" + "---:|" * (len(names) + 1)]
    for r in reports:
        hours = f"{r.time / 3600:.2f}" if r.time is not None else ""
        cells = [f"{100 * r.benchmarks[n].mean:.2f}" for n in names]
        avg = f"{100 * r.average:.2f}"
        lines.append(f"| {r.checkpoint} | {r.updates if r.updates is not None else ''} | {hours} | "
                     + " | ".join(cells) + f" | {'**' + avg + '**' if r is best else avg} |")
    lines += ["", f"best average: {best.checkpoint} ({100 * best.average:.2f}%)", "", markdown_table(best)]
    return "\n".join(lines)


def evaluate_checkpoints(
    checkpoints: list[Checkpoint],
    engine_factory: Callable[[str], Engine],
    tokenizer_factory: Callable[[str], object],
    scorer,
    benchmarks: list[Benchmark],
    settings: EvalSettings,
    out_dir: str | Path,
    *,
    save_responses: bool = False,
    overwrite: bool = False,
    log=print,
) -> dict:
    """Evaluate each checkpoint; write ``<out>/<name>.json|.md`` per checkpoint and ``<out>/summary.json|.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engine: Engine | None = None
    reports: list[EvalReport] = []
    try:
        for ckpt in checkpoints:
            path = out / f"{ckpt.name}.json"
            report = None if overwrite else _saved_report(path, settings, benchmarks)
            if report is not None:
                log(f"{ckpt.name}: reusing {path} (average {100 * report.average:.2f}%)")
                reports.append(report)
                continue
            log(f"{ckpt.name}: evaluating {ckpt.hf_dir}")
            if engine is None:
                engine = engine_factory(str(ckpt.hf_dir))
            else:
                engine.update_weights(hf_dir=str(ckpt.hf_dir))
            tokenizer = tokenizer_factory(str(ckpt.hf_dir))
            report, responses = evaluate_model(engine, tokenizer, scorer, benchmarks, settings, str(ckpt.hf_dir),
                                               stop_token_ids(tokenizer), log=log)
            report.checkpoint, report.updates, report.time = ckpt.name, ckpt.updates, ckpt.time
            if save_responses:
                atomic_write_text(out / f"{ckpt.name}.responses.jsonl",
                              "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in responses))
            atomic_write_text(path, json.dumps(report.to_json(), indent=1))
            atomic_write_text(out / f"{ckpt.name}.md", markdown_table(report))
            log(markdown_table(report))
            reports.append(report)
    finally:
        if engine is not None:
            engine.shutdown()
    best = max(reports, key=lambda r: r.average)
    summary = {
        "best": best.checkpoint, "best_average": best.average,
        "checkpoints": [{"name": r.checkpoint, "updates": r.updates, "time": r.time, "average": r.average,
                         "benchmarks": {n: b.mean for n, b in r.benchmarks.items()}} for r in reports],
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    atomic_write_text(out / "summary.md", summary_markdown(reports))
    return summary
