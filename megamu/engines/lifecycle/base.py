"""The engine lifecycle protocol (see megamu.engines.lifecycle), what its implementations share, and the two that
need no SGLang internals: a new engine each stage, and the in-process engine kept across stages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from megamu.engines import Engine, EngineConfig, build_engine
from megamu.engines.weights import Weights
from megamu.runtime import parallel

Log = Callable[..., None]  # MetricsLogger.log's shape: log(kind, step=..., **fields)


@dataclass(frozen=True)
class WeightRequest:
    """What the engine takes next: an HF folder to start (or reload) from, HF-named tensors to push, and whether a
    log-prob probe must check the push."""

    folder: bool
    tensors: bool = False
    every_node: bool = False  # the tensors on every rank, which pushes them to the server on its own GPU
    probe_ids: list[int] | None = None


class EngineLifecycle(Protocol):
    """An engine across the stages, driven by verbs only: the loop reads none of its fields."""

    def wants(self) -> WeightRequest:
        """The weights ``update_weights`` takes next (the same on every rank)."""
        ...

    def update_weights(self, weights: Weights, stage: int) -> None:
        """θ_k becomes β_k: the folder the next engine starts from, or a push into the running one."""
        ...

    def onload(self) -> None:
        """The trainer has offloaded: the engine's memory (KV cache) comes back, and a push's pending probe runs."""
        ...

    def start(self, stage: int) -> None:
        """The engine is up on β_k before the rollout phase (started now, or kept from an earlier stage)."""
        ...

    def serving(self) -> Engine:
        """Rank 0, between ``start`` and ``offload``: the engine the rollout phase generates D_k on."""
        ...

    def served_folder(self) -> Path | None:
        """The folder of the weights the engine serves (or started from), named in stage manifests."""
        ...

    def keeps_export(self, stage: int) -> bool:
        """Whether running servers were launched from stage ``stage``'s HF export: their restarts load it, so it
        stays until the run's end."""
        ...

    def eval_engine(self, weights: Weights | None = None) -> Engine:
        """Rank 0: the engine holding θ (``weights``' folder loaded first, or an engine started on it)."""
        ...

    def offload(self) -> None:
        """D_k is written: the engine stops or gives its device memory back to the trainer."""
        ...

    def stop(self) -> None:
        """The run is over: every engine and server this lifecycle started is stopped."""
        ...


class LifecycleBase:
    """What every implementation shares: rank 0's engine, this node's servers, the folder the next start uses."""

    def __init__(self, cfg: EngineConfig, log: Log | None = None, probe_ids: list[int] | None = None):
        self.cfg, self.log, self.probe_ids = cfg, log or (lambda *a, **k: None), probe_ids
        self.engine: Engine | None = None  # rank 0 only
        self.node = None  # SGLang on several ranks (``spread``): this node's servers, on its local rank 0 (nodes.py)
        self.hf_dir: Path | None = None  # the folder the next engine starts from
        self.launch_stage: int | None = None  # the stage whose HF export running servers were launched from
        # SGLang servers megamu launches on several ranks (or behind a router): every node's local rank 0 starts its
        # node's servers once the trainer has offloaded, and rank 0 dispatches over all of them
        sglang = cfg.sglang
        self.spread = cfg.kind == "sglang" and not sglang.urls and (
            parallel.world_size() > 1 or sglang.router is not None)

    def wants(self) -> WeightRequest:
        return WeightRequest(folder=True)

    def update_weights(self, weights: Weights, stage: int) -> None:
        self.hf_dir = weights.hf_dir or self.hf_dir  # the folder the stage's manifest names as its model

    def onload(self) -> None:
        pass

    def serving(self) -> Engine:
        return self.engine

    def served_folder(self) -> Path | None:
        return self.hf_dir

    def keeps_export(self, stage: int) -> bool:
        return stage == self.launch_stage

    def _launch(self) -> None:
        """A new engine on ``hf_dir``: with ``spread``, every rank takes part (collective, on the CPU group)."""
        if self.spread:
            from megamu.engines.sglang.nodes import start_sglang

            self.engine, self.node = start_sglang(str(self.hf_dir), replace(self.cfg.sglang, dtype=self.cfg.dtype))
        elif parallel.is_main_rank():
            self.engine = build_engine(self.cfg, self.hf_dir)

    def _weights_back(self) -> None:
        """Before a push: weight memory the servers gave back, taken again (only servers that save memory give any
        back)."""

    def eval_engine(self, weights: Weights | None = None) -> Engine:
        if weights is not None and self.engine is not None:
            self._weights_back()
            self.engine.update_weights(hf_dir=str(weights.hf_dir), version=weights.version)
            self.onload()  # the rest of the engine's memory back
        elif weights is not None:
            self.engine = build_engine(self.cfg, weights.hf_dir)
        return self.engine

    def _shutdown(self) -> None:
        """Stop rank 0's engine and this node's servers (one engine when they are the same)."""
        for engine in {id(e): e for e in (self.engine, self.node) if e is not None}.values():
            engine.shutdown()
        self.engine = self.node = None

    def stop(self) -> None:
        self._shutdown()


class RestartEachStage(LifecycleBase):
    """Staged mode (§4): each stage's engine starts on θ_k's HF folder and stops once D_k is written."""

    def start(self, stage: int) -> None:
        self._launch()

    def offload(self) -> None:
        if self.spread:  # every node's servers serve until rank 0 is done with them (its phase and evaluation)
            parallel.wait_for_main_rank()
        self._shutdown()  # each node's shutdown returns once its servers' processes are gone


class ColocatedLocal(LifecycleBase):
    """Colocated mode with the in-process engine: started once from a folder; later stages push tensors into it."""

    def __init__(self, cfg: EngineConfig, log: Log | None = None, probe_ids: list[int] | None = None):
        super().__init__(cfg, log, probe_ids)
        self.warm = False  # every rank: the engine is up (after stage 0)

    def wants(self) -> WeightRequest:
        return WeightRequest(folder=not self.warm, tensors=self.warm)

    def update_weights(self, weights: Weights, stage: int) -> None:
        super().update_weights(weights, stage)
        if self.warm and parallel.is_main_rank():
            self.engine.update_weights(hf_dir=None if weights.tensors is not None else str(weights.hf_dir),
                                       state_dict=weights.tensors, version=weights.version)

    def start(self, stage: int) -> None:
        if not self.warm:
            self._launch()

    def offload(self) -> None:
        self.warm = True
