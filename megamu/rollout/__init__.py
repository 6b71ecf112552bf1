"""Rollout engines (in-process and SGLang), the stage dataset and the rollout phase driver."""

from __future__ import annotations

from dataclasses import dataclass

from megamu.rollout.types import Engine, GeneratedSample, GenerateRequest, SamplingParams

__all__ = ["Engine", "EngineConfig", "GenerateRequest", "GeneratedSample", "SamplingParams", "build_engine",
           "make_engine"]

ENGINE_KINDS = ("local", "sglang")


@dataclass(frozen=True)
class EngineConfig:
    """Which engine generates, as the trainer and tools/evaluate.py both configure it (flags: megamu.arguments)."""

    kind: str = "local"
    dtype: str = "float32"  # the engine's weights: local engine's, SGLang servers' --dtype, and the HF exports'
    max_batch_size: int = 128  # local engine: sequences decoded together
    sglang_urls: tuple[str, ...] = ()  # running servers or a router; empty: launch servers
    sglang_num_servers: int = 1
    sglang_tp_size: int = 1
    sglang_server_args: tuple[str, ...] = ()
    sglang_python: str | None = None  # the Python that runs launched servers (None: this one), e.g. a CPU build's venv
    sglang_env: tuple[tuple[str, str], ...] = ()  # added to launched servers' environment
    weight_sync: str = "disk"  # how a colocated SGLang engine is refreshed: "disk" (HF export) or "memory"
    sync_backend: str = "gloo"  # process group of in-memory pushes: the trainer device's (nccl on GPU, gloo on CPU)


def make_engine(kind: str, hf_dir, **kwargs) -> Engine:
    """``kind`` "local" (in-process transformers) or "sglang" (servers; imported only when asked for)."""
    if kind == "local":
        from megamu.rollout.local import LocalEngine

        return LocalEngine(hf_dir, **kwargs)
    if kind == "sglang":
        from megamu.rollout.sglang import SGLangEngine

        return SGLangEngine(hf_dir, **kwargs)
    raise ValueError(f"unknown rollout engine {kind!r}; expected one of {ENGINE_KINDS} (--rollout-engine)")


def build_engine(cfg: EngineConfig, hf_dir) -> Engine:
    """The engine of ``cfg`` serving the weights in ``hf_dir``. Servers megamu did not start hold whatever they loaded
    last, so they are given ``hf_dir`` first."""
    if cfg.kind == "local":
        import torch

        return make_engine("local", str(hf_dir), dtype=getattr(torch, cfg.dtype), max_batch_size=cfg.max_batch_size)
    urls = list(cfg.sglang_urls) or None
    engine = make_engine(cfg.kind, str(hf_dir), urls=urls, num_servers=cfg.sglang_num_servers,
                         tp_size=cfg.sglang_tp_size, extra_server_args=list(cfg.sglang_server_args), dtype=cfg.dtype,
                         server_python=cfg.sglang_python, server_env=dict(cfg.sglang_env),
                         weight_sync=cfg.weight_sync, sync_backend=cfg.sync_backend)
    if urls:
        engine.update_weights(hf_dir=str(hf_dir))
    return engine
