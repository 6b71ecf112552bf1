"""GPU acceptance check: one command, at most ~8 minutes on one H200, on the lent machine's stock image.

    bash tools/gpu_wheels.sh                 # here, once: megatron-core, math-verify, pyarrow wheels into .whl/
    python tools/gpu_check.py                # there: installs .whl/ offline if needed, runs, prints one table
    python tools/gpu_check.py --dry-run      # anywhere: the same checks on the CPU with a tiny model (make test)

Checks, on a random Qwen2-shaped model (~0.5B: Qwen2.5-0.5B's shape; tiny with --dry-run):
  train     bf16 update at TP=1 with megatron DDP + DistributedOptimizer: tokens/s and MFU (6 N flops per token
            against the H200's dense bf16 peak; attention flops not counted, so MFU is a lower bound)
  offload   --offload-train's hand-off: the device memory the trainer's tensors held is freed, and comes back bitwise
  checkpoint save and load into a fresh model: weights and Adam moments bitwise; size on disk
  plan ...  the memory plan against measured peaks, buckets: push-bucket allocation, ep-agree: EP micro-batch
            agreement at EP = 1 (tools/gpu_check_path.py says what each proves)
  stage     pretrain_mu_grpo.py, one μ-GRPO stage of 2 updates, in-process engine, end to end
  logprobs  megamu's local spec (bf16) against transformers' log-probs, same weights, 2 layers of Qwen3-4B's config;
            te: TE's spec against the local spec (where TE imports); reshard: the checkpoint row's torch_dist save
            loaded at TP 2 (CPU gloo), bitwise; ipc: tests/gpu/test_colocated_handoff.py; server: a CUDA IPC push into
            a real SGLang server, probed before and after (where SGLang is) -- tools/gpu_check_rows.py
Every row's verdict is a function of CPU tensors (tools/gpu_check_compare.py), tested with planted defects. The plan
rows also measure the activation and logits terms; --measured-peaks PATH writes them for a launch's --measured-peaks.
The train row fails below an MFU floor (gpu_check_compare.MFU_FLOOR). transformer-engine and SGLang are not on the
stock image: their rows skip with the reason there. Exit status 1 when a check fails; the table also goes to --out.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.gpu_check_compare import Row, compare_bitwise, compare_peaks, mfu_verdict, size  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA H200 SXM datasheet, dense (no sparsity)
NEEDED = ("megatron.core", "math_verify", "pyarrow")
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096)


CHECKS = ("train", "offload", "checkpoint", "reshard", "plan", "buckets", "ep-agree", "logprobs", "ipc", "server",
          "stage")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model: check the script itself")
    p.add_argument("--wheels", default=str(REPO / ".whl"), help="folder of wheels to install offline if missing")
    p.add_argument("--steps", type=int, default=None, help="timed training steps (default 5; 2 with --dry-run)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 2048; 48 with --dry-run)")
    p.add_argument("--samples", type=int, default=32, help="samples per update (groups of 8)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--only", nargs="+", choices=CHECKS, default=None)
    p.add_argument("--out", default=None, help="JSON report path (default: a temp file)")
    p.add_argument("--measured-peaks", default=None, help=(
        "write the activation and logits peaks the plan rows measured (GPU) to this file, for a launch's "
        "--measured-peaks"))
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.dry_run else 5)
    args.seq_len = args.seq_len or (48 if args.dry_run else 2048)
    if args.samples % 8 or args.samples <= 0:
        p.error(f"--samples must be a positive multiple of 8 (groups of 8), got {args.samples}")
    if args.seq_len < 16:
        p.error(f"--seq-len must be >= 16, got {args.seq_len}")
    return args


def ensure_wheels(folder: str) -> list[str]:
    """Install the wheels in ``folder`` (offline, no dependency resolution) when a needed module is missing."""
    missing = [m for m in NEEDED if importlib.util.find_spec(m.split(".")[0]) is None]
    if not missing:
        return []
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    if not wheels:
        raise SystemExit(f"gpu_check: {missing} not installed and no wheels in {folder}; run tools/gpu_wheels.sh")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *wheels], check=True)
    return missing


def synthetic_samples(n: int, seq_len: int, vocab: int, seed: int):
    """``n`` samples in groups of 8: a quarter of each sequence is prompt, advantages ±1 within each group."""
    import torch

    from megamu.rollout.records import RolloutSample

    g = torch.Generator().manual_seed(seed)
    prompt_len = seq_len // 4
    out = []
    for i in range(n // 8):
        prompt = torch.randint(4, vocab, (prompt_len,), generator=g).tolist()
        for j in range(8):
            resp = torch.randint(4, vocab, (seq_len - prompt_len,), generator=g).tolist()
            out.append(RolloutSample(i, j, prompt, resp, [0.0] * len(resp), float(j % 2), 1.0 if j % 2 else -1.0,
                                     "length"))
    return out


def model_config(args):
    from tests.tiny import tiny_hf_config

    return tiny_hf_config("qwen2") if args.dry_run else tiny_hf_config("qwen2", **QWEN2_05B)


def verdict_row(check: str, ok: bool | None, verdict: str, detail: str = "") -> Row:
    """A row from a (ok, verdict) of tools/gpu_check_compare.py or gpu_check_rows.py: ok None is a skip."""
    return Row(check, bool(ok), verdict, detail, skipped=ok is None)


def check_reshard(args, root: Path) -> Row:
    """The checkpoint row's save (on CUDA at TP 1) loaded at TP 2 in a CPU gloo world, against the saving model."""
    from tools.gpu_check_rows import reshard_check

    hf = root / "config"
    model_config(args).save_pretrained(hf)
    return verdict_row("reshard", *reshard_check(root / "ckpt", hf, args.saved_weights, root / "reshard.pt"))


