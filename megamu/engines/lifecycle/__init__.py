"""How an engine lives across the stages of a staged run: one protocol, an implementation per deployment, chosen once.

The staged loop (megamu.loop.staged) calls the same verbs in every mode, in slime's order (train.py: offload_train,
onload_weights, update_weights, onload_kv, generate, offload_rollout):
``wants`` -> (the trainer gathers them and offloads) ``update_weights`` -> ``onload`` -> ``start`` -> the rollout
phase on ``engine`` (rank 0) -> ``offload`` ... ``eval_engine`` for the final evaluation -> ``stop``. What each verb
does is the implementation's business:
- ``RestartEachStage`` (staged mode, §4): every stage starts an engine on θ_k's HF folder and stops it after D_k, so
  its memory is free for the μ updates;
- ``ColocatedLocal`` (colocated mode, the in-process engine): started once from a folder, later stages push tensors;
- ``ColocatedSGLang`` (colocated mode, SGLang; megamu.engines.sglang.colocated): started once, later stages push from
  a folder or in memory (per node where needed), each push probed and logged, servers' memory given back while the
  trainer trains.
Every rank calls every verb (they agree on what is collective); the engine itself lives on rank 0, with SGLang
servers spread over the nodes (``spread``) owned by each node's local rank 0. Nothing here imports the trainer, the
loop or the rollout phase: weights arrive as ``megamu.weights.Weights``, "sync" records leave through a ``log``
callable, and the loop runs the rollout phase on ``engine``.
"""

from __future__ import annotations

from megamu.engines import EngineConfig
from megamu.engines.lifecycle.base import (
    LIFECYCLE_MODES,
    ColocatedLocal,
    EngineLifecycle,
    LifecycleBase,
    Log,
    RestartEachStage,
    WeightRequest,
)

__all__ = ["LIFECYCLE_MODES", "ColocatedLocal", "EngineLifecycle", "LifecycleBase", "Log", "RestartEachStage",
           "WeightRequest", "make_lifecycle"]


def make_lifecycle(mode: str, cfg: EngineConfig, log: Log | None = None,
                   probe_ids: list[int] | None = None) -> EngineLifecycle:
    """The lifecycle of ``mode`` ("staged" or "colocated") for the engine of ``cfg``, chosen once. ``log`` takes the
    "sync" records of checked pushes; ``probe_ids`` is the prompt whose log-probs check each SGLang push."""
    if mode == "staged":
        return RestartEachStage(cfg, log, probe_ids)
    if mode != "colocated":
        raise ValueError(f"engine lifecycles run the {LIFECYCLE_MODES} modes, not {mode!r}")
    if cfg.kind == "local":
        return ColocatedLocal(cfg, log, probe_ids)
    from megamu.engines.sglang.colocated import ColocatedSGLang

    return ColocatedSGLang(cfg, log, probe_ids)
