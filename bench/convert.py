"""HF export throughput and memory (export_hf, every stage's engine weights) against a plain safetensors save measured
side by side in the same run. (The offline converter is torch_dist only, through mbridge: not measured here.)

  python -m bench.convert [--hf-dir DIR] [--shard-mb 256]     (default model: SmolLM2-135M-Instruct)

Every case runs in its own subprocess (best of --repeats): "extra peak" is the peak RSS during the measured step above
the RSS just before it (which holds the loaded model for export_hf, the model plus the state dict for plain_save).
Ratios > 1 mean faster than the baseline. Every writer fsyncs its files, so the disk sets the pace.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _reset_peak() -> float:
    """Reset the peak-RSS counter (Linux: VmHWM) and return the current RSS in MB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def _dir_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 1e6


def case(name: str, hf_dir: Path, work: Path, shard_bytes: int) -> dict:
    import torch
    from safetensors.torch import save_file

    from megamu.convert import export_hf, full_state_dict, load_hf_into_model
    from megamu.convert.io import _fsync
    from megamu.convert.mapping import mcore_to_hf_tensors
    from megamu.model import ModelArch, build_model
    from megamu.runtime.parallel import init_distributed

    torch.set_num_threads(1)
    ModelArch.from_hf(hf_dir)  # transformers' config machinery imports in ~2 s: keep that one-off out of the timing
    init_distributed(1)
    arch = ModelArch.from_hf(hf_dir)
    model = build_model(arch, perform_initialization=False)
    load_hf_into_model(model, arch, hf_dir)
    if name == "plain_save":  # baseline: the same HF state dict, already in memory, one save_file call
        state = {n: t.clone() for n, t in mcore_to_hf_tensors(arch, full_state_dict(model, arch))}
    before = _reset_peak()
    t0 = time.perf_counter()
    if name == "export_hf":
        out = export_hf(model, arch, work / name, hf_source_dir=hf_dir, dtype="fp32", max_shard_bytes=shard_bytes)
    else:
        out = work / name
        out.mkdir()
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        _fsync(out / "model.safetensors")  # our writers fsync too: both sides are disk-bound, not page-cache-bound
    seconds = time.perf_counter() - t0
    peak = _status_mb("VmHWM")
    return {"case": name, "seconds": seconds, "mb": _dir_mb(out), "extra_peak_mb": peak - before, "peak_mb": peak}


# Writeback of earlier writes slows later ones, so vary which case goes first.
SCHEDULES = [["plain_save", "export_hf"], ["export_hf", "plain_save"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", type=Path, default=None)
    parser.add_argument("--shard-mb", type=int, default=256, help="max shard size for our writers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_dir is None:
        from megamu.model.demo_model import smollm2_hf_dir

        args.hf_dir = smollm2_hf_dir()
    if args.case:
        print(json.dumps(case(args.case, args.hf_dir, args.work, args.shard_mb * 1024**2)))
        return
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")  # same policy for every case
    results = {}
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(dir=Path(args.hf_dir).parent) as work:
            for name in SCHEDULES[i % len(SCHEDULES)]:
                cmd = [sys.executable, __file__, "--case", name, "--work", work, "--hf-dir", str(args.hf_dir),
                       "--shard-mb", str(args.shard_mb)]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode:
                    raise SystemExit(f"case {name} failed:\n{proc.stderr[-3000:]}")
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                if name not in results or r["seconds"] < results[name]["seconds"]:
                    results[name] = r
    results = {name: results[name] for name in SCHEDULES[0]}
    base = results["plain_save"]
    base_rate = base["mb"] / base["seconds"]
    print(f"model: {args.hf_dir}  ({base['mb']:.0f} MB fp32), shard limit {args.shard_mb} MB")
    print(f"{'case':<12} {'MB':>7} {'s':>7} {'MB/s':>8} {'vs plain':>9} {'extra peak RSS MB':>18} {'peak RSS MB':>12}")
    for r in results.values():
        rate = r["mb"] / r["seconds"]
        print(f"{r['case']:<12} {r['mb']:7.0f} {r['seconds']:7.2f} {rate:8.0f} {rate / base_rate:8.2f}x "
              f"{r['extra_peak_mb']:18.0f} {r['peak_mb']:12.0f}")


if __name__ == "__main__":
    main()
