"""How an engine lives across the stages of a staged run: one protocol, an implementation per deployment, chosen once.

The staged loop (megamu.loop.staged) calls the same verbs in every mode, in slime's order (train.py: offload_train,
onload_weights, update_weights, onload_kv, generate, offload_rollout):
``wants`` -> (the trainer gathers them and offloads) ``update_weights`` -> ``onload`` -> ``start`` -> the rollout
phase on ``serving()`` (rank 0) -> ``offload`` ... ``eval_engine`` for the final evaluation -> ``stop``. What each verb
does is the implementation's business:
- ``RestartEachStage`` (staged mode, §4): every stage starts an engine on θ_k's HF folder and stops it after D_k, so
  its memory is free for the μ updates;
- ``ColocatedLocal`` (colocated mode, the in-process engine): started once from a folder, later stages push tensors;
- ``ColocatedSGLang`` (colocated mode, SGLang; megamu.engines.sglang.colocated): started once, later stages push from
  a folder or in memory (per node where needed), each push probed and logged, servers' memory given back while the
  trainer trains.
Every rank calls every verb (they agree on what is collective); the engine itself lives on rank 0, with SGLang
servers spread over the nodes (``spread``) owned by each node's local rank 0. Nothing here imports the trainer, the
loop or the rollout phase: weights arrive as ``megamu.engines.weights.Weights``, "sync" records leave through a ``log``
callable, and the loop runs the rollout phase on ``serving()``. Which one a run gets is its mode's choice, made once
(``megamu.mode.Mode.lifecycle``).
"""

from __future__ import annotations

from megamu.engines.lifecycle.base import (
    ColocatedLocal,
    EngineLifecycle,
    LifecycleBase,
    Log,
    RestartEachStage,
    WeightRequest,
)

__all__ = ["ColocatedLocal", "EngineLifecycle", "LifecycleBase", "Log", "RestartEachStage", "WeightRequest"]
