"""SGLang server processes: the engine's settings, launching servers (one node or several) and stopping them.

A server is ``<server_python> -m sglang.launch_server`` in its own session, so it can be stopped as a process group.
It may run under another Python and environment than the trainer (the CPU build of SGLang lives in its own venv:
``server_python`` / ``server_env``). torchrun's variables are removed from its environment: a server started by a
trainer rank would otherwise read RANK / WORLD_SIZE / MASTER_ADDR meant for the trainer.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from megamu.config_fields import flag
from megamu.errors import ConfigError, check_choice, check_non_negative, check_positive

# Set by torchrun / torch.distributed.elastic for the trainer's own ranks (torch/distributed/run.py).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
TORCHRUN_ENV_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")


WEIGHT_SYNCS = ("disk", "memory")
# What a server needs to load a model, for the default start-up timeout and a disk reload's: a fixed part (Python and
# CUDA start, memory profiling, CUDA-graph capture) and the safetensors read at a cold shared filesystem's rate. The
# servers of a node start at once and read the same files, which the page cache holds once: the node reads the
# model once, so the bound does not grow with the servers' count. slime waits without a bound while the process
# lives (slime/backends/sglang_utils/sglang_engine.py:67-85); megamu names the server after this one.
LOAD_BASE_S = 300.0
LOAD_RATE_BYTES_S = 100 * 2**20
# SGLang's batch-invariant kernels: only with them is sampling_seed honoured (slower, so opt-in).
DETERMINISTIC_FLAG = "--enable-deterministic-inference"  # /update_weights_from_disk, or an in-memory push


@dataclass(frozen=True)
class SGLangConfig:
    """Everything the SGLang engine needs: where its servers are (or how to launch them), its client's limits and
    how weights reach it. ``dtype`` is set by ``megamu.engines.build_engine`` from ``EngineConfig.dtype``."""

    # Flags the parser converts: --sglang-url (comma-separated), --sglang-server-args (shell words), --sglang-env.
    urls: list[str] = flag("--sglang-url", default_factory=list, flag_default=None,  # empty: megamu launches servers
                           help="URL[,URL...] of running servers or a router")
    # Rank 0 sends every request through the router (nodes.py).
    router: str | None = flag("--sglang-router", default=None, help=(
        "URL of a running sglang-router: the servers megamu launches on every node join it for each stage and leave "
        "it at the stage's end, and requests go through it"))
    # None: a run's RunConfig.derive decides (one per tp_size GPUs of the node when they are the trainer's), else 1
    num_servers: int | None = flag("--sglang-num-servers", default=None, type=int,
                                   help="servers megamu launches on each node")
    tp_size: int = flag("--sglang-tp-size", default=1, type=int)
    api_key: str | None = None  # None: SGLANG_API_KEY, else a fresh random key for servers megamu launches
    host: str = flag("--sglang-host", default="127.0.0.1", help=(  # another node's rank 0 needs a routable address
        "address the servers megamu launches listen on; on several nodes one the others reach, e.g. 0.0.0.0 (they "
        "are then named by this node's host name)"))
    port_base: int = flag("--sglang-port-base", default=30000, type=int, help=(
        "port of a node's first launched server; server i listens on port base + i"))
    dtype: str = "float32"  # --dtype of launched servers (their compute precision)
    server_python: str | None = flag("--sglang-python", default=None, help=(
        "the Python that runs servers megamu launches (default: this one), e.g. a CPU build's venv"))
    server_env: dict[str, str] = flag("--sglang-env", default_factory=dict, flag_default="", help=(
        'environment of servers megamu launches, e.g. "SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=/x/stubs"'))
    extra_server_args: list[str] = flag("--sglang-server-args", default_factory=list, flag_default="", help=(
        'extra launch_server flags, e.g. "--mem-fraction-static 0.8 --max-running-requests 1024"'))
    log_dir: str | None = None
    # None: scaled to the model (load_seconds); the servers of a node start at once and share it
    startup_timeout_s: float | None = flag("--sglang-startup-timeout", default=None, type=float, help=(
        "seconds a server megamu launches (or restarts) has to load its model and answer /health (default: "
        f"{LOAD_BASE_S:.0f} s + the model's safetensors bytes at {LOAD_RATE_BYTES_S / 2**20:.0f} MiB/s)"))
    url_timeout_s: float = flag("--sglang-url-timeout", default=60.0, type=float, help=(
        "seconds the given --sglang-url servers have to answer /health at start: the run starts on those that do, "
        "naming the others, and fails after this bound when none does, naming each URL with its error (servers "
        "megamu launches have --sglang-startup-timeout)"))
    # Health during generation (health.py): every server is probed each probe_period_s; a server that exits, refuses
    # connections, or misses probe_misses probes in a row (no answer within probe_timeout_s) is dead. A hung server
    # is thus found within probe_misses * (probe_period_s + probe_timeout_s) (45 s by default).
    probe_period_s: float = flag("--rollout-probe-period", default=5.0, type=float, help=(
        "seconds between /health_generate probes of each SGLang server while requests are out"))
    probe_timeout_s: float = flag("--rollout-probe-timeout", default=10.0, type=float,
                                  help="seconds a probe waits for its answer")
    probe_misses: int = flag("--rollout-probe-misses", default=3, type=int, help=(
        "probes missed in a row that make a server dead (as do its exit and a refused port): a hung server is found "
        "within misses x (period + timeout), 45 s by default; its requests go to the live servers with the same "
        "seeds"))
    max_restarts: int = flag("--rollout-max-restarts", default=3, type=int, help=(
        "restarts per stage of the dead servers megamu launched; beyond it the run stops, naming the server, its "
        "exit status and log (a rerun resumes at the first missing shard). After an in-memory push a restarted "
        "server gets it again from a host copy kept for that (none at 0)"))
    # A request of n samples counts n; a router is given the sum over its workers.
    server_concurrency: int | None = flag("--sglang-server-concurrency", default=None, type=int, help=(
        "sequences each SGLang server (or each worker of a router) runs at once; megamu sends it twice that "
        "(default: the server's max_running_requests from /server_info, else 512)"))
    deterministic: bool = flag("--rollout-deterministic", default=False, action="store_true", help=(
        "SGLang honours each sample's seed (servers launched with --enable-deterministic-inference; given servers "
        "must have it), so a resumed stage redraws the same samples; slower kernels. The local engine always is"))
    request_timeout_s: float = 3600.0
    # one attempt of a control call to every server (memory, weight-update sessions); a disk reload gets at least
    # the model's load time (load_seconds). Timed-out attempts are retried within max_retries (pool.post_all).
    control_timeout_s: float = 600.0
    max_retries: int = 5
    backoff_s: float = 1.0
    shutdown_grace_s: float = 30.0
    # None below: follows from where the servers run, filled in by ``placed`` (a run's RunConfig places them by its
    # mode and device; an engine on its own gets disk refreshes over gloo, from 127.0.0.1 or MASTER_ADDR).
    weight_sync: str | None = flag("--weight-sync", default=None, choices=WEIGHT_SYNCS, help=(
        "SGLang refreshes: HF export + /update_weights_from_disk, or in memory: a broadcast from rank 0 to every "
        "node's servers, or, for servers on the trainer's GPUs, tensor handles each node pushes to its own (default: "
        "memory in --rollout-mode colocated, disk in staged)"))
    memory_saver: bool | None = flag("--sglang-memory-saver", default=None, action="optional_bool", help=(
        "launch servers with --enable-memory-saver and, in colocated mode, have them release their KV cache and "
        "weights while the trainer trains (default: on for colocated runs on GPUs, where servers share the "
        "trainer's devices)"))
    weight_bucket_mb: float = 512.0  # bytes per broadcast of an in-memory sync
    sync_backend: str | None = None  # process-group backend of an in-memory sync: gloo on CPU, nccl on GPU
    shares_trainer_devices: bool | None = None  # servers on the trainer's GPUs (colocated): pushes go as tensors
    sync_master_address: str | None = flag("--weight-sync-address", default=None, help=(
        "this process's address as the servers reach it, for in-memory pushes over a process group (default: "
        "torchrun's MASTER_ADDR, else 127.0.0.1)"))
    vocab_size: int | None = None  # None: read from the served model's config.json when it is readable here

    def __post_init__(self):
        for name, choices in (("weight_sync", WEIGHT_SYNCS), ("sync_backend", ("gloo", "nccl"))):
            if getattr(self, name) is not None:
                check_choice(self, name, choices)
        check_positive(self, "num_servers", "tp_size", "server_concurrency", "port_base")
        check_positive(self, "probe_misses")
        check_non_negative(self, "max_retries", "max_restarts")
        for name in ("startup_timeout_s", "url_timeout_s", "request_timeout_s", "control_timeout_s",
                     "weight_bucket_mb", "probe_period_s", "probe_timeout_s"):
            if getattr(self, name) is None and name == "startup_timeout_s":
                continue
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)!r}")
        if self.router and self.urls:
            raise ConfigError("router", "a router is for the servers megamu launches; give running servers as urls")
        if any(a == "--dtype" or a.startswith("--dtype=") for a in self.extra_server_args):
            raise ConfigError("extra_server_args", "give the server dtype once, as SGLangConfig.dtype, not in the "
                                                   "server args: it must match the dtype of the weights megamu exports")

    def placed(self, colocated: bool = False, backend: str = "gloo") -> SGLangConfig:
        """This config with the fields left None filled in for servers that share the trainer's devices
        (``colocated``) or not, with the trainer's process-group ``backend``: colocated servers take in-memory pushes
        and, on GPUs (nccl), release their memory while the trainer trains; others reload from disk."""
        derived = dict(weight_sync="memory" if colocated else "disk", memory_saver=colocated and backend == "nccl",
                       sync_backend=backend, shares_trainer_devices=colocated,
                       sync_master_address=os.environ.get("MASTER_ADDR", "127.0.0.1"), num_servers=1)
        return replace(self, **{k: v for k, v in derived.items() if getattr(self, k) is None})


def model_bytes(hf_dir: str | Path | None) -> int:
    """Bytes of the safetensors files in ``hf_dir`` (0 when it is not readable here)."""
    try:
        return sum(p.stat().st_size for p in Path(hf_dir).glob("*.safetensors")) if hf_dir else 0
    except OSError:
        return 0


def load_seconds(nbytes: int) -> float:
    """Seconds a server may take to load ``nbytes`` of weights: LOAD_BASE_S + nbytes at LOAD_RATE_BYTES_S."""
    return LOAD_BASE_S + nbytes / LOAD_RATE_BYTES_S


def startup_timeout(cfg: SGLangConfig, hf_dir: str | Path | None) -> float:
    """``cfg.startup_timeout_s`` when given, else the model's load time."""
    return cfg.startup_timeout_s if cfg.startup_timeout_s is not None else load_seconds(model_bytes(hf_dir))


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1
_SIGTERM = int(signal.SIGTERM)