def logprob_rows(cuda: bool, root: Path) -> list[Row]:
    """megamu against transformers (local spec) and TE against local, on 2 layers of Qwen3-4B's config (GPU) or a
    tiny Qwen3 (CPU)."""
    from tests.tiny import save_tiny_model
    from tools import gpu_check_rows as rows

    hf = rows.write_real_config_model(root / "real") if cuda else save_tiny_model(root / "tiny-qwen3", "qwen3", 1)
    what = "2 layers of Qwen3-4B's config, bf16" if cuda else "tiny Qwen3, fp32 (CPU)"
    return [verdict_row("logprobs", *rows.logprobs_check(hf, cuda), what),
            verdict_row("te", *rows.te_check(hf, cuda), what)]


def build(args, cuda: bool):
    from megamu.model import ModelArch, build_model
    from megamu.runtime.device import Device
    from megamu.training import OptimizerConfig, build_optimizer

    config = model_config(args)
    arch = ModelArch.from_hf(config)
    device = Device("cuda" if cuda else "cpu")
    # the local spec (torch SDPA): transformer-engine is not on the stock image
    model = build_model(arch, device=device, transformer_impl="local", bf16=cuda)
    return model, arch, build_optimizer(model, OptimizerConfig(lr=1e-6), device)


def sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def check_train(args, cuda, model, arch, opt) -> Row:
    from megamu.algo import ALGORITHM_PRESETS
    from megamu.training import compute_logprobs, train_step

    samples = synthetic_samples(args.samples, args.seq_len, arch.vocab_size, seed=0)
    for s, lp in zip(samples, compute_logprobs(model, samples, micro_batch_size=args.micro_batch_size)):
        s.behaviour_logprobs = lp  # θ = β: ratios start at 1, as at a stage's first update
    algo = ALGORITHM_PRESETS["mu-grpo"]
    step = lambda: train_step(model, opt, samples, algo, micro_batch_size=args.micro_batch_size)
    first = step()  # warm-up (allocations, Adam state)
    sync(cuda)
    start = time.perf_counter()
    stats = [step() for _ in range(args.steps)]
    sync(cuda)
    seconds = (time.perf_counter() - start) / args.steps
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    n_params = sum(p.numel() for p in model.parameters())
    tok_s = tokens / seconds
    mfu = 6 * n_params * tok_s / (H200_BF16_DENSE_TFLOPS * 1e12)
    fast, speed = mfu_verdict(mfu) if cuda else (True, "(CPU: no MFU floor)")
    ok = abs(first["ratio_mean"] - 1) < 0.05 and all(s["loss"] == s["loss"] for s in stats) \
        and not opt.skipped_steps and fast
    return Row("train", ok, f"{tok_s:,.0f} tok/s, {speed}" if cuda else f"{tok_s:,.0f} tok/s {speed}",
               f"{n_params / 1e6:.0f}M params, {tokens} tokens/update, {seconds:.2f} s/update, first ratio_mean "
               f"{first['ratio_mean']:.4f}, skipped {opt.skipped_steps}")


