"""In-memory weight pushes to servers that share the trainer's GPUs: ``/update_weights_from_tensor``.

Why not the broadcast of weight_sync.py there: its process group puts trainer rank 0 and server 0 on GPU 0, and NCCL
refuses two ranks of one communicator on one device ("Duplicate GPU detected", ncclInvalidUsage). slime chooses the
transport by placement (``backends/megatron_utils/update_weight/``: ``UpdateWeightFromTensor`` for colocated servers,
``UpdateWeightFromDistributed`` for disjoint ones); so does ``transport`` here. gloo on CPU accepts a shared device,
which is why CPU tests alone could never see the problem.

What a tensor push sends (SGLang 0.5.23, read from its sources): inside a begin/end weight-update session, per
bucket, ``serialized_named_tensors`` holds one entry per server TP rank; each rank deserializes only its own entry with
a restricted unpickler (``SafeUnpickler``: torch's rebuild functions, ``types.SimpleNamespace``, builtins) and, with
``load_format="flattened_bucket"``, reads a dict {"flattened_tensor": uint8 tensor, "metadata": [name, shape, dtype,
start_idx, end_idx, numel]}. The tensors travel as torch.multiprocessing handles: CUDA IPC handles of the trainer's own
GPU memory (no copy), whose device is named by UUID, as SGLang's receiver maps it (processes may number GPUs
differently); CPU tensors as shared-memory files.
"""

from __future__ import annotations

import base64
import io
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import torch
import torch.multiprocessing.reductions as reductions

from megamu.engines.sglang.pool import ServerPool
from megamu.runtime.device import ipc_shareable_allocations

_CUDA_DEVICE_ARG = 6  # position of the device index in torch's rebuild_cuda_tensor arguments (stable for years)


def buckets(state_dict: dict, bucket_bytes: int) -> list[list[str]]:
    """Names in order, cut into buckets of about ``bucket_bytes`` and of one dtype each (SGLang's flattened bucket
    places tensors back to back, so each must start at a multiple of its element size)."""
    out, current, size, dtype = [], [], 0, None
    for name, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        if current and (size + nbytes > bucket_bytes or t.dtype != dtype):
            out.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
        dtype = t.dtype
    if current:
        out.append(current)
    return out


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors`` back to back, as SGLang's FlattenedTensorBucket expects them."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def transport(shares_trainer_devices: bool, backend: str) -> str:
    """How an in-memory push travels: "tensor" (IPC handles over HTTP) when a server shares a GPU with a trainer rank,
    "distributed" (a broadcast group) otherwise. Never NCCL on a shared device; gloo (CPU) accepts one."""
    return "tensor" if shares_trainer_devices and backend == "nccl" else "distributed"


def _reduce_with_device_uuid(tensor: torch.Tensor):
    fn, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:  # the receiver maps a UUID to its own index for the same GPU
        uuid = str(torch.cuda.get_device_properties(args[_CUDA_DEVICE_ARG]).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1:])
    return fn, args


def serialize_bucket(named: list[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor]:
    """One server rank's payload for a bucket: the tensors back to back and where each lies, pickled with
    torch.multiprocessing's reductions (handles, not bytes) and base64-encoded for JSON; and the flat tensor the
    handles point into, which must stay alive until the server has read it."""
    with ipc_shareable_allocations(any(t.is_cuda for _, t in named)):  # the flat bucket's handle opens elsewhere
        flat = flatten([t for _, t in named])
    metadata, offset = [], 0
    for name, t in named:
        size = t.numel() * t.element_size()
        metadata.append(SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset,
                                        end_idx=offset + size, numel=size))
        offset += size
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)  # its dispatch table is its own copy, with torch.multiprocessing's reductions
    pickler.dispatch_table[torch.Tensor] = _reduce_with_device_uuid
    if flat.is_cuda:
        pickler.dump({"flattened_tensor": flat, "metadata": metadata})
    else:
        # CPU: a shared-memory file any process on this host can open (the default, a file descriptor passed over a
        # socket, needs the sender's multiprocessing key, which a server does not have)
        strategy = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            pickler.dump({"flattened_tensor": flat, "metadata": metadata})
        finally:
            torch.multiprocessing.set_sharing_strategy(strategy)
    return base64.b64encode(buf.getvalue()).decode(), flat


def send_tensors(pool: ServerPool, state_dict: dict[str, torch.Tensor], version: str, urls: list[str] | None = None
                 ) -> int:
    """Push ``state_dict`` bucket by bucket to the servers ``urls`` (default: all) inside one weight-update session;
    returns bytes sent. Each server TP rank gets its own serialization (a CUDA IPC handle is reference-counted per
    consumer). The handles open only on this host: each node pushes to its own servers (engines/sglang/colocated.py)."""
    cfg, sent = pool.config, 0
    urls = list(urls) if urls is not None else pool.control_urls
    groups = buckets(state_dict, int(cfg.weight_bucket_mb * 2**20))
    bracketed = pool.begin_weight_update(urls)
    try:
        for k, names in enumerate(groups):
            last = k == len(groups) - 1
            named = [(n, state_dict[n]) for n in names]
            payloads = [[serialize_bucket(named) for _ in range(cfg.tp_size)] for _ in urls]
            futures = [pool.executor.submit(
                pool.post_with_retries, [url], "/update_weights_from_tensor",
                {"serialized_named_tensors": [p for p, _ in ranks], "load_format": "flattened_bucket",
                 "flush_cache": last, "weight_version": version if last else None},
                f"tensor weight update on {url}") for url, ranks in zip(urls, payloads)]
            for url, f in zip(urls, futures):
                out = f.result()  # the server has read the handles: ``payloads`` may now let go of the tensors
                if isinstance(out, dict) and out.get("success") is False:
                    raise RuntimeError(f"{url}/update_weights_from_tensor failed: {out.get('message')}")
            del payloads
            ipc_collect()  # the blocks whose handles the servers closed (see rank_push.py)
            sent += sum(t.numel() * t.element_size() for _, t in named)
    finally:
        pool.end_weight_update(bracketed, urls)
    ipc_collect()
    return sent


def ipc_collect() -> None:
    from megamu.runtime import parallel

    parallel.device().ipc_collect()
