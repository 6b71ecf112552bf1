"""Each trainer rank pushes its own GPU's copy of the weights to the SGLang server on that GPU (colocated servers).

slime's colocated update (slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py,
``_send_to_colocated_engine``): every trainer rank holds the full HF weights of a bucket on its own GPU (all-gathered
over TP), serializes its flattened bucket (a CUDA IPC handle of its own GPU's memory), and the ranks on one engine's
GPUs ``gather_object`` their payloads (gloo) to the rank on the engine's first GPU, which posts them as the list of
``serialized_named_tensors``, entry i for the engine's TP rank i, i.e. for the GPU it runs on. No server opens a CUDA
context on another GPU, and no refresh copies weights between GPUs. After each bucket the handles are let go and
``torch.cuda.ipc_collect()`` reclaims the blocks whose consumers closed them (slime: ``accelerator.ipc_collect()``
after each bucket and after the push), through ``megamu.runtime.device.Device.ipc_collect``.

Placement: torchrun numbers ranks node by node (global rank = node x ranks per node + local rank) and binds local
rank L to GPU L; megamu launches a node's server i on GPUs [i x tp, (i + 1) x tp) (``--base-gpu-id``, launch.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megamu.engines.sglang.pool import ServerPool
from megamu.engines.sglang.tensor_sync import buckets, serialize_bucket
from megamu.runtime import parallel


@dataclass(frozen=True)
class RankTarget:
    """Where one trainer rank's weights go: the server on its GPU (None: no server there), its place among that
    server's TP ranks, and the rank that posts for the server (on the server's first GPU) with the server's ranks."""

    url: str | None
    tp_index: int
    source: int
    ranks: tuple[int, ...]


def rank_targets(node_urls: list[list[str] | None], ranks_per_node: int, server_tp: int) -> list[RankTarget]:
    """Every global rank's target, from each rank's entry of the node's server URLs (the node's local rank 0 has
    them, every other rank None), in rank order."""
    if len(node_urls) % ranks_per_node:
        raise ValueError(f"{len(node_urls)} ranks are not whole nodes of {ranks_per_node}")
    out = []
    for rank in range(len(node_urls)):
        local, first = rank % ranks_per_node, rank - rank % ranks_per_node
        urls, server = node_urls[first] or [], local // server_tp
        if server >= len(urls) or (server + 1) * server_tp > ranks_per_node:
            out.append(RankTarget(None, 0, rank, (rank,)))
            continue
        source = first + server * server_tp
        out.append(RankTarget(urls[server], local % server_tp, source, tuple(range(source, source + server_tp))))
    return out


class RankPush:
    """The per-rank push, built once on every rank (collective: the gloo groups of servers at TP > 1)."""

    def __init__(self, node_urls: list[str] | None, api_key: str | None, config, ranks_per_node: int):
        self._cfg = config
        every = parallel.all_gather_object((node_urls, api_key), wait=True)
        key = next((k for u, k in every if u), api_key)
        targets = rank_targets([u for u, _ in every], ranks_per_node, config.tp_size)
        self.target = targets[parallel.rank()]
        self.group = None
        if config.tp_size > 1:  # every rank creates every group (dist.new_group is collective), keeps its own
            for ranks in dict.fromkeys(t.ranks for t in targets if t.url is not None):
                group = dist.new_group(list(ranks), backend="gloo")
                if parallel.rank() in ranks:
                    self.group = group
        self.pool = None
        if self.target.url is not None and self.target.source == parallel.rank():
            self.pool = ServerPool(config, key)
            self.pool.control_urls = self.pool.urls = [self.target.url]
            self.pool.open_control()

    def push(self, state_dict: dict[str, torch.Tensor], version: str) -> int:
        """Push ``state_dict`` (this rank's full copy) bucket by bucket; returns the bytes this rank's server got
        (0 on ranks that do not post). Every rank calls it with the same names in the same order."""
        t, pool, sent = self.target, self.pool, 0
        if t.url is None:
            return 0
        bucket_bytes = int(self._cfg.weight_bucket_mb * 2**20)
        bracketed = pool is not None and pool.begin_weight_update()
        try:
            groups = buckets(state_dict, bucket_bytes)
            for k, names in enumerate(groups):
                named = [(n, state_dict[n]) for n in names]
                payload, flat = serialize_bucket(named)  # this rank's GPU: the server's TP rank t.tp_index opens it
                payloads, error = self._gather(payload), None
                if pool is not None:
                    last = k == len(groups) - 1
                    try:
                        out = pool.post_with_retries(
                            [t.url], "/update_weights_from_tensor",
                            {"serialized_named_tensors": payloads, "load_format": "flattened_bucket",
                             "flush_cache": last, "weight_version": version if last else None},
                            f"tensor weight update on {t.url}")
                        if isinstance(out, dict) and out.get("success") is False:
                            error = f"{t.url}/update_weights_from_tensor failed: {out.get('message')}"
                    except Exception as e:  # noqa: BLE001 - the server's other ranks must hear of it, not wait
                        error = f"{type(e).__name__}: {e}"
                    sent += sum(x.numel() * x.element_size() for _, x in named)
                # the server has read every rank's handle (or failed): each may let go of its flat bucket
                error = self._status(error)
                del flat, payload, payloads
                parallel.device().ipc_collect()
                if error:
                    raise RuntimeError(f"rank {parallel.rank()}: the push to {t.url} failed: {error}")
        finally:
            if pool is not None:
                pool.end_weight_update(bracketed)
        parallel.device().ipc_collect()
        return sent

    def close(self) -> None:
        if self.pool is not None and self.pool.executor is not None:
            self.pool.executor.shutdown(wait=False)

    def _gather(self, payload: str) -> list[str] | None:
        if self.group is None:
            return [payload]
        out = [None] * len(self.target.ranks) if parallel.rank() == self.target.source else None
        dist.gather_object(payload, out, dst=self.target.source, group=self.group)
        return out

    def _status(self, error: str | None) -> str | None:
        """The posting rank's outcome, on every rank of the server (slime broadcasts it the same way,
        ``_wait_for_bucket_completion``)."""
        if self.group is None:
            return error
        box = [error]
        dist.broadcast_object_list(box, src=self.target.source, group=self.group)
        return box[0]
