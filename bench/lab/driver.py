"""The staleness lab at the paper's schedule (issue 34): 4 stages x μ = 1024, sampled pass@1, the lab model of
bench/lab (6-digit column addition), every method at the same rollout samples.

Runs ``pretrain_mu_grpo.py`` (the real trainer, local engine, the math reward on the last \\boxed{}) once per run key,
exports the policy every --eval-every updates and scores every export on the held-out problems: greedy, and k samples
at T = 1 per problem (sampled pass@1, the paper's metric). A finished run leaves one small JSON summary
(bench/lab/summary.py) in --summaries (committed: docs/fidelity-4stage/runs/); its run folder under OUT is
scratch. The run key names method, μ, stages, seed, lr and a hash of everything else that changes the run or its
evaluation (updates, τ and every flag, B_mini, G, reply length, held-out set, k, the lab model's weights sha256), so
a summary is only read back for the run it describes.

    bench/fidelity.py --plan            # the pre-registered set in order (gate, lr rule, headline, scopes, τ,
                                        # single stage), skipping every key with a summary; rewrites the report
    bench/fidelity.py --report-only     # docs/fidelity-4stage.md from the committed summaries
    bench/fidelity.py --methods grpo --mu 4 --seeds 3 --lr 3e-5    # one ad-hoc key

Two sittings may run --plan at once (one per core): a key being trained is claimed (OUT/claims/), the other takes the
next one. ``--quick`` is the suite's smoke run: a lab model of a few hundred weights built in seconds, 4 updates.
Flags this script does not know go to pretrain_mu_grpo.py unchanged (and into the key's hash).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.lab import plan
from bench.lab.model import CACHE, LabSpec, lab_model_dir
from bench.lab.report import write_report
from bench.lab.summary import load_runs, summarize, summary_path, write_summary
from bench.lab.task import write_split

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Method:
    label: str
    algorithm: str  # the --algorithm preset
    flags: tuple[str, ...] = ()  # overrides of the preset
    low: bool = False  # run at μ = --low-mu, colocated (the engine refreshed in place every μ updates)
    note: str = ""


METHODS = (
    Method("grpo", "grpo", low=True, note="standard GRPO, clip [0.8, 1.2], colocated"),
    Method("mu-grpo-mu4", "mu-grpo", low=True, note="μ-GRPO at low staleness (App. C.4), colocated"),
    Method("grpo-relaxed", "grpo-relaxed", note="clip [0, 5], no veto"),
    Method("mu-grpo", "mu-grpo", note="clip [0, 5] + veto S_seq, τ = 1e-4"),
    Method("grpo-high-staleness", "grpo-high-staleness", note="clip [0.8, 1.2], staged"),
    Method("mu-grpo-trigger", "mu-grpo", ("--nav-scope", "trigger"), note="clip [0, 5] + veto T (trigger tokens)"),
    Method("mu-grpo-nontrigger-suffix", "mu-grpo", ("--nav-scope", "nontrigger_suffix"), note="clip [0, 5] + veto H_κ"),
    Method("mu-grpo-suffix", "mu-grpo", ("--nav-scope", "suffix"), note="clip [0, 5] + veto S_κ"),
    Method("mu-grpo-tau1e-2", "mu-grpo", ("--nav-threshold", "1e-2"), note="veto S_seq, τ = 1e-2"),
    Method("mu-grpo-tau1e-6", "mu-grpo", ("--nav-threshold", "1e-6"), note="veto S_seq, τ = 1e-6"),
    # τ of the veto-rate rule (plan.tau_by_veto_rate, issue 42), fixed before its runs
    Method("mu-grpo-tau3e-3", "mu-grpo", ("--nav-threshold", "3e-3"), note="veto S_seq, τ = 3e-3 (veto-rate rule)"),
    Method("m2po", "m2po", note="no upper clip, second-moment mask 0.04"),
)
BY_LABEL = {m.label: m for m in METHODS}
QUICK_SPEC = LabSpec(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, digits=4, max_steps=2, eval_every=1, probe_from=0, probe_problems=4,
                     target_accuracy=0.0)


@dataclass(frozen=True)
class RunKey:
    method: Method
    mu: int
    seed: int
    lr: float
    updates: int
    prompts: int | None = None  # prompts per update (B_mini / G); None: --prompts-per-update
    tag: str = ""  # a run of a registered arm that must not be read back from an older sitting's (e.g. "timed")
    every: int | None = None  # updates between evaluations, fixed by the arm (round three); None: --eval-every scaled

    @property
    def stages(self) -> int:
        return self.updates // self.mu

    def prompts_per_update(self, a: argparse.Namespace) -> int:
        return self.prompts or a.prompts_per_update

    def eval_every(self, a: argparse.Namespace) -> int:
        """--eval-every scaled to this key's updates: every run is evaluated at the same rollout samples."""
        if self.every:
            return self.every
        return max(a.eval_every * self.updates // a.updates, 1)

    def config(self, a: argparse.Namespace) -> dict:
        """Everything that changes the run or its evaluation: the key's hash covers all of it."""
        m = self.method
        return {"method": m.label, "algorithm": m.algorithm, "flags": list(m.flags), "mu": self.mu,
                "stages": self.stages, "updates": self.updates, "seed": self.seed, "lr": self.lr,
                "mode": "colocated" if m.low else "staged", "prompts_per_update": self.prompts_per_update(a),
                "n_samples_per_prompt": a.n_samples_per_prompt, "max_response_len": a.max_response_len,
                "extra": list(a.extra), "train_problems": a.train_problems, "held_out": a.held_out,
                "k": a.k, "eval_every": self.eval_every(a), "lab_model": a.lab,
                **({"tag": self.tag} if self.tag else {})}

    def name(self, a: argparse.Namespace) -> str:
        h = hashlib.sha256(json.dumps(self.config(a), sort_keys=True).encode()).hexdigest()[:8]
        b = f"-b{self.prompts}" if self.prompts and self.prompts != a.prompts_per_update else ""
        t = f"-{self.tag}" if self.tag else ""
        return f"{self.method.label}/mu{self.mu}x{self.stages}{b}{t}-s{self.seed}-lr{self.lr:g}-{h}"


def key_of(a: argparse.Namespace, label: str, seed: int, lr: float, mu: int | None = None,
           prompts: int | None = None, updates: int | None = None, tag: str = "", every: int | None = None) -> RunKey:
    """The key of ``label`` at ``seed`` and ``lr``: μ = --low-mu for the colocated methods, else ``mu`` or --mu;
    ``prompts`` per update and ``updates`` default to the flags'."""
    method = BY_LABEL[label]
    return RunKey(method, mu or (a.low_mu if method.low else a.mu[0]), seed, lr, updates or a.updates, prompts, tag,
                  every)


def train(a: argparse.Namespace, key: RunKey) -> dict:
    name = key.name(a)
    save = a.out / "runs" / name
    if save.exists():  # half-finished: the trainer would resume, but the exports of the old part may be gone
        shutil.rmtree(save)
    save.mkdir(parents=True)
    m = key.method
    mode = "colocated" if m.low else "staged"
    cmd = [sys.executable, str(REPO / "pretrain_mu_grpo.py"), "--algorithm", m.algorithm, *m.flags,
           "--hf-checkpoint", str(a.model), "--prompt-data", str(a.train_file), "--save", str(save),
           "--mu", str(key.mu), "--num-stages", str(key.stages), "--prompts-per-update", str(key.prompts_per_update(a)),
           "--n-samples-per-prompt", str(a.n_samples_per_prompt), "--rollout-mode", mode, "--seed", str(key.seed),
           "--lr", f"{key.lr:g}", "--eval-prompts", "0", "--hf-export-interval", str(key.eval_every(a)),
           "--rollout-max-response-len", str(a.max_response_len), "--save-interval", "0", "--keep-checkpoints", "1",
           "--keep-hf-exports", "0",  # every export is scored (then dropped by this bench)
           # the local engine decodes 256 rows at once: 2x the samples/s of its default 128 on this model (measured)
           "--local-engine-batch-size", "256", "--rollout-groups-per-shard", "64",
           *a.extra]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    print(f"[{name}] {m.algorithm} {' '.join(m.flags)} μ = {key.mu} x {key.stages} stages, {mode}", flush=True)
    t0 = time.perf_counter()
    with (save / "trainer.log").open("w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = (save / "trainer.log").read_text()[-3000:]
        raise RuntimeError(f"{name}: pretrain_mu_grpo.py failed ({rc}):\n{tail}")
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    exports = sorted((save / "hf").glob("iter_*"), key=lambda p: int(p.name.split("_")[1]))
    evals = [base_eval(a)] + [evaluate(a, d, int(d.name.split("_")[1])) for d in exports]
    summary = summarize(save, name, key.config(a), evals,
                        {"train_s": round(train_s, 1), "eval_s": round(time.perf_counter() - t0, 1)})
    for path in [*save.glob("iter_*"), save / "hf"]:
        shutil.rmtree(path, ignore_errors=True)
    write_summary(a.summaries, summary)
    return summary


def evaluate(a: argparse.Namespace, hf_dir: Path, update: int) -> dict:
    """Greedy and sampled (T = 1, k per problem, a fixed seed for every export) accuracy on the held-out rows."""
    from bench.lab.evaluate import accuracy, load, sampled_pass_at_1
    from bench.lab.task import read_rows

    rows = read_rows(a.held_out_file)
    model, tok = load(hf_dir)
    g = accuracy(model, tok, rows, greedy=True, max_new_tokens=a.max_response_len)
    s = sampled_pass_at_1(model, tok, rows, a.k, seed=0, max_new_tokens=a.max_response_len)
    return {"update": update, "n": g.n, "k": a.k, "sampled": s.accuracy, "greedy": g.accuracy,
            "sampled_mean_length": round(s.mean_length, 2), "sampled_truncated": s.truncated,
            "greedy_truncated": g.truncated}


def base_eval(a: argparse.Namespace) -> dict:
    """The lab model's own scores: the same for every run of one model and held-out set, so scored once."""
    h = hashlib.sha256(json.dumps([a.lab, a.held_out, a.k, a.max_response_len]).encode()).hexdigest()[:8]
    path = a.out / f"base_eval-{h}.json"
    if not path.exists():
        path.write_text(json.dumps(evaluate(a, a.model, 0)))
    return json.loads(path.read_text())


def claim(a: argparse.Namespace, name: str) -> bool:
    """Take ``name`` for this process unless a live one holds it (two sittings, one per core, share OUT)."""
    d = a.out / "claims"
    d.mkdir(parents=True, exist_ok=True)
    path = d / name.replace("/", "__")
    try:
        pid = int(path.read_text())
        os.kill(pid, 0)
        return pid == os.getpid()
    except (FileNotFoundError, ValueError, ProcessLookupError):
        path.write_text(str(os.getpid()))
        return int(path.read_text()) == os.getpid()


def run_one(a: argparse.Namespace, key: RunKey) -> bool:
    """Train ``key`` unless its summary exists or another process holds it; True when it was trained."""
    name = key.name(a)
    if summary_path(a.summaries, name).exists():
        print(f"[{name}] finished run found: read back", flush=True)
        return False
    if not claim(a, name):
        print(f"[{name}] being trained by another process: skipped", flush=True)
        return False
    try:
        train(a, key)
    except RuntimeError as e:  # one run's failure must not lose the others' results
        print(f"[{name}] FAILED: {e}", flush=True)
        a.failed.add(name)  # not retried by this process's --plan loop
    try:
        write_report(a, load_runs(a.summaries))
    except Exception as e:  # noqa: BLE001 (the report is regenerated with --report-only; the runs go on)
        print(f"report not written: {type(e).__name__}: {e}", flush=True)
    return True


def lab_of(build: dict) -> dict:
    """What a run key records of its lab model (from the model's lab_build.json)."""
    spec = LabSpec(**build["spec"])
    return {"spec": spec.key(), "digits": spec.digits, "weights_sha256": build["weights_sha256"]}


def check_tau_rule(a: argparse.Namespace) -> None:
    """The τ arm's method must carry the τ the registered rule gives on round one's set (plan)."""
    tau, how = plan.tau_by_veto_rate([r for r in load_runs(a.summaries) if r.lab_model == a.round1_lab])
    flags = BY_LABEL[plan.TAU_RULE_METHOD].flags
    if flags[0] != "--nav-threshold" or float(flags[1]) != tau:
        raise SystemExit(f"bench/fidelity.py: the τ rule gives {tau:g} ({how}), but {plan.TAU_RULE_METHOD} runs with "
                         f"{' '.join(flags)}")
    print(f"τ rule: {how}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "fidelity4", help="run folders (scratch)")
    p.add_argument("--summaries", type=Path, default=None, help="default docs/fidelity-4stage/runs (committed)")
    p.add_argument("--report", type=Path, default=None, help="default docs/fidelity-4stage.md")
    p.add_argument("--plan", action="store_true", help="the pre-registered run set, in order (bench/lab/plan.py)")
    p.add_argument("--round2", action="store_true",
                   help="issue 42's registered arms (plan.ARMS) in their order, like --plan")
    p.add_argument("--round3", action="store_true",
                   help="issue 51's registered runs (plan.ROUND3_ORDER) in their order, like --plan")
    p.add_argument("--arms", nargs="+", default=None, choices=[arm.name for arm in plan.ARMS + plan.ARMS3],
                   help="with --round2/--round3: only these arms, in the registered order (default: all)")
    p.add_argument("--until", default=None, help="HH:MM UTC: --plan starts no run after this time")
    p.add_argument("--max-runs", type=int, default=None, help="--plan trains at most this many runs")
    p.add_argument("--methods", nargs="+", choices=list(BY_LABEL), default=[])
    p.add_argument("--mu", type=int, nargs="+", default=[1024], help="μ of the staged methods")
    p.add_argument("--low-mu", type=int, default=4, help="μ of grpo and mu-grpo-mu4")
    p.add_argument("--updates", type=int, default=4096, help="updates per run (stages = updates / μ)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--lr", type=float, default=None,
                   help="ad-hoc runs: their lr; with --plan, the set's lr when the registered rule found none")
    p.add_argument("--prompts-per-update", type=int, default=2)
    p.add_argument("--n-samples-per-prompt", type=int, default=8)
    p.add_argument("--max-response-len", type=int, default=None, help="default: the lab model's longest reply + 8")
    p.add_argument("--eval-every", type=int, default=None, help="updates between evaluations (default /16)")
    p.add_argument("--held-out", type=int, default=128, help="held-out problems")
    p.add_argument("--k", type=int, default=4, help="samples per held-out problem (sampled pass@1)")
    p.add_argument("--train-problems", type=int, default=20000)
    p.add_argument("--lab-cache", type=Path, default=CACHE, help="where the lab model is built and cached")
    p.add_argument("--lab-build", action="store_true",
                   help="build the lab model from scratch instead of using the shipped reference weights (its bytes "
                        "depend on the CPU; its runs get their own keys)")
    p.add_argument("--quick", action="store_true", help="the suite's smoke run: a few-hundred-weight model, 4 updates")
    p.add_argument("--report-only", action="store_true", help="train nothing: the report from the summaries")
    p.add_argument("--notes", type=Path, default=None,
                   help="hand-written markdown included in the report as is (default: reading.md beside --summaries)")
    a, extra = p.parse_known_args(argv)
    if a.quick:
        a.mu, a.low_mu, a.updates, a.held_out, a.train_problems, a.k = [2], 1, 4, 8, 64, 2
        a.eval_every, a.max_response_len = a.eval_every or 2, a.max_response_len or 16
    a.spec = QUICK_SPEC if a.quick else LabSpec()
    a.max_response_len = a.max_response_len or a.spec.max_new_tokens
    a.eval_every = a.eval_every or max(a.updates // 16, 1)
    a.summaries = a.summaries or (a.out / "summaries" if a.quick else REPO / "docs" / "fidelity-4stage" / "runs")
    a.report = a.report or (a.out / "fidelity.md" if a.quick else REPO / "docs" / "fidelity-4stage.md")
    if a.notes is None and (a.summaries.parent / "reading.md").exists():  # the hand-written reading, committed
        a.notes = a.summaries.parent / "reading.md"
    a.command = " ".join(["bench/fidelity.py", *(argv if argv is not None else sys.argv[1:])])
    a.extra = extra
    a.failed = set()
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    a.key_of = functools.partial(key_of, a)
    a.model = lab_model_dir(a.spec, a.lab_cache, build=a.lab_build)  # the shipped weights: found, not built
    a.build = json.loads((a.model / "lab_build.json").read_text())
    a.lab = lab_of(a.build)
    # round one's model (issue 34), recorded beside the summaries by its first sitting: the committed set's runs
    # are read on it, round two's (issue 42) on a.lab
    record = a.summaries.parent / "lab_build.json"
    if not record.exists():
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(a.build, indent=1))
    a.round1_build = json.loads(record.read_text())
    a.round1_lab = lab_of(a.round1_build)
    a.train_file, a.held_out_file = write_split(a.out / f"data-{a.spec.digits}d", a.train_problems, a.held_out,
                                                seed=a.spec.seed + 1, digits=a.spec.digits)
    if a.report_only:
        pass
    elif a.plan or a.round2 or a.round3:
        if a.round2:
            check_tau_rule(a)
        next_keys = plan.round3_keys if a.round3 else plan.round2_keys if a.round2 else plan.next_keys
        trained = 0
        while a.max_runs is None or trained < a.max_runs:
            if a.until and time.strftime("%H:%M", time.gmtime()) >= a.until:
                print(f"--until {a.until}: no new run", flush=True)
                break
            todo = [k for k in next_keys(a, [r for r in load_runs(a.summaries) if r.lab_model == a.lab])
                    if k.name(a) not in a.failed]
            if not todo or not any(run_one(a, k) for k in todo[:1] + todo[1:2]):
                print("plan: nothing left to start (finished, claimed, or waiting on a rule)", flush=True)
                break
            trained += 1
    else:
        if a.lr is None:
            raise SystemExit("bench/fidelity.py: pass --lr (or --plan, which follows the pre-registered lr rule)")
        for seed in a.seeds:
            for label in a.methods:
                for mu in ([a.low_mu] if BY_LABEL[label].low else a.mu):
                    run_one(a, RunKey(BY_LABEL[label], mu, seed, a.lr, a.updates))
    write_report(a, load_runs(a.summaries))
    print(f"summaries: {a.summaries}; report: {a.report}", flush=True)
