"""The paper's Figures 2-3 at the paper's staleness, on the lab model (megamu/lab): every method, same samples.

Runs ``pretrain_mu_grpo.py`` (the real trainer, local engine, the math reward on the last \\boxed{}) on the lab model
and the lab task (column-by-column addition, megamu/lab/task.py), one run per (method, μ, seed), all with the same lr,
B_mini, G, total updates and so the same rollout samples:

- ``grpo`` at μ = --low-mu, colocated (standard GRPO), and ``mu-grpo-mu4``: μ-GRPO at μ = --low-mu (App. C.4);
- at each μ of --mu, staged, --updates / μ stages: ``grpo-high-staleness`` (clip [0.8, 1.2]), ``grpo-relaxed``
  (clip [0, 5], no veto), ``mu-grpo`` (S_seq, τ = 1e-4), ``m2po`` (0.04), and μ-GRPO with the veto scopes
  ``mu-grpo-trigger`` (T), ``mu-grpo-nontrigger-suffix`` (H_κ) and ``mu-grpo-suffix`` (S_κ) (§3.3, App. C.2).

Each run exports its policy every --eval-every updates; the bench scores every export on the held-out problems with
greedy decoding (megamu/lab/evaluate.py), then deletes the exports and checkpoints. A run whose folder holds a finished
run and its evaluation is read back, not rerun, so seeds and staleness points can be added over several sittings.
``OUT/summary.json`` has one row per run; the report (``--report``, default OUT/fidelity.md) is rewritten after each.

What docs/fidelity.md ran (OUT = runs/fidelity; one run of 1024 updates took 3-8 min on one core):

    bench/fidelity.py --sweep --out OUT --mu 256 --sweep-lrs 3e-4 1e-4 3e-5   # the lr rule: grpo at μ = --low-mu
    bench/fidelity.py --out OUT --sweep-dir OUT --mu 256                      # the headline set at the rule's lr
    bench/fidelity.py --out OUT --sweep-dir OUT --mu 256 --seeds 2 3 --methods grpo grpo-relaxed mu-grpo
    # lr 3e-5, outside the rule (--updates 1024 keeps the samples of the runs above; μ = 1024 is one stage):
    bench/fidelity.py --out OUT --lr 3e-5 --updates 1024 --mu 64 256 1024 \
        --methods grpo-relaxed mu-grpo grpo-high-staleness
    bench/fidelity.py --out OUT --lr 3e-5 --updates 1024 --mu 256 --methods mu-grpo-trigger mu-grpo-suffix
    bench/fidelity.py --out OUT --lr 3e-5 --updates 1024 --mu 1024 \
        --methods mu-grpo-trigger mu-grpo-suffix mu-grpo-nontrigger-suffix m2po
    bench/fidelity.py --out OUT --lr 3e-5 --updates 1024 --mu 1024 --seeds 2 3 --methods grpo grpo-relaxed mu-grpo
    bench/fidelity.py --out OUT --sweep-dir OUT --mu 256 --updates 1024 --report-only --report docs/fidelity.md \
        --notes docs/fidelity/reading.md

Two sittings may share OUT, one per core: each rereads every finished run when it writes the summary and report.

``--quick`` is the smoke run of the suite: a lab model of a few hundred weights built in seconds, 4 updates per run.
Flags this script does not know go to pretrain_mu_grpo.py unchanged. Runs are serial; each trainer gets one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from fidelity_report import RunResult, summary_rows, write_report  # noqa: E402

from megamu.lab.model import CACHE, LabSpec, lab_model_dir  # noqa: E402
from megamu.lab.task import write_split  # noqa: E402


@dataclass(frozen=True)
class Method:
    label: str
    algorithm: str  # the --algorithm preset
    flags: tuple[str, ...] = ()  # overrides of the preset
    low: bool = False  # run at μ = --low-mu, colocated (the engine refreshed in place every μ updates)
    note: str = ""


# In run order: the reference, the collapse ablation and its cure first, so that a sitting stopped early has answered
# the main question.
METHODS = (
    Method("grpo", "grpo", low=True, note="standard GRPO, clip [0.8, 1.2], colocated"),
    Method("grpo-relaxed", "grpo-relaxed", note="clip [0, 5], no veto"),
    Method("mu-grpo", "mu-grpo", note="clip [0, 5] + veto S_seq, τ = 1e-4"),
    Method("grpo-high-staleness", "grpo-high-staleness", note="clip [0.8, 1.2], staged"),
    Method("mu-grpo-trigger", "mu-grpo", ("--nav-scope", "trigger"), note="clip [0, 5] + veto T (trigger tokens)"),
    Method("mu-grpo-nontrigger-suffix", "mu-grpo", ("--nav-scope", "nontrigger_suffix"), note="clip [0, 5] + veto H_κ"),
    Method("mu-grpo-suffix", "mu-grpo", ("--nav-scope", "suffix"), note="clip [0, 5] + veto S_κ"),
    Method("m2po", "m2po", note="no upper clip, second-moment mask 0.04"),
    Method("mu-grpo-mu4", "mu-grpo", low=True, note="μ-GRPO at low staleness (App. C.4), colocated"),
)
BY_LABEL = {m.label: m for m in METHODS}
QUICK_SPEC = LabSpec(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, max_steps=2, eval_every=1, probe_problems=4, target_accuracy=0.0)


@dataclass(frozen=True)
class RunKey:
    method: Method
    mu: int
    seed: int
    lr: float

    @property
    def name(self) -> str:
        return f"{self.method.label}/mu{self.mu}-s{self.seed}-lr{self.lr:g}"


def run_dir(a: argparse.Namespace, key: RunKey) -> Path:
    return a.out / "runs" / key.name


def is_done(save: Path) -> bool:
    """Finished and evaluated: the bench writes lab_eval.json last, after the trainer's final record."""
    return (save / "lab_eval.json").exists()


