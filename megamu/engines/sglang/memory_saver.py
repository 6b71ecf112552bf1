"""A colocated server's GPU memory, given back while the trainer trains and taken again to generate.

SGLang servers launched with ``--enable-memory-saver`` free their KV cache, weights and CUDA graphs on
``/release_memory_occupation`` and take them back, at the same virtual addresses, on ``/resume_memory_occupation``
(SGLang 0.5.23; torch_memory_saver underneath). A colocated stage takes turns with the trainer as slime's
``--offload-rollout`` (slime/ray/rollout.py ``offload``/``onload``) and verl's rollout sleep/wake-up do:
generate -> release everything -> train -> resume the weights -> push the new ones -> resume the KV cache and graphs.
The weights come back first so the push lands in place while the trainer still holds its state; the KV cache last,
once the trainer has offloaded.
"""

from __future__ import annotations

from megamu.engines.sglang.pool import ServerPool

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
CACHE = (KV_CACHE, CUDA_GRAPH)


def release(pool: ServerPool, tags: tuple[str, ...] = ALL) -> None:
    """Every server frees the memory of ``tags`` (it must have been launched with --enable-memory-saver)."""
    pool.post_all("/release_memory_occupation", {"tags": list(tags)},
                     f"releasing {', '.join(tags)} (servers need --enable-memory-saver)")


def resume(pool: ServerPool, tags: tuple[str, ...]) -> None:
    """Every server takes the memory of ``tags`` back."""
    pool.post_all("/resume_memory_occupation", {"tags": list(tags)}, f"resuming {', '.join(tags)}")
