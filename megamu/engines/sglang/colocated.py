"""Colocated SGLang across the stages (megamu.engines.lifecycle): servers started once, refreshed in place.

Stage 0 starts the servers from θ_0's HF folder; later stages push θ_k from a folder (--weight-sync disk: every
node's servers read it) or in memory, broadcast from rank 0 or, for servers on the trainer's GPUs over several nodes,
pushed by each node to its own servers (CUDA IPC handles open only on their own host; slime's colocated update does
the same). Each push is checked (layout, weight version, a teacher-forced log-prob probe) and logged as a "sync"
record. Servers on the trainer's GPUs (--sglang-memory-saver) give their memory back while the trainer trains and
take it again around the push (memory_saver.py): weights first, the KV cache once the pushed tensors are freed.
A refresh survives one fault (push_recovery.py): a failed push is sent again, then reloaded from an export of the same
weights; a probe mismatch is pushed again once; each fault is logged as a "sync_fault" record.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from megamu.engines import EngineConfig
from megamu.engines.lifecycle.base import LifecycleBase, Log, WeightRequest
from megamu.engines.sglang import memory_saver
from megamu.engines.sglang.push_recovery import push_surviving_one_fault, write_recovery_export
from megamu.engines.sglang.rank_push import RankPush
from megamu.engines.sglang.schema import SGLangError
from megamu.engines.sglang.tensor_sync import transport
from megamu.engines.sglang.weight_sync import SyncReport, check_probe
from megamu.engines.weights import Weights
from megamu.runtime import parallel


class ColocatedSGLang(LifecycleBase):
    def __init__(self, cfg: EngineConfig, log: Log | None = None, probe_ids: list[int] | None = None):
        super().__init__(cfg, log, probe_ids)
        self.warm = False  # every rank: the servers are up (after stage 0)
        self.saves_memory = cfg.sglang.memory_saver  # servers that take turns with the trainer for the GPU's memory
        self.released: tuple[str, ...] = ()  # what they have given back now
        self.report = None  # (stage, SyncReport) of the last push, logged once its probe is checked
        self.pending = None  # the probe of a push into servers that released their KV cache, checked by onload()
        self.pusher: RankPush | None = None  # per-rank pushes (every_node), built at the first
        sglang = cfg.sglang
        self.memory_sync = sglang.weight_sync == "memory"
        # in-memory pushes as tensors over several nodes: each node pushes to its own servers; a broadcast (servers
        # on GPUs of their own, or gloo) goes from rank 0 to every node's servers in one group
        self.every_node = self.memory_sync and self.spread and transport(
            sglang.shares_trainer_devices, sglang.sync_backend) == "tensor"

    def wants(self) -> WeightRequest:
        if not self.warm:
            return WeightRequest(folder=True)
        return WeightRequest(folder=not self.memory_sync, tensors=self.memory_sync, every_node=self.every_node,
                             probe_ids=self.probe_ids)

    def update_weights(self, weights: Weights, stage: int) -> None:
        """A push into the running servers (rank 0; each node's local rank 0 for per-node pushes)."""
        super().update_weights(weights, stage)
        if self.warm and self.every_node:  # the same on every rank: all take part
            return self._push_per_node(weights, stage)
        if not self.warm or not parallel.is_main_rank():
            return
        self._weights_back()  # the push lands in the servers' own weight memory
        # servers without their KV cache cannot run the probe: it waits for onload()
        probe, self.pending = (None, weights.probe) if self.released else (weights.probe, None)
        hf_dir = None if weights.tensors is not None else str(weights.hf_dir)

        def push():
            return self.engine.update_weights(hf_dir=hf_dir, state_dict=weights.tensors, version=weights.version,
                                              probe=probe)

        report = push_surviving_one_fault(push, push, self._new_sync_group, self._reloader(weights, probe, stage),
                                          self._noter(stage))
        self.report = (stage, report)
        if self.pending is None:
            self._log_sync()

    def _push_per_node(self, weights: Weights, stage: int) -> None:
        """Every rank pushes its own GPU's copy of the tensors to the server on its GPU (rank_push.py, slime's
        colocated pattern); then rank 0 checks that every server reports the new version (and the probe) and logs one
        sync for all. A failure on any rank raises on every rank, naming the rank, so none waits for the others."""
        if parallel.is_main_rank():
            self._weights_back()  # every node's servers take their weight memory back first
        parallel.wait_for_main_rank()
        if self.pusher is None:  # collective, once: the servers keep their URLs for the engine's life
            self.pusher = RankPush(self.node.pool.control_urls if self.node else None,
                                   self.node.pool.api_key if self.node else None, self.cfg.sglang,
                                   parallel.ranks_per_node())
        tensors = weights.tensors or {}
        refused = ""
        if self.node is not None:  # weights that do not fit are refused before any rank sends a byte
            try:
                self.node.check_pushable(tensors)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                refused = f"rank {parallel.rank()}: {type(e).__name__}: {e}"
        refusals = [r for r in parallel.all_gather_object(refused, wait=True) if r]
        if refusals:
            raise SGLangError("the in-memory weight push was refused:\n" + "\n".join(refusals))
        for attempt in range(2):  # a failed push is sent once more: every rank sees the same errors, all retry
            pushed = self._push_ranks(tensors, weights.version)
            errors = [e for e, _, _ in pushed if e]
            if not errors:
                break
            if parallel.is_main_rank():
                self._note(stage, "push failed" + (": pushing again" if attempt == 0 else " again"),
                           SGLangError("\n".join(errors)))
        if self.node is not None:  # the engine owning this node's servers: their version, and a restart's copy
            self.node.pushed_by_ranks(tensors, weights.version)
        if not parallel.is_main_rank():
            return
        probe, self.pending = (None, weights.probe) if self.released else (weights.probe, None)
        if errors:  # twice: rank 0 writes its copy of θ_k and every server reloads it (no process group needed)
            reload = self._reloader(weights, probe, stage)
            if reload is None:
                raise SGLangError("the in-memory weight push failed twice on some ranks:\n" + "\n".join(errors))
            try:
                reload()
            except Exception as e:
                raise SGLangError("the in-memory weight push failed twice and the servers could not reload the "
                                  f"same weights from disk: stopping: {e}") from e
            probe = None  # the reload's own update checked it
        # a probe mismatch: rank 0 pushes its copy once more to every server of this node's host
        again = (lambda: self.engine.update_weights(state_dict=tensors, version=weights.version, probe=probe))
        confirmed = push_surviving_one_fault(lambda: self.engine.adopt_weights(weights.version, probe), again,
                                             self._new_sync_group, None, self._noter(stage))
        self.report = (stage, SyncReport("memory (tensor, per rank)", max(s for _, _, s in pushed) + confirmed.seconds,
                                         confirmed.version, sum(b for _, b, _ in pushed),
                                         confirmed.probe_mean_abs_diff))
        if self.pending is None:
            self._log_sync()

    def _push_ranks(self, tensors: dict, version) -> list[tuple[str, int, float]]:
        """One per-rank push (collective): (error or "", bytes, seconds) of every rank."""
        error, sent, t0 = "", 0, time.perf_counter()
        try:
            sent = self.pusher.push(tensors, version)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            error = f"rank {parallel.rank()}: {type(e).__name__}: {e}"
        return parallel.all_gather_object((error, sent, time.perf_counter() - t0), wait=True)

    def onload(self) -> None:
        """The servers' KV cache and CUDA graphs back once the trainer has offloaded; then the push's probe (rank 0),
        which a mismatch answers by pushing the host copy of the weights once more (push_recovery.py)."""
        if not parallel.is_main_rank():
            return
        self._resume(*memory_saver.ALL)
        if self.pending is not None:
            stage, report = self.report
            probe, self.pending = self.pending, None

            def again() -> float:
                copy = self._host_copy()
                if copy is None:
                    raise SGLangError("the probe failed after the push, and no host copy of the weights is kept to "
                                      "push again (--rollout-max-restarts 0 keeps none): stopping")
                return self.engine.update_weights(state_dict=copy, version=report.version,
                                                  probe=probe).probe_mean_abs_diff

            diff = push_surviving_one_fault(lambda: check_probe(self.engine, probe), again, self._new_sync_group,
                                            None, self._noter(stage))
            self.report = (stage, replace(report, probe_mean_abs_diff=diff))
            self._log_sync()

    # ---- faults (push_recovery.py) ------------------------------------------------------------------------------
    def _note(self, stage: int, what: str, error: BaseException) -> None:
        print(f"[sglang] stage {stage}: {what} ({type(error).__name__}: {error})", flush=True)
        self.log("sync_fault", stage=stage, action=what, error=f"{type(error).__name__}: {error}"[:2000])

    def _noter(self, stage: int):
        return lambda what, error: self._note(stage, what, error)

    def _new_sync_group(self) -> None:
        """The next in-memory broadcast makes a new group: a failed one may have lost a member mid-bucket."""
        weights = getattr(self.engine, "weights", None)
        if weights is not None:
            weights.sync.lost_server()

    def _host_copy(self) -> dict | None:
        """The host copy of the last push kept for restarted servers (rank 0's engine, or this node's)."""
        for engine in (self.engine, self.node):
            copy = getattr(getattr(getattr(engine, "weights", None), "sync", None), "restore_tensors", None)
            if copy is not None:
                return copy
        return None

    def _reloader(self, weights: Weights, probe, stage: int):
        """The last resort of a push that failed twice: θ_k written beside the launch export from the tensors rank
        0 holds, and reloaded by every server from there; None for a disk sync (its folder is what failed)."""
        if weights.tensors is None or self.hf_dir is None:
            return None

        def reload():
            folder = write_recovery_export(weights.tensors, Path(self.hf_dir), stage)
            return self.engine.update_weights(hf_dir=str(folder), version=weights.version, probe=probe)

        return reload

    def _log_sync(self) -> None:
        stage, r = self.report
        self.log("sync", step=stage, stage=stage, mode=r.mode, t_sync=r.seconds, bytes=r.bytes,
                 weight_version=r.version, probe_mean_abs_diff=r.probe_mean_abs_diff)

    def start(self, stage: int) -> None:
        """Stage 0 starts the servers (restarts load its export, so the loop keeps it until stop()); later stages
        turn a node's own probes back on for the rollout."""
        if not self.warm:
            self._launch()
            if not self.cfg.sglang.urls:
                self.launch_stage = stage
        else:
            for engine in {id(e): e for e in (self.engine, self.node) if e is not None}.values():
                engine.resume_probes()
            if self.node is not None:
                self.node.watching(True)

    def offload(self) -> None:
        """D_k is written: the servers stay up for the next push, their memory given back when they share the GPUs."""
        if self.spread:  # every node's servers serve until rank 0 is done with them (its phase and evaluation)
            parallel.wait_for_main_rank()
            if self.node is not None:
                self.node.watching(False)  # pushes come next: a server busy loading one may miss its probes
                self.node.pause_probes()  # and none in flight when rank 0 releases their memory
            parallel.wait_for_main_rank()
        if self.saves_memory and self.engine is not None and not self.released:
            self.engine.pause_probes()  # SGLang asserts an idle server on release; a probe is a request
            memory_saver.release(self.engine.pool, memory_saver.ALL)
            self.released = memory_saver.ALL
        self.warm = True

    def _weights_back(self) -> None:
        self._resume(memory_saver.WEIGHTS)

    def _resume(self, *tags: str) -> None:
        todo = tuple(t for t in self.released if t in tags)
        if todo:
            memory_saver.resume(self.engine.pool, todo)
            self.released = tuple(t for t in self.released if t not in todo)

    def stop(self) -> None:
        if self.spread:  # every node's servers serve rank 0's final evaluation
            parallel.wait_for_main_rank()
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None
        self._shutdown()