def train(a: argparse.Namespace, key: RunKey, model: Path, train_file: Path) -> None:
    save = run_dir(a, key)
    if save.exists():  # half-finished: the trainer would resume, but the exports of the old part may be gone
        shutil.rmtree(save)
    save.mkdir(parents=True)
    m = key.method
    stages, mode = a.updates // key.mu, ("colocated" if m.low else "staged")
    cmd = [sys.executable, str(REPO / "pretrain_mu_grpo.py"), "--algorithm", m.algorithm, *m.flags,
           "--hf-checkpoint", str(model), "--prompt-data", str(train_file), "--save", str(save),
           "--mu", str(key.mu), "--num-stages", str(stages), "--prompts-per-update", str(a.prompts_per_update),
           "--n-samples-per-prompt", str(a.n_samples_per_prompt), "--rollout-mode", mode, "--seed", str(key.seed),
           "--lr", f"{key.lr:g}", "--eval-prompts", "0", "--hf-export-interval", str(a.eval_every),
           "--rollout-max-response-len", str(a.max_response_len), "--save-interval", "0", "--keep-checkpoints", "1",
           "--keep-hf-exports", "0",  # every export is scored (then dropped by this bench)
           # the local engine decodes 256 rows at once: 2x the samples/s of its default 128 on this model (measured)
           "--rollout-batch-size", "256", "--rollout-groups-per-shard", "64",
           *a.extra]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    print(f"[{key.name}] {m.algorithm} {' '.join(m.flags)} μ = {key.mu} x {stages} stages, {mode}", flush=True)
    t0 = time.perf_counter()
    with (save / "trainer.log").open("w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = (save / "trainer.log").read_text()[-3000:]
        raise RuntimeError(f"{key.name}: pretrain_mu_grpo.py failed ({rc}):\n{tail}")
    evaluate(a, key, model, time.perf_counter() - t0)


def evaluate(a: argparse.Namespace, key: RunKey, model: Path, train_s: float) -> None:
    """Greedy held-out accuracy of the base model and of every export, then the exports and checkpoints go."""
    from megamu.lab.evaluate import accuracy, load
    from megamu.lab.task import read_rows

    save = run_dir(a, key)
    rows = read_rows(a.held_out)
    base = a.out / "base_eval.json"
    if not base.exists():  # the same model and problems for every run: scored once
        m, tok = load(model)
        base.write_text(json.dumps(accuracy(m, tok, rows, greedy=True, max_new_tokens=a.max_response_len).to_json()))
    points = [{"update": 0, **json.loads(base.read_text())}]
    t0 = time.perf_counter()
    for d in sorted((save / "hf").glob("iter_*"), key=lambda p: int(p.name.split("_")[1])):
        m, tok = load(d)
        acc = accuracy(m, tok, rows, greedy=True, max_new_tokens=a.max_response_len)
        points.append({"update": int(d.name.split("_")[1]), **acc.to_json()})
    record = {"method": key.method.label, "algorithm": key.method.algorithm, "flags": list(key.method.flags),
              "mu": key.mu, "seed": key.seed, "lr": key.lr, "updates": a.updates,
              "stages": a.updates // key.mu, "prompts_per_update": a.prompts_per_update,
              "n_samples_per_prompt": a.n_samples_per_prompt, "max_response_len": a.max_response_len,
              "train_s": round(train_s, 1), "eval_s": round(time.perf_counter() - t0, 1), "evals": points}
    for path in [*save.glob("iter_*"), save / "hf"]:
        shutil.rmtree(path, ignore_errors=True)
    (save / "lab_eval.json").write_text(json.dumps(record, indent=1))


def run_all(a: argparse.Namespace, keys: list[RunKey], model: Path, train_file: Path) -> None:
    for key in keys:
        save = run_dir(a, key)
        if is_done(save):
            print(f"[{key.name}] finished run found: read back", flush=True)
        else:
            try:
                train(a, key, model, train_file)
            except RuntimeError as e:  # one run's failure must not lose the others' results
                print(f"[{key.name}] FAILED: {e}", flush=True)
                continue
        write_outputs(a)


def write_outputs(a: argparse.Namespace) -> None:
    """summary.json over every finished run under OUT (not only this invocation's), then the report."""
    everything = [RunResult.load(d.parent, "") for d in sorted((a.out / "runs").glob("*/*/lab_eval.json"))]
    notes = {m.label: m.note for m in METHODS}
    for r in everything:
        r.note = notes.get(r.method, "")
    (a.out / "summary.json").write_text(json.dumps(summary_rows(everything), indent=1))
    if not a.sweep:
        write_report(a, everything)


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="runs, summary.json and (by default) the report")
    p.add_argument("--report", type=Path, default=None, help="default: OUT/fidelity.md (figures in OUT/fidelity/)")
    p.add_argument("--methods", nargs="+", choices=list(BY_LABEL), default=list(BY_LABEL))
    p.add_argument("--mu", type=int, nargs="+", default=[256], help="μ of the staged methods (several: the curve)")
    p.add_argument("--low-mu", type=int, default=4, help="μ of grpo and mu-grpo-mu4")
    p.add_argument("--updates", type=int, default=None, help="updates per run (default 4 x the largest --mu)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--lr", type=float, default=None, help="the sweep's choice (default: read from --sweep-dir)")
    p.add_argument("--prompts-per-update", type=int, default=2)
    p.add_argument("--n-samples-per-prompt", type=int, default=8)
    p.add_argument("--max-response-len", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=None, help="updates between held-out evaluations (default /16)")
    p.add_argument("--held-out", type=int, default=200, help="held-out problems (greedy accuracy)")
    p.add_argument("--train-problems", type=int, default=20000)
    p.add_argument("--lab-cache", type=Path, default=CACHE, help="where the lab model is built and cached")
    p.add_argument("--quick", action="store_true", help="the suite's smoke run: a few-hundred-weight model, 4 updates")
    p.add_argument("--sweep", action="store_true", help="the lr sweep: grpo at μ = --low-mu, at each --sweep-lrs")
    p.add_argument("--sweep-lrs", type=float, nargs="+", default=[3e-5, 1e-4, 3e-4, 1e-3])
    p.add_argument("--sweep-dir", type=Path, default=None, help="a --sweep --out folder: its table and its lr")
    p.add_argument("--report-only", action="store_true", help="train nothing: the report from the finished runs")
    p.add_argument("--notes", type=Path, default=None, help="hand-written markdown included in the report as is")
    a, extra = p.parse_known_args(argv)
    if a.quick:
        a.mu, a.low_mu, a.updates, a.held_out, a.train_problems = [2], 1, 4, 8, 64
        a.eval_every, a.max_response_len = a.eval_every or 2, min(a.max_response_len, 16)
    a.updates = a.updates or 4 * max(a.mu)
    a.eval_every = a.eval_every or max(a.updates // 16, 1)
    for mu in [*a.mu, a.low_mu]:
        if a.updates % mu:
            p.error(f"--updates {a.updates} must be a multiple of every μ (got {mu})")
    a.report = a.report or a.out / "fidelity.md"
    a.command = " ".join(["bench/fidelity.py", *(argv if argv is not None else sys.argv[1:])])
    a.extra = extra
    return a, extra


def chosen_lr(sweep_dir: Path) -> float:
    from fidelity_report import sweep_choice

    lr = sweep_choice([RunResult.load(d.parent, "") for d in sweep_dir.glob("runs/*/*/lab_eval.json")])
    if lr is None:
        raise SystemExit(f"bench/fidelity.py: no swept lr in {sweep_dir} passes the rule; pass --lr")
    return lr


def main(argv: list[str] | None = None) -> None:
    a, _ = parse(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    spec = QUICK_SPEC if a.quick else LabSpec()
    model = a.model = lab_model_dir(spec, a.lab_cache)
    train_file, a.held_out = write_split(a.out / "data", a.train_problems, a.held_out, seed=spec.seed + 1,
                                         digits=spec.digits)
    if a.sweep:
        keys = [RunKey(BY_LABEL["grpo"], a.low_mu, a.seeds[0], lr) for lr in a.sweep_lrs]
    else:
        if a.lr is None:
            if a.sweep_dir is None:
                raise SystemExit("bench/fidelity.py: pass --lr, or --sweep-dir to take the sweep's choice")
            a.lr = chosen_lr(a.sweep_dir)
        keys = [RunKey(BY_LABEL[label], mu, seed, a.lr) for seed in a.seeds for label in a.methods
                for mu in ([a.low_mu] if BY_LABEL[label].low else a.mu)]
    if a.report_only:
        write_outputs(a)
    else:
        run_all(a, keys, model, train_file)
    print(f"summary: {a.out / 'summary.json'}" + ("" if a.sweep else f"; report: {a.report}"), flush=True)


if __name__ == "__main__":
    main()