def check_context(cuda: bool) -> Row:
    """What this process holds on the card outside torch's caching allocator (CUDA context, cuBLAS/cuDNN handles)
    against the plan's per-process row (CUDA_CONTEXT_GIB, which also covers NCCL's buffers: none here, one process),
    and the card's total memory against the plan's device sizes (megamu.memory.device_memory.DEVICE_MIB)."""
    if not cuda:
        return Row("context", False, "CUDA only", skipped=True)
    import torch

    from megamu.memory.device_memory import CUDA_CONTEXT_GIB, DEVICE_MIB

    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    ok, said = compare_peaks({"context": int(CUDA_CONTEXT_GIB * 2**30)}, {"context": outside})
    known = {mib: name for name, mib in DEVICE_MIB.items()}
    card = f"card {total / 2**20:.0f} MiB ({known.get(round(total / 2**20), 'not a card the plan knows by name')})"
    return Row("context", ok, said, f"{card}; nvidia-smi's used minus the allocator's reserved")


def check_offload(cuda, model, opt, spill_dir: Path) -> Row:
    import torch

    from megamu.model import unwrap

    named = list(unwrap(model).named_parameters())
    params = {n: p.detach().clone() for n, p in named}
    states = {n: {k: v.clone() for k, v in opt.param_state(p).items()} for n, p in named[:3] + named[-2:]}
    train = opt.memory()
    sync(cuda)
    before = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    opt.offload(spill_dir)  # GPU: into pinned host buffers (megamu.training.host_mirror), synchronised
    t_out = time.perf_counter() - start
    rollout = opt.memory()
    freed = before - torch.cuda.memory_allocated() if cuda else train.total - rollout.total
    start = time.perf_counter()
    opt.reload()
    t_back = time.perf_counter() - start
    bitwise, said = compare_bitwise({**params, **{f"{n}/{k}": v for n, st in states.items() for k, v in st.items()}},
                                    {**{n: p.detach() for n, p in named}, **{
                                        f"{n}/{k}": v for n, p in named if n in states
                                        for k, v in opt.param_state(p).items()}})
    expected = train.total - rollout.total
    back = opt.memory()  # gradients come back zeroed on GPU, and on CPU at the next update's zero_grad
    ok = bitwise and freed >= expected and (back.params, back.main_params, back.moments) == (
        train.params, train.main_params, train.moments)
    return Row("offload", ok, f"freed {size(freed)} (expected {size(expected)}), {said}",
               f"out {t_out:.2f} s, back {t_back:.2f} s ({expected / 2**30 / max(t_out, 1e-9):.1f} GiB/s out), "
               f"trainer_mem_train_gib {train.gib():.2f} {train.to_dict()}, trainer_mem_rollout_gib "
               f"{rollout.gib():.2f}")


def check_checkpoint(args, cuda, model, arch, opt, save_dir: Path) -> Row:
    import torch

    from megamu.convert import full_state_dict
    from megamu.model import unwrap
    from megamu.training import load_checkpoint, save_checkpoint

    start = time.perf_counter()
    save_checkpoint(save_dir, 1, model, arch, opt, extra={"check": "gpu"})
    t_save = time.perf_counter() - start
    disk = sum(f.stat().st_size for f in save_dir.rglob("*") if f.is_file())
    fresh, _, fresh_opt = build(args, cuda)
    start = time.perf_counter()
    extra = load_checkpoint(save_dir, fresh, arch, fresh_opt)
    t_load = time.perf_counter() - start
    pairs = list(zip(unwrap(model).parameters(), unwrap(fresh).parameters()))
    # canonical tensors: the vocab padding rows of a random init are not part of a checkpoint (loaded as zeros)
    want = dict(full_state_dict(model, arch))
    weights, said = compare_bitwise(want, dict(full_state_dict(fresh, arch)))
    args.saved_weights = want  # the reshard row loads the same save at TP 2
    moments = all(torch.equal(opt.param_state(a)[k], fresh_opt.param_state(b)[k])
                  for a, b in pairs[:3] + pairs[-2:] for k in ("exp_avg", "exp_avg_sq"))
    ok = weights and moments and extra["iteration"] == 1
    return Row("checkpoint", ok, f"save {t_save:.1f} s, load {t_load:.1f} s, {size(disk)} on disk",
               f"weights: {said}, moments bitwise {moments}")


def stage_flags(hf: Path, save: Path, cuda: bool) -> list[str]:
    """pretrain_mu_grpo.py flags for one μ-GRPO stage of 2 updates (4 prompts, 2 per update) with the in-process
    engine; the reward (any digit in the answer) is one a random tiny model earns, so advantages are not all 0."""
    return ["--hf-checkpoint", str(hf), "--save", str(save), "--num-stages", "1", "--prompts-per-stage", "4",
            "--prompts-per-update", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "12",
            "--eval-prompts", "0", "--micro-batch-size", "4", "--reward-fn", "tests.e2e.rewards:has_digit",
            "--no-skip-zero-advantage", "--seed", "7", "--rollout-engine", "local",
            *(["--bf16", "--transformer-impl", "local"] if cuda else [])]


