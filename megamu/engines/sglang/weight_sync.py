"""What a weight sync into SGLang servers checks and sends: the model's tensor layout, in-memory broadcasts, probes.

A server accepts any folder or tensor list it can load, and ``/update_weights_from_disk`` from a folder of another
architecture returns success and then serves garbage (tried on SGLang 0.5.23). So every sync is first compared with the
layout of the running model (architecture, tensor names, shapes, dtype) and refused, naming the first mismatch.

In-memory syncs use SGLang's own scheme (``/init_weights_update_group``, then per bucket
``/update_weights_from_distributed`` while this process broadcasts): this process is rank 0 of a process group whose
other ranks are the servers' TP workers. The group is made exactly as the server makes its side
(``sglang.srt.utils.common.init_custom_process_group``: tcp:// rendezvous, a store prefixed by the group name).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from megamu.engines.sglang.pool import ServerPool
from megamu.engines.sglang.tensor_sync import buckets, flatten, send_tensors, transport
from megamu.engines.weights import LogprobProbe
from megamu.runtime.net import free_port

# safetensors' dtype names -> torch's (the names SGLang's /update_weights_from_distributed takes)
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16"}


class WeightMismatch(ValueError):
    """New weights that do not fit the running model; the message names the first difference."""


class ProbeMismatch(WeightMismatch):
    """After a push, a server's log-probs of the probe are beyond its tolerance of the trainer's."""


@dataclass
class ModelLayout:
    """Architecture and tensors (name -> (shape, dtype)) of a model, as its HF folder or state dict says."""

    architectures: list[str]
    tensors: dict[str, tuple[tuple[int, ...], str]]
    tied_embeddings: bool = False

    @classmethod
    def from_folder(cls, hf_dir: str | Path) -> ModelLayout:
        """Read config.json and the safetensors headers only (a few KB, whatever the model's size)."""
        folder = Path(hf_dir)
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise WeightMismatch(f"{folder}: no readable config.json ({e})") from e
        index = folder / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
                 else [p.name for p in sorted(folder.glob("*.safetensors"))])
        if not files:
            raise WeightMismatch(f"{folder}: no *.safetensors files")
        tensors = {}
        for name in files:
            with open(folder / name, "rb") as f:
                header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
            for key, meta in header.items():
                if key != "__metadata__":
                    tensors[key] = (tuple(meta["shape"]), _SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"]))
        return cls(list(config.get("architectures") or []), tensors, bool(config.get("tie_word_embeddings", False)))

    @classmethod
    def from_state_dict(cls, state_dict: dict, architectures: list[str], tied: bool) -> ModelLayout:
        return cls(architectures, {k: (tuple(v.shape), str(v.dtype).removeprefix("torch."))
                                   for k, v in state_dict.items()}, tied)


def check_layout(new: ModelLayout, running: ModelLayout, server_dtype: str | None, what: str) -> None:
    """Raise WeightMismatch at the first difference between ``new`` and the running model.

    Floating tensors must be in the server's dtype when it has a fixed one (else in the running model's): weights in
    another dtype are converted silently, which hides an export in the wrong precision."""
    if new.architectures and running.architectures and new.architectures != running.architectures:
        raise WeightMismatch(f"{what}: architecture {new.architectures} but the server runs {running.architectures}")
    optional = {"lm_head.weight"} if running.tied_embeddings else set()
    for name in sorted(set(running.tensors) - optional):
        if name not in new.tensors:
            raise WeightMismatch(f"{what}: tensor {name} of the running model is missing")
    for name in sorted(new.tensors):
        if name not in running.tensors and name not in optional:
            raise WeightMismatch(f"{what}: tensor {name} is not in the running model")
        shape, dtype = new.tensors[name]
        # a tied lm_head absent from the running folder is the embedding matrix
        embedding = running.tensors.get("model.embed_tokens.weight", (shape, dtype))
        ref_shape, ref_dtype = running.tensors.get(name) or embedding
        if shape != ref_shape:
            raise WeightMismatch(f"{what}: tensor {name} has shape {list(shape)}, the running model {list(ref_shape)}")
        want = server_dtype if server_dtype in _FLOAT_DTYPES else ref_dtype
        if dtype in _FLOAT_DTYPES and dtype != want:
            raise WeightMismatch(f"{what}: tensor {name} is {dtype}, the server runs {want}")


def compare_probe(probe: LogprobProbe, served: list[float], what: str) -> float:
    """Mean |served - trainer| over the probe's tokens; raises WeightMismatch beyond the tolerance."""
    if len(served) != len(probe.logprobs) or not served:
        raise ProbeMismatch(f"{what}: server returned {len(served)} log-probs for a probe of {len(probe.logprobs)}")
    diffs = [abs(a - b) for a, b in zip(served, probe.logprobs)]
    mean = sum(diffs) / len(diffs)
    if not mean <= probe.tolerance:  # NaN fails too
        worst = max(range(len(diffs)), key=lambda i: diffs[i] if diffs[i] == diffs[i] else float("inf"))
        raise ProbeMismatch(f"{what}: server log-probs differ from the trainer's by {mean:.3g} on average "
                             f"(> {probe.tolerance}); worst: probe token {worst + 1}, {served[worst]:.6f} vs "
                             f"{probe.logprobs[worst]:.6f}")
    return mean


def open_weight_group(master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
                      timeout_s: float, rank: int = 0):
    """Rank ``rank`` (this process: 0) of the weight-sync group; blocks until every rank has joined (call it while
    the /init_weights_update_group requests are in flight).

    The store is made here, not by ``torch.distributed.rendezvous``: under torchrun (TORCHELASTIC_USE_AGENT_STORE)
    rendezvous never starts a store on rank 0 but connects to the given port as a client, so trainer and servers would
    all wait for a store nobody serves. The servers' side (SGLang's ``init_custom_process_group``, run without
    torchrun's variables: launch.server_env) connects to this one with the same key prefix."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast(pg, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    dist.broadcast(tensor, group=pg, group_src=0)


class WeightGroup:
    """The process group of in-memory syncs: this process is rank 0, the TP workers of ``urls`` follow."""

    def __init__(self, pool: ServerPool, group_name: str, urls: list[str]):
        cfg = pool.config
        self.pool, self.group_name, self.urls = pool, group_name, list(urls)
        tp = cfg.tp_size
        world = 1 + tp * len(self.urls)
        port = free_port(cfg.sync_master_address)
        futures = [pool.executor.submit(pool.post_with_retries, [url], "/init_weights_update_group",
                                       dict(master_address=cfg.sync_master_address, master_port=port,
                                            rank_offset=1 + i * tp, world_size=world, group_name=group_name,
                                            backend=cfg.sync_backend), f"weight-sync group on {url}")
                   for i, url in enumerate(self.urls)]
        try:
            self.pg = open_weight_group(cfg.sync_master_address, port, world, group_name, cfg.sync_backend,
                                        timeout_s=min(cfg.request_timeout_s, 600.0))
        finally:
            outs = [f.result() for f in futures]
        for url, out in zip(self.urls, outs):
            if isinstance(out, dict) and out.get("success") is False:
                raise RuntimeError(f"{url}/init_weights_update_group failed: {out.get('message')}")

    def send(self, state_dict: dict, version: str) -> int:
        """Broadcast ``state_dict`` bucket by bucket inside one begin/end weight-update session; returns bytes."""
        pool, sent, urls = self.pool, 0, self.urls
        groups = buckets(state_dict, int(pool.config.weight_bucket_mb * 2**20))
        bracketed = pool.begin_weight_update(urls)
        try:
            for k, names in enumerate(groups):
                last = k == len(groups) - 1
                body = dict(names=names, dtypes=[str(state_dict[n].dtype).removeprefix("torch.") for n in names],
                            shapes=[list(state_dict[n].shape) for n in names], group_name=self.group_name,
                            load_format="flattened_bucket", flush_cache=last,
                            weight_version=version if last else None)
                futures = [pool.executor.submit(pool.post_with_retries, [u], "/update_weights_from_distributed",
                                                body, f"in-memory weight update on {u}") for u in urls]
                flat = flatten([state_dict[n] for n in names])
                broadcast(self.pg, flat)
                for url, f in zip(urls, futures):
                    out = f.result()
                    if isinstance(out, dict) and out.get("success") is False:
                        raise RuntimeError(f"{url}/update_weights_from_distributed failed: {out.get('message')}")
                sent += flat.numel()
        finally:  # close the session even after a failed bucket (see ServerWeights.update for what that leaves)
            pool.end_weight_update(bracketed, urls)
        return sent

    def close(self) -> None:
        import torch.distributed as dist

        for url in self.urls:
            try:
                self.pool.call(url, "/destroy_weights_update_group", {"group_name": self.group_name}, timeout=30)
            except Exception:  # the server may be gone already; its side of the group goes with it
                pass
        try:
            dist.destroy_process_group(self.pg)
        except Exception:
            pass


class WeightSync:
    """An engine's in-memory sync state: the broadcast group to all its servers (made at the first in-memory sync,
    made again after a server died: its side of the group went with it) and the host copy of the last push, which a
    restarted server is given (its launch folder holds older weights)."""

    def __init__(self):
        self.group: WeightGroup | None = None
        self.stale = False  # a server died since the group was made (health.py)
        self.count = 0  # groups made so far: each has a fresh name, the servers may still know an old one
        self.restore_tensors: dict | None = None

    def lost_server(self) -> None:
        """A server died (health.py): its side of the group is gone, or will be after its restart, so the next
        broadcast makes a new group."""
        self.stale = True

    def new_group(self, pool: ServerPool, members: list[str]) -> WeightGroup:
        self.count += 1
        return WeightGroup(pool, f"megamu-{pool.run_id}-{self.count}", members)

    def broadcast_group(self, pool: ServerPool) -> WeightGroup:
        if self.group is not None and self.stale:
            self.close()
        if self.group is None:
            self.group, self.stale = self.new_group(pool, pool.control_urls), False
        return self.group

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def push_tensors(pool: ServerPool, sync: WeightSync, state_dict: dict, version: str,
                 urls: list[str] | None = None) -> tuple[int, str]:
    """Send ``state_dict`` to the servers ``urls`` (default: all of the pool's) by the transport their placement
    takes (tensor_sync.transport); (bytes sent, the sync's mode). A broadcast to all servers reuses one group
    (``sync``); one to a few servers (a restarted one) has a group of its own for that push."""
    if transport(pool.config.shares_trainer_devices, pool.config.sync_backend) == "tensor":
        return send_tensors(pool, state_dict, version, urls), "memory (tensor)"
    if urls is not None and list(urls) != pool.control_urls:
        group = sync.new_group(pool, urls)
        try:
            return group.send(state_dict, version), "memory"
        finally:
            group.close()
    return sync.broadcast_group(pool).send(state_dict, version), "memory"


def host_copy(state_dict: dict, into: dict | None = None) -> dict:
    """The pushed weights in host memory, for a restarted server (whose launch folder holds older weights). Reuses
    ``into`` when it holds the same tensors (no allocation per push); from a GPU into pinned memory, asynchronously,
    one synchronisation at the end."""
    same = into is not None and into.keys() == state_dict.keys() and all(
        into[n].shape == t.shape and into[n].dtype == t.dtype for n, t in state_dict.items())
    out = into if same else {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                             for n, t in state_dict.items()}
    for n, t in state_dict.items():
        out[n].copy_(t.detach(), non_blocking=t.is_cuda)
    if any(t.is_cuda for t in state_dict.values()):
        torch.cuda.synchronize()
    return out


@dataclass
class SyncReport:
    """One weight sync, for the metrics."""

    mode: str  # "disk" | "memory" | "memory (tensor)" | "memory (tensor, per node)" (colocated.py) | "confirm"
    seconds: float
    version: str
    bytes: int = 0  # sent in memory
    probe_mean_abs_diff: float | None = None


def check_probe(engine, probe: LogprobProbe) -> float:
    """The worst server's mean |log-prob difference| on the probe; raises WeightMismatch beyond its tolerance. The
    servers must hold their KV cache (a colocated server that released it checks after taking it back). ``engine``:
    anything with ``control_urls`` and ``teacher_forced_logprobs`` (an SGLangEngine)."""
    return probe_servers(probe, engine.control_urls, engine.teacher_forced_logprobs)


def probe_servers(probe: LogprobProbe, urls, logprobs) -> float:
    """``check_probe`` on the servers ``urls``, scored by ``logprobs(token_ids, url)``."""
    return max(compare_probe(probe, logprobs(probe.token_ids, url), f"server {url}") for url in urls)
