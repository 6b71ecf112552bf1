"""SGLang servers over several nodes: local rank 0 of each node launches that node's servers, global rank 0 dispatches.

Call ``start_sglang`` on every rank of the trainer (it is collective). Servers must listen on an address the other
nodes reach (``SGLangConfig.host``, e.g. "0.0.0.0"), and in-memory syncs need ``sync_master_address`` = global rank
0's address and the "nccl" backend on GPUs. One API key is drawn on rank 0 and shared, so the dispatcher is accepted
by every node's servers. A node whose servers another rank dispatches to watches them itself and restarts the dead
ones (health.py, ``keep_alive``); the dispatcher moves their requests meanwhile and takes them back when they
answer. With ``cfg.router`` (a running sglang-router) the servers join the router for the engine's life instead.
URLs and the key travel over the CPU-side gloo group: the trainer has offloaded by then, and servers may take
minutes to load.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import replace

from megamu.engines.sglang.client import SGLangEngine, SGLangError
from megamu.engines.sglang.launch import SGLangConfig
from megamu.engines.sglang.pool import ServerPool
from megamu.runtime import parallel


def start_sglang(hf_dir: str | None, cfg: SGLangConfig) -> tuple[SGLangEngine | None, SGLangEngine | None]:
    """(dispatcher, node servers): the engine global rank 0 generates and syncs with (None elsewhere), and the engine
    owning this node's servers on each local rank 0 (None elsewhere; ``shutdown()`` it to stop them).

    Without torch.distributed (or with ``cfg.urls``: servers someone else runs) this is one engine on one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        engine = SGLangEngine(hf_dir, cfg)
        if cfg.router and engine.launched:
            engine.keep_alive()
            return through_router(cfg, engine.urls), engine
        return engine, (engine if engine.launched else None)
    rank = dist.get_rank()
    if cfg.urls:
        return (SGLangEngine(hf_dir, cfg) if rank == 0 else None), None
    cfg = replace(cfg, api_key=parallel.broadcast_object(
        cfg.api_key or os.environ.get("SGLANG_API_KEY") or secrets.token_hex(16), wait=True))
    node, error = None, ""
    if parallel.is_node_main():
        try:
            node = SGLangEngine(hf_dir, cfg)
        except (SGLangError, OSError, ValueError) as e:
            error = f"rank {rank}: {e}"
    gathered = parallel.all_gather_object((node.urls if node else [], error, socket.gethostname()), wait=True)
    errors = [e for _, e, _ in gathered if e]
    if len({h for urls, _, h in gathered if urls}) > 1 and cfg.host in ("127.0.0.1", "localhost"):
        errors.append(f"servers on several nodes listen on {cfg.host}, which rank 0 cannot reach on the other nodes: "
                      "set the host field (--sglang-host) to an address they reach, e.g. 0.0.0.0")
    if errors:  # every rank raises, so none waits forever for a node that failed
        if node is not None:
            node.shutdown()
        raise SGLangError("SGLang servers failed to start on some nodes:\n" + "\n".join(errors))
    urls = [u for node_urls, _, _ in gathered for u in node_urls]
    if node is not None and not (rank == 0 and urls == node.urls and not cfg.router):
        node.keep_alive()  # the dispatcher is elsewhere: this node watches and restarts its own servers
    dispatcher = None
    if rank == 0 and cfg.router:
        dispatcher = through_router(cfg, urls)
    elif rank == 0:
        dispatcher = node if urls == (node.urls if node else None) else SGLangEngine(None, replace(cfg, urls=urls))
    return dispatcher, node


def through_router(cfg: SGLangConfig, urls: list[str]) -> SGLangEngine:
    """Rank 0's engine when ``cfg.router`` names a running sglang-router: the launched servers join it
    (``POST /workers``, sglang-router >= 0.3) and leave it when the engine shuts down, before the
    servers stop; requests go through the router, which places them."""
    router = cfg.router.rstrip("/")
    engine = None
    try:
        engine = SGLangEngine(None, replace(cfg, urls=[router], router=None))
        for url in urls:
            join_router(engine.pool, router, url)
        engine.pool.control_urls = list(urls)  # weight syncs, memory calls and probes go to the servers, not the router
        engine.read_limits([engine.check_server(u, None) for u in urls], None)  # the servers' model, not the router's
        engine.refresh_capacities()  # the router's capacity: the sum of its workers', now ours
    except BaseException:
        if engine is not None:
            engine.shutdown()
        raise
    return engine


def join_router(pool: ServerPool, router: str, url: str, timeout_s: float = 60.0) -> None:
    """Add server ``url`` to sglang-router ``router``'s workers until ``pool`` leaves its routers (its engine's
    shutdown), and wait until the router lists it healthy (sglang-router >= 0.3: ``POST /workers`` queues the
    addition, with the server's API key for the router's own calls to it; ``DELETE /workers/<id>`` at shutdown)."""
    try:
        added = pool.call(router, "/workers", {"url": url, "api_key": pool.api_key}, timeout=60.0) or {}
    except SGLangError as e:
        if e.status in (404, 405):
            raise SGLangError(f"{router} has no /workers API: --sglang-router needs sglang-router >= 0.3 "
                              "(POST /workers, GET /workers, DELETE /workers/<id>)") from e
        raise
    deadline = time.monotonic() + timeout_s
    while True:
        listed = (pool.call(router, "/workers", None, timeout=30.0) or {}).get("workers") or []
        worker = next((w for w in listed if str(w.get("url", "")).rstrip("/") == url), None)
        if worker is not None and worker.get("is_healthy", True):
            break
        if time.monotonic() > deadline:
            raise SGLangError(f"the router {router} did not list {url} as a healthy worker within {timeout_s:.0f}s "
                              f"(it lists {[w.get('url') for w in listed]})")
        time.sleep(0.2)
    pool.router_workers.append((router, str(added.get("worker_id") or worker.get("id"))))
