"""The paper's mechanism on CPU (§3, Fig. 2-3, App. C.2, Table 1 ordering): every method at the same rollout budget.

Runs ``pretrain_mu_grpo.py`` (through ``bench/learning.py``'s ``run_preset``) once per method, on the demo's
SmolLM2-135M-Instruct and two-digit addition unless --hf-checkpoint / --prompt-data say otherwise, all with the same
data, seed, learning rate, prompts per update, samples per prompt and total updates (so the same number of rollout
samples), and the same held-out problems:

- ``grpo-mu4``: standard GRPO (clip [0.8, 1.2]) at μ = --low-mu, colocated (the engine refreshed in place);
- at μ = --mu (staged, --num-stages stages): ``grpo-high-staleness`` (clip [0.8, 1.2]), ``grpo-relaxed`` (clip [0, 5],
  no veto: the ablation that drifts, §3.1-3.2), ``mu-grpo`` (clip [0, 5] + sequence veto, τ = 1e-4), ``m2po``, and
  μ-GRPO with the veto scopes ``trigger``, ``nontrigger_suffix`` and ``suffix`` (§3.3, App. C.2).

It writes the report (--report, default OUT/fidelity.md) and its PNG figures in the folder beside it named after it
(OUT/fidelity/), rewritten after every method so that a stopped run still leaves a report of what finished. A method
whose run directory already holds a finished run is read back, not rerun (rerun the command to complete a stopped
run; a half-finished directory is an error: remove it). The full run documented in docs/fidelity.md:

    OMP_NUM_THREADS=1 .venv/bin/python bench/fidelity.py --sweep --out /tmp/fid-sweep --sweep-lrs 1e-4 3e-4 3e-5 1e-5
    OMP_NUM_THREADS=1 .venv/bin/python bench/fidelity.py --out /tmp/fidelity --report docs/fidelity.md \\
        --sweep-dir /tmp/fid-sweep --lr 1e-4 --notes docs/fidelity/reading.md

(about 45 min on one core of the 2-core machine the report names; the sweep about 10 min.)

``--quick`` runs 2 updates per method (a smoke run: the suite runs it on a tiny model). ``--sweep`` runs the
learning-rate sweep instead (grpo-relaxed at each --sweep-lrs, evaluation off) into --out; pass that folder as
--sweep-dir to a full run to put its table and figure in the report. Flags this script does not know go to
pretrain_mu_grpo.py unchanged.

Staged methods share their first stage's rollout dataset: β_0 is the base model for all of them and the rollout seed
and prompts are the same, so they would each generate the same samples; the first one generates it, the others get a
copy (--no-share-rollout: each generates its own). Wall-clock is charged from the dataset's measured generation
time either way (see fidelity_report.wall_clock).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from fidelity_report import MethodRun, write_report  # noqa: E402
from learning import run_preset, summarize  # noqa: E402


@dataclass(frozen=True)
class Method:
    label: str  # its run directory under --out
    algorithm: str  # the --algorithm preset
    flags: tuple[str, ...] = ()  # overrides of the preset
    low_staleness: bool = False  # standard GRPO: μ = --low-mu, colocated
    note: str = ""


# In run order: the drift ablation and its cure first, so that a run stopped early has answered the main question.
METHODS = (
    Method("grpo-relaxed", "grpo-relaxed", note="clip [0, 5], no veto"),
    Method("mu-grpo", "mu-grpo", note="clip [0, 5] + veto S_seq, τ = 1e-4"),
    Method("grpo-high-staleness", "grpo-high-staleness", note="clip [0.8, 1.2], staged"),
    Method("grpo-mu4", "grpo", low_staleness=True, note="standard GRPO, clip [0.8, 1.2], colocated"),
    Method("m2po", "m2po", note="no upper clip, second-moment mask 0.04"),
    Method("mu-grpo-trigger", "mu-grpo", ("--nav-scope", "trigger"), note="clip [0, 5] + veto T (trigger tokens)"),
    Method("mu-grpo-nontrigger-suffix", "mu-grpo", ("--nav-scope", "nontrigger_suffix"),
           note="clip [0, 5] + veto H_κ"),
    Method("mu-grpo-suffix", "mu-grpo", ("--nav-scope", "suffix"), note="clip [0, 5] + veto S_κ"),
)
BY_LABEL = {m.label: m for m in METHODS}


def schedule(method: Method, a: argparse.Namespace) -> argparse.Namespace:
    """The run_preset settings of ``method``: every method gets the same updates and rollout samples."""
    total = a.mu * a.num_stages
    if method.low_staleness:
        if total % a.low_mu:
            raise SystemExit(f"bench/fidelity.py: --low-mu {a.low_mu} must divide --mu x --num-stages = {total}")
        mu, stages, mode = a.low_mu, total // a.low_mu, "colocated"
    else:
        mu, stages, mode = a.mu, a.num_stages, "staged"
    return argparse.Namespace(mu=mu, num_stages=stages, prompts_per_update=a.prompts_per_update,
                              n_samples_per_prompt=a.n_samples_per_prompt, eval_prompts=a.eval_prompts,
                              rollout_mode=mode, seed=a.seed)


def finished(save: Path) -> bool:
    from megamu.metrics import read_metrics

    return any(r["kind"] == "run" for r in read_metrics(save))


def drop_checkpoints(save: Path) -> None:
    """A finished benchmark run's checkpoints and HF exports (about 2 GB for the demo model) are not needed: the report
    reads only metrics.jsonl and the rollout manifests, which stay (--keep-checkpoints keeps everything)."""
    for path in [*save.glob("iter_*"), save / "hf"]:
        shutil.rmtree(path, ignore_errors=True)
    (save / "latest_checkpointed_iteration.txt").unlink(missing_ok=True)


def run_method(method: Method, a: argparse.Namespace, extra: list[str], shared_stage0: Path | None) -> MethodRun:
    save = a.out / method.label
    s = schedule(method, a)
    flags = [*extra, "--lr", str(a.lr), *method.flags]
    if finished(save):
        result = summarize(method.algorithm, save, s, float("nan"))
        result["wall_s"] = [r for r in result["rows"] if r["kind"] == "run"][-1]["t_total"]  # the trainer's own
        print(f"[{method.label}] finished run found in {save}: read back", flush=True)
    else:
        if save.exists() and any(save.iterdir()):
            raise SystemExit(f"bench/fidelity.py: {save} holds an unfinished run; remove it to rerun {method.label}")
        if shared_stage0 is not None and not method.low_staleness:
            shutil.copytree(shared_stage0, save / "rollouts" / "stage_0")
        print(f"[{method.label}] running: {method.algorithm} {' '.join(method.flags)} μ = {s.mu} x {s.num_stages} "
              f"stages, {s.rollout_mode}", flush=True)
        result = run_preset(method.algorithm, save, s, flags, log=a.out / f"{method.label}.log")
        if not a.keep_checkpoints:
            drop_checkpoints(save)
    return MethodRun(label=method.label, algorithm=method.algorithm, flags=method.flags, note=method.note,
                     mu=s.mu, num_stages=s.num_stages, rollout_mode=s.rollout_mode, save=save, summary=result)


def run_sweep(a: argparse.Namespace, extra: list[str]) -> None:
    """grpo-relaxed at each --sweep-lrs, evaluation off, one shared stage-0 dataset: how far π_θ drifts from β."""
    method = BY_LABEL["grpo-relaxed"]
    s = schedule(method, a)
    s.eval_prompts = 0
    saves = [a.out / f"grpo-relaxed-lr{lr:g}" for lr in a.sweep_lrs]
    shared = next((d / "rollouts" / "stage_0" for d in saves if finished(d)), None)
    for lr, save in zip(a.sweep_lrs, saves):
        if finished(save):
            print(f"[sweep lr {lr:g}] finished run found in {save}", flush=True)
        else:
            if save.exists() and any(save.iterdir()):
                raise SystemExit(f"bench/fidelity.py: {save} holds an unfinished run; remove it to rerun")
            if shared is not None:
                shutil.copytree(shared, save / "rollouts" / "stage_0")
            print(f"[sweep lr {lr:g}] running", flush=True)
            run_preset(method.algorithm, save, s, [*extra, "--lr", f"{lr:g}"], log=a.out / f"{save.name}.log")
            if not a.keep_checkpoints:
                drop_checkpoints(save)
        shared = shared or save / "rollouts" / "stage_0"


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the runs (one folder per method) and, by default, report")
    p.add_argument("--report", type=Path, default=None, help="default: OUT/fidelity.md (figures in OUT/fidelity/)")
    p.add_argument("--methods", nargs="+", choices=list(BY_LABEL), default=list(BY_LABEL))
    p.add_argument("--quick", action="store_true", help="2 updates per method (μ = 2 x 1 stage; GRPO μ = 1 x 2)")
    p.add_argument("--mu", type=int, default=12, help="updates per stage of the high-staleness methods")
    p.add_argument("--num-stages", type=int, default=1)
    p.add_argument("--low-mu", type=int, default=4, help="μ of standard GRPO")
    p.add_argument("--prompts-per-update", type=int, default=4)
    p.add_argument("--n-samples-per-prompt", type=int, default=8)
    p.add_argument("--eval-prompts", type=int, default=100, help="held-out problems for the greedy accuracy")
    p.add_argument("--lr", type=float, default=1e-4, help="the choice documented in docs/fidelity.md")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoints and HF exports")
    p.add_argument("--no-share-rollout", action="store_true", help="every staged method generates its own stage 0")
    p.add_argument("--sweep", action="store_true", help="run the learning-rate sweep into --out instead")
    p.add_argument("--sweep-lrs", type=float, nargs="+", default=[1e-4, 3e-5, 1e-5])
    p.add_argument("--sweep-dir", type=Path, default=None, help="a --sweep output to include in the report")
    p.add_argument("--notes", type=Path, default=None, help="a hand-written markdown reading, included as is")
    a, extra = p.parse_known_args(argv)
    if a.quick:
        a.mu, a.num_stages, a.low_mu = 2, 1, 1
    a.report = a.report or a.out / "fidelity.md"
    a.command = " ".join(["bench/fidelity.py", *(argv if argv is not None else sys.argv[1:])])
    a.extra = extra
    return a, extra


def main(argv: list[str] | None = None) -> None:
    a, extra = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core per run: the runs are serial and the machine is shared
    a.out.mkdir(parents=True, exist_ok=True)
    if a.sweep:
        run_sweep(a, extra)
        return
    runs: list[MethodRun] = []
    shared: Path | None = None
    for label in a.methods:
        try:
            runs.append(run_method(BY_LABEL[label], a, extra, None if a.no_share_rollout else shared))
        except SystemExit as e:  # one method's failure must not lose the others' results
            print(f"[{label}] FAILED: {e}", flush=True)
            runs.append(MethodRun.failed(BY_LABEL[label].label, str(e)[:300]))
        done = runs[-1]
        stage0 = a.out / label / "rollouts" / "stage_0"
        if shared is None and done.summary and done.rollout_mode == "staged" and (stage0 / "manifest.json").exists():
            shared = stage0
        write_report(a, runs)
    print(f"report: {a.report}", flush=True)


if __name__ == "__main__":
    main()