def check_stage(cuda, root: Path) -> Row:
    from tests.tiny import save_tiny_model

    hf = save_tiny_model(root / "tiny-qwen2", "qwen2", seed=3)
    save = root / "run"
    cmd = [sys.executable, str(REPO / "pretrain_mu_grpo.py"), *stage_flags(hf, save, cuda)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        return Row("stage", False, f"exit {proc.returncode}", (proc.stderr or proc.stdout)[-600:].replace("\n", " | "))
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if r["kind"] == "update"]
    ok = len(updates) == 2 and all(u["loss"] == u["loss"] for u in updates)
    first = updates[0]["ratio_mean"] if updates else float("nan")
    return Row("stage", ok, f"{len(updates)} updates in {seconds:.0f} s", f"first ratio_mean {first:.4f}")


def run_checks(args) -> list[Row]:
    import torch

    from megamu.runtime import parallel

    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; use --dry-run for the CPU smoke test")
    torch.manual_seed(0)
    if not cuda:
        torch.set_num_threads(1)
    only = set(args.only or CHECKS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        tmp = Path(tmp)
        measured: list = []
        if only & {"train", "offload", "checkpoint", "reshard", "plan", "buckets", "ep-agree", "logprobs"}:
            from megamu.runtime.device import Device

            parallel.init_distributed(tensor_model_parallel_size=1, seed=0, device=Device("cuda" if cuda else "cpu"))
            model, arch, opt = build(args, cuda)
            rows.append(check_train(args, cuda, model, arch, opt))  # also gives the optimiser its Adam state
            if "offload" in only:
                rows.append(check_offload(cuda, model, opt, tmp / "spill"))
            if only & {"checkpoint", "reshard"}:
                rows.append(check_checkpoint(args, cuda, model, arch, opt, tmp / "ckpt"))
                if "reshard" in only:
                    rows.append(check_reshard(args, tmp))
            rows = [r for r in rows if r.check in only] + ([check_context(cuda)] if "train" in only else [])
            del model, opt
            from tools.gpu_check_path import path_rows

            config = model_config(args)
            samples = synthetic_samples(8, args.seq_len, config.vocab_size, seed=1)
            rows += path_rows(args, cuda, only, measured, config, samples)
            if "logprobs" in only:
                rows += logprob_rows(cuda, tmp)
            parallel.destroy_distributed()
        if only & {"ipc", "server"}:
            from tools import gpu_check_rows

            if "ipc" in only:
                rows.append(verdict_row("ipc", *gpu_check_rows.ipc_check(cuda)))
            if "server" in only:
                rows.append(verdict_row("server", *gpu_check_rows.server_check(cuda, tmp)))
        if "stage" in only:
            rows.append(check_stage(cuda, tmp))
    if args.measured_peaks:
        write_measured(args.measured_peaks, measured, rows)
    return rows


def write_measured(path: str, measured: list, rows: list[Row]) -> None:
    """The plan rows' measured terms for a launch's --measured-peaks; none measured (the CPU): nothing is written
    (a plan fed CPU numbers would shrink its margin for nothing), said in a row."""
    from megamu.memory import measured_peaks

    if not measured:
        rows.append(Row("peaks", False, f"nothing measured on this device: {path} not written", skipped=True))
        return
    import torch

    measured_peaks.write(path, measured, device=torch.cuda.get_device_name())
    rows.append(Row("peaks", True, f"{len(measured)} measured terms written to {path}"))


def print_table(rows: list[Row]) -> None:
    width = max(len(r.result) for r in rows)
    print(f"{'check':<11} {'ok':<4} {'result':<{width}}  detail")
    for r in rows:
        verdict = "SKIP" if r.skipped else "PASS" if r.ok else "FAIL"
        print(f"{r.check:<11} {verdict:<4} {r.result:<{width}}  {r.detail}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    installed = ensure_wheels(args.wheels)
    start = time.perf_counter()
    rows = run_checks(args)
    print_table(rows)
    out = Path(args.out) if args.out else Path(tempfile.gettempdir()) / "gpu_check.json"
    out.write_text(json.dumps({"dry_run": args.dry_run, "installed_from_wheels": installed, "seconds":
                               time.perf_counter() - start, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    print(f"report: {out} ({time.perf_counter() - start:.0f} s)")
    return 0 if all(r.ok or r.skipped for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
