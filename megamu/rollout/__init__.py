"""Rollout engines (in-process and SGLang), the stage dataset and the rollout phase driver."""

from __future__ import annotations

from megamu.rollout.types import Engine, GeneratedSample, GenerateRequest, SamplingParams

__all__ = ["Engine", "GenerateRequest", "GeneratedSample", "SamplingParams", "make_engine"]


def make_engine(kind: str, hf_dir, **kwargs) -> Engine:
    """``kind`` "local" (in-process transformers) or "sglang" (servers; imported only when asked for)."""
    if kind == "local":
        from megamu.rollout.local import LocalEngine

        return LocalEngine(hf_dir, **kwargs)
    if kind == "sglang":
        from megamu.rollout.sglang import SGLangEngine

        return SGLangEngine(hf_dir, **kwargs)
    raise ValueError(f"unknown rollout engine {kind!r}; expected 'local' or 'sglang' (--rollout-engine)")
