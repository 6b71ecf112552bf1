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

from megamu.engines.sglang.tensor_sync import buckets, flatten, send_tensors, transport
from megamu.net import free_port
from megamu.weights import LogprobProbe

# safetensors' dtype names -> torch's (the names SGLang's /update_weights_from_distributed takes)
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16"}


class WeightMismatch(ValueError):
    """New weights that do not fit the running model; the message names the first difference."""


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
        raise WeightMismatch(f"{what}: server returned {len(served)} log-probs for a probe of {len(probe.logprobs)}")
    diffs = [abs(a - b) for a, b in zip(served, probe.logprobs)]
    mean = sum(diffs) / len(diffs)
    if not mean <= probe.tolerance:  # NaN fails too
        worst = max(range(len(diffs)), key=lambda i: diffs[i] if diffs[i] == diffs[i] else float("inf"))
        raise WeightMismatch(f"{what}: server log-probs differ from the trainer's by {mean:.3g} on average "
                             f"(> {probe.tolerance}); worst: probe token {worst + 1}, {served[worst]:.6f} vs "
                             f"{probe.logprobs[worst]:.6f}")
    return mean


def open_weight_group(master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
                      timeout_s: float):
    """Rank 0 of the weight-sync group; blocks until every server rank has joined (call it while the
    /init_weights_update_group requests are in flight)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", 0, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast(pg, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    dist.broadcast(tensor, group=pg, group_src=0)


@dataclass
class SyncReport:
    """One weight sync, for the metrics."""

    mode: str  # "disk" | "memory"
    seconds: float
    version: str
    bytes: int = 0  # sent in memory
    probe_mean_abs_diff: float | None = None


class WeightGroup:
    """The process group of in-memory syncs: this process is rank 0, each server's TP workers follow."""

    def __init__(self, engine, group_name: str):
        cfg = engine.config
        self.engine, self.group_name = engine, group_name
        tp = cfg.tp_size
        world = 1 + tp * len(engine.urls)
        port = free_port(cfg.sync_master_address)
        futures = [engine._pool.submit(engine._post_with_retries, [url], "/init_weights_update_group",
                                       dict(master_address=cfg.sync_master_address, master_port=port,
                                            rank_offset=1 + i * tp, world_size=world, group_name=group_name,
                                            backend=cfg.sync_backend), f"weight-sync group on {url}")
                   for i, url in enumerate(engine.urls)]
        try:
            self.pg = open_weight_group(cfg.sync_master_address, port, world, group_name, cfg.sync_backend,
                                        timeout_s=min(cfg.request_timeout_s, 600.0))
        finally:
            outs = [f.result() for f in futures]
        for url, out in zip(engine.urls, outs):
            if isinstance(out, dict) and out.get("success") is False:
                raise RuntimeError(f"{url}/init_weights_update_group failed: {out.get('message')}")

    def send(self, state_dict: dict, version: str) -> int:
        """Broadcast ``state_dict`` bucket by bucket inside one begin/end weight-update session; returns bytes."""
        engine, sent = self.engine, 0
        groups = buckets(state_dict, int(engine.config.weight_bucket_mb * 2**20))
        engine._post_all("/begin_weight_update", {}, "begin weight update")
        try:
            for k, names in enumerate(groups):
                last = k == len(groups) - 1
                body = dict(names=names, dtypes=[str(state_dict[n].dtype).removeprefix("torch.") for n in names],
                            shapes=[list(state_dict[n].shape) for n in names], group_name=self.group_name,
                            load_format="flattened_bucket", flush_cache=last,
                            weight_version=version if last else None)
                futures = [engine._pool.submit(engine._post_with_retries, [u], "/update_weights_from_distributed",
                                               body, f"in-memory weight update on {u}") for u in engine.urls]
                flat = flatten([state_dict[n] for n in names])
                broadcast(self.pg, flat)
                for url, f in zip(engine.urls, futures):
                    out = f.result()
                    if isinstance(out, dict) and out.get("success") is False:
                        raise RuntimeError(f"{url}/update_weights_from_distributed failed: {out.get('message')}")
                sent += flat.numel()
        finally:  # close the session even after a failed bucket (see sync_weights for what that leaves)
            engine._post_all("/end_weight_update", {}, "end weight update")
        return sent

    def close(self) -> None:
        import torch.distributed as dist

        for url in self.engine.urls:
            try:
                self.engine._call(url, "/destroy_weights_update_group", {"group_name": self.group_name}, timeout=30)
            except Exception:  # the server may be gone already; its side of the group goes with it
                pass
        try:
            dist.destroy_process_group(self.pg)
        except Exception:
            pass


def sync_weights(engine, hf_dir, state_dict, version, probe: LogprobProbe | None) -> SyncReport:
    """Check, send, verify: the body of SGLangEngine.update_weights."""
    import time

    if (hf_dir is None) == (state_dict is None):
        raise ValueError("update_weights needs exactly one of hf_dir or state_dict")
    t0 = time.monotonic()
    if version is None:
        version = int(engine.weight_version) + 1 if str(engine.weight_version).isdigit() else 1
    version = str(version)
    running = engine.layout
    if hf_dir is not None:
        new = ModelLayout.from_folder(hf_dir)
        if running is not None:
            check_layout(new, running, engine.server_dtype, f"weights in {hf_dir}")
        engine._post_all("/update_weights_from_disk",
                         {"model_path": str(hf_dir), "flush_cache": True, "weight_version": version},
                         f"weight update from {hf_dir}")
        engine.layout, sent, mode = new, 0, "disk"
    else:
        if running is None:
            raise WeightMismatch("an in-memory sync needs the running model's layout (its HF folder readable here)")
        new = ModelLayout.from_state_dict(state_dict, running.architectures, running.tied_embeddings)
        check_layout(new, running, engine.server_dtype, "in-memory weights")
        try:
            if transport(engine.config.shares_trainer_devices, engine.config.sync_backend) == "tensor":
                sent, mode = send_tensors(engine, state_dict, version), "memory (tensor)"
            else:
                if engine._sync is None:
                    engine._sync = WeightGroup(engine, f"megamu-{engine._run_id}")
                sent, mode = engine._sync.send(state_dict, version), "memory"
        except BaseException:
            # The servers may hold part of the new weights under the old version: expect a version no server
            # reports, so every sample generated before a successful sync is refused.
            engine.weight_version = f"{version} (incomplete sync)"
            raise
    try:
        infos = [engine._call(u, "/model_info", None, timeout=60.0) or {} for u in engine.urls]
    except RuntimeError as e:  # a router may not forward /model_info; the samples' versions are still checked
        if getattr(e, "status", None) != 404:
            raise
        infos = [{"weight_version": version}]
    got = {str(i.get("weight_version")) for i in infos}
    if got != {version}:
        raise RuntimeError(f"after the sync the servers report weight version(s) {sorted(got)}, not {version}")
    engine.weight_version = version
    engine.weights_folder = str(hf_dir) if hf_dir is not None else None  # what a restarted server loads (health.py)
    probe_diff = check_probe(engine, probe) if probe is not None else None
    return SyncReport(mode, time.monotonic() - t0, version, sent, probe_diff)


def check_probe(engine, probe: LogprobProbe) -> float:
    """The worst server's mean |log-prob difference| on the probe; raises WeightMismatch beyond its tolerance. The
    servers must hold their KV cache (a colocated server that released it checks after taking it back)."""
    return max(compare_probe(probe, engine.teacher_forced_logprobs(probe.token_ids, url), f"server {url}")
               for url in engine.urls)
