"""Rollout engines: the protocol (types.py), the in-process engine (local.py), SGLang servers (sglang/), and how an
engine lives across a staged run's stages (lifecycle/).

``EngineConfig`` says which engine generates and in what precision; ``build_engine`` makes it. Engines take weights
(``Engine.update_weights``) and requests, never the trainer: nothing here imports megamu.training.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megamu.config_fields import flag
from megamu.engines.sglang.launch import SGLangConfig
from megamu.engines.types import Engine, EngineBase, GeneratedSample, GenerateRequest, SamplingParams
from megamu.errors import ConfigError, check_choice, check_positive

__all__ = ["ENGINE_KINDS", "Engine", "EngineBase", "EngineConfig", "GenerateRequest", "GeneratedSample",
           "SGLangConfig", "SamplingParams", "build_engine", "make_engine"]

ENGINE_KINDS = ("local", "sglang")
ENGINE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """Which engine generates, as the trainer and tools/evaluate.py both configure it."""

    # None (the trainer's flag unset): the run's device decides (RunConfig.derive: Device.rollout_engine)
    kind: str | None = flag("--rollout-engine", default="local", flag_default=None, choices=ENGINE_KINDS, help=(
        "default: sglang for a run on GPUs, local on CPU"))
    # None: a run's is its training precision (RunConfig fills it in); an engine on its own computes in float32.
    dtype: str | None = flag("--rollout-dtype", default=None, choices=ENGINE_DTYPES, help=(
        "the precision the engine computes in: the local engine's weights, SGLang servers' --dtype (default: "
        "bfloat16 with --bf16, else float32; the weights it loads: --export-dtype)"))
    max_batch_size: int = flag("--local-engine-batch-size", default=128, type=int, help=(
        "local engine: sequences decoded together (slime's --rollout-batch-size is prompts per rollout: megamu's "
        "--prompts-per-stage)"))
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # servers, launch and weight sync (kind "sglang")

    def __post_init__(self):
        if self.kind is not None:
            check_choice(self, "kind", ENGINE_KINDS)
        if self.dtype is not None:
            check_choice(self, "dtype", ENGINE_DTYPES)
        check_positive(self, "max_batch_size")
        if self.kind == "local" and self.sglang != SGLangConfig():
            raise ConfigError("sglang", "SGLang settings are only used with the sglang engine (on CPU the default "
                                        "engine is the local one)")


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
