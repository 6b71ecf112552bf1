"""How megamu launches the CPU build of SGLang 0.5.23 (the project's shared/sglang-cpu recipe): another Python, its
environment, launch.sh's flags. Used by the real-server tests (make test-sglang) and the SGLang benches
(bench/sglang_sync.py); on a cluster the same fields come from --sglang-python / --sglang-env / --sglang-server-args."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from megamu.engines.sglang.launch import SGLangConfig

API_KEY = "megamu-cpu-server-key"  # servers on this machine only; a fixed key lets a second client attach
# launch.sh's flags, minus what megamu passes itself (--model-path, --host, --port, --tp-size, --dtype, --api-key)
CPU_SERVER_ARGS = (
    "--device cpu --attention-backend torch_native --sampling-backend pytorch --mem-fraction-static 0.2 "
    "--max-total-tokens 8192 --max-running-requests 64 --cuda-graph-backend-decode disabled "
    "--cuda-graph-backend-prefill disabled --skip-server-warmup --trust-remote-code"
)


def sglang_cpu_paths() -> tuple[Path, Path]:
    venv = Path(os.environ.get("MEGAMU_SGLANG_VENV", Path.home() / ".cache" / "megamu" / "sglang-cpu-venv"))
    """(the build's venv, the recipe folder), from MEGAMU_SGLANG_VENV / MEGAMU_SGLANG_CPU or their defaults."""
    repo = Path(__file__).resolve().parents[2]  # shared/ sits beside the checkout (or beside its worktree folder)
    places = [repo.parent / "shared" / "sglang-cpu", repo.parents[1] / "shared" / "sglang-cpu"]
    cpu_dir = Path(os.environ.get("MEGAMU_SGLANG_CPU") or next((d for d in places if d.is_dir()), places[0]))
    if not (venv / "bin" / "python").exists() or not (cpu_dir / "stubs").is_dir():
        raise RuntimeError(f"the CPU SGLang build is missing ({venv}, {cpu_dir}/stubs): run `make test-sglang`, "
                           "which builds it with shared/sglang-cpu/setup.sh")
    return venv, cpu_dir


def cpu_config(port_base: int, log_dir, **overrides) -> SGLangConfig:
    """How megamu launches the CPU build: another Python, its environment, launch.sh's flags."""
    venv, cpu_dir = sglang_cpu_paths()
    env = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(cpu_dir / "stubs"),
           "SGLANG_CPU_OMP_THREADS_BIND": os.environ.get("SGLANG_CPU_OMP_THREADS_BIND", "0")}
    kw = dict(server_python=str(venv / "bin" / "python"), server_env=env,
              extra_server_args=shlex.split(CPU_SERVER_ARGS),
              port_base=port_base, api_key=API_KEY, startup_timeout_s=500, log_dir=str(log_dir), dtype="float32",
              server_concurrency=16, backoff_s=0.2, max_retries=2, shutdown_grace_s=20)
    kw.update(overrides)
    return SGLangConfig(**kw)