def _die_with_parent() -> None:
    """Popen preexec_fn: SIGTERM the server when the process that launched it dies, even by SIGKILL.

    Servers run in their own session (so they can be stopped as a group), which also means nothing else would stop
    them: a trainer killed by the OOM killer or a scheduler's SIGTERM would leave them holding the GPUs and the port.
    The ctypes handle is resolved before the fork, so the child only makes one libc call. Linux ties this to the
    launching *thread*: create the engine on a thread that lives as long as it (the main thread).
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, _SIGTERM)


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1" if host in ("0.0.0.0", "") else host, port)) == 0


def log_tail(path: Path | None, n: int = 40) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except (OSError, TypeError):
        return "(no log)"
    return "\n".join(lines[-n:])


def stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each server's process group, wait up to ``grace_s`` for every member to exit, SIGKILL what is left, and
    return only when no member is alive.

    Waiting for the leader alone is not enough: SGLang's launcher kills its scheduler and detokenizer children without
    waiting for them, so a stage could reload the trainer's 30-44 GiB while a child still holds its CUDA context. A
    process's device memory is freed when it exits, so an empty group is a free GPU."""
    groups = [p.pid for p in procs]
    for p in procs:
        if p.poll() is None:
            _signal_group(p.pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while any(group_alive(g) for g in groups) and time.monotonic() < end:
        for p in procs:
            p.poll()  # reap our own children (the leaders), so they do not linger as zombies
        time.sleep(0.05)
    for g in groups:
        _signal_group(g, signal.SIGKILL)
    for p in procs:
        p.wait()
    while any(group_alive(g) for g in groups):  # SIGKILL is delivered asynchronously
        time.sleep(0.01)
    procs.clear()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether any live (not zombie) process is in process group ``pgid``."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# The caching allocator's settings: torch reads PYTORCH_ALLOC_CONF (2.9+) and the older PYTORCH_CUDA_ALLOC_CONF.
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def without_expandable_segments(conf: str) -> str:
    """An allocator setting (``opt:val,opt:val``) with its ``expandable_segments`` option removed."""
    return ",".join(o for o in conf.split(",") if o.strip() and o.split(":")[0].strip() != "expandable_segments")


def server_env(cfg: SGLangConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The launched servers' environment: ours without torchrun's variables, plus ``cfg.server_env``.

    Servers with the memory saver never get expandable segments: torch_memory_saver raises ("expandable_segments is
    not supported yet") when its first region opens, the one SGLang loads its weights in, so the server dies at
    launch. The trainer keeps them (examples/common.sh sets them for its offload cycles)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in TORCHRUN_ENV and not k.startswith(TORCHRUN_ENV_PREFIXES)}
    env.update(cfg.server_env)
    if cfg.memory_saver:
        for var in ALLOC_CONF_VARS:
            if var in env:
                env[var] = without_expandable_segments(env[var])
                if not env[var]:
                    del env[var]
    return env


def server_command(cfg: SGLangConfig, hf_dir: str, port: int, index: int, api_key: str) -> list[str]:
    return [cfg.server_python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(hf_dir),
            "--host", cfg.host, "--port", str(port), "--tp-size", str(cfg.tp_size),
            "--base-gpu-id", str(index * cfg.tp_size), "--dtype", cfg.dtype, "--api-key", api_key,
            *(["--enable-memory-saver"] if cfg.memory_saver else []), *cfg.extra_server_args,
            *([DETERMINISTIC_FLAG] if cfg.deterministic and DETERMINISTIC_FLAG not in cfg.extra_server_args else [])]


def advertised_host(host: str) -> str:
    """The address other processes use to reach a server listening on ``host``."""
    return socket.getfqdn() if host in ("0.0.0.0", "", "::") else host


def launch_servers(cfg: SGLangConfig, hf_dir: str, api_key: str, procs: list[subprocess.Popen],
                   log_dir: Path) -> tuple[list[str], list[Path]]:
    """Start ``cfg.num_servers`` servers on this node, appending each process to ``procs`` as it starts (so the
    caller can stop them even if a later one fails); returns their URLs and log files."""
    urls, logs = [], []
    for i in range(cfg.num_servers):
        port = cfg.port_base + i
        if port_in_use(port, cfg.host):  # a leftover server there would answer /health in place of ours
            raise PortInUse(f"port {port} (SGLang server {i}) is already in use, maybe by a server left over "
                            "from an earlier run; stop it or choose another port_base")
        proc, log = launch_server(cfg, hf_dir, api_key, i, log_dir)
        procs.append(proc)
        urls.append(f"http://{advertised_host(cfg.host)}:{port}")
        logs.append(log)
    return urls, logs


def launch_server(cfg: SGLangConfig, hf_dir: str, api_key: str, index: int, log_dir: Path,
                  restart: int = 0) -> tuple[subprocess.Popen, Path]:
    """Start server ``index`` of this node (port ``port_base + index``); a restart writes a log of its own, so the
    dead server's log stays as it was."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / (f"server_{index}.log" if not restart else f"server_{index}.restart{restart}.log")
    with open(log, "w") as f:
        # Own session: the whole server (scheduler, detokenizer children) is one process group to stop.
        proc = subprocess.Popen(server_command(cfg, hf_dir, cfg.port_base + index, index, api_key), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True, env=server_env(cfg),
                                preexec_fn=_die_with_parent)
    return proc, log


class PortInUse(RuntimeError):
    pass
