"""Rollout engines: the protocol (types.py), the in-process engine (local.py), SGLang servers (sglang/), and how an
engine lives across a staged run's stages (lifecycle/).

``EngineConfig`` (engine_config.py) says which engine generates and in what precision; ``build_engine`` makes it.
Engines take weights (``Engine.update_weights``) and requests, never the trainer: nothing here imports
megamu.training.
"""

from __future__ import annotations

from dataclasses import replace

from megamu.engines.engine_config import ENGINE_KINDS, EngineConfig
from megamu.engines.sglang.launch import SGLangConfig
from megamu.engines.types import Engine, EngineBase, GeneratedSample, GenerateRequest, SamplingParams

__all__ = ["ENGINE_KINDS", "Engine", "EngineBase", "EngineConfig", "GenerateRequest", "GeneratedSample",
           "SGLangConfig", "SamplingParams", "build_engine", "make_engine"]


def make_engine(kind: str, hf_dir, **kwargs) -> Engine:
    """``kind`` "local" (in-process transformers) or "sglang" (servers; imported only when asked for)."""
    if kind == "local":
        from megamu.engines.local import LocalEngine

        return LocalEngine(hf_dir, **kwargs)
    if kind == "sglang":
        from megamu.engines.sglang.client import SGLangEngine

        return SGLangEngine(hf_dir, **kwargs)
    raise ValueError(f"unknown rollout engine {kind!r}; expected one of {ENGINE_KINDS}")


def build_engine(cfg: EngineConfig, hf_dir) -> Engine:
    """The engine of ``cfg`` serving the weights in ``hf_dir``. Servers megamu did not start hold whatever they loaded
    last, so they are given ``hf_dir`` first."""
    dtype = cfg.dtype or "float32"
    if cfg.kind == "local":
        import torch

        return make_engine("local", str(hf_dir), dtype=getattr(torch, dtype), max_batch_size=cfg.max_batch_size)
    engine = make_engine(cfg.kind, str(hf_dir), config=replace(cfg.sglang, dtype=dtype))
    if cfg.sglang.urls:
        engine.update_weights(hf_dir=str(hf_dir))
    return engine
