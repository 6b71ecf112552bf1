"""The memory plan's phases beside training: the servers' rows (``server_rows``), a colocated refresh's push
(``push_rows``), the checkpoint phase (per GPU) and the host-memory plan (per node). Pure arithmetic, like
``megamu.memory.memory_plan``, whose ``plan_memory`` calls them.

Checkpoint (per GPU): a save runs after an update with the trainer's state resident (and, colocated, the servers'
memory released as in training). megamu's GPU optimiser assembles each parameter's full (TP-local) optimiser state on
the host through one reused device buffer of ``SAVE_CHUNK_ELEMENTS`` fp32 values
(``megamu.training.optimizer_shards``); megatron's torch_dist writer stages device tensors to host
(``dist_checkpointing/strategies/filesystem_async.py`` ``preload_tensors``): no second copy on the GPU.

Host (per node, bytes; r = trainer ranks on the node, s = server processes on the node):
- Pinned memory comes from torch's ``CachingHostAllocator``, which rounds each allocation up to a power of two
  (``ATen/core/CachingHostAllocator.h``: ``PowerOf2Ceil`` below ``pinned_max_round_threshold``, unbounded by default,
  ``c10/core/AllocatorConfig.h``) and keeps freed blocks cached. Pageable memory is counted as it is.
- The offload mirror (``megamu.training.host_mirror``, pinned, kept between refreshes): fp32 main params (bf16)
  and the two Adam moments of this rank's DistributedOptimizer share, packed into power-of-two slabs so that the
  rounding costs at most a slab (``mirror_slab_bytes``).
- megatron's param buffer copy (``_ParamAndGradBuffer.offload_to_cpu``: ``param_data.cpu().pin_memory()``, kept in
  ``param_data_cpu``): one pinned flat buffer per buffer (dense, experts), each rounded.
- Checkpoint save: the optimiser state assembled on the host (pageable, freed after the write) and megatron's
  staging of the model's tensors (pinned; emptied from torch's cache after the save, ``Device.release_host_cache``),
  both on the replica that writes each shard only (``plan_host``).
- Servers (SGLang), reward workers and the trainer processes themselves: estimates per process (below), not
  measured here.
Phases that never overlap share the memory: a staged run's servers exit before the trainer updates (and saves), so
the node needs the larger of the two, not their sum; colocated servers stay up through the save.
"""

from __future__ import annotations

from dataclasses import dataclass

from megamu.errors import ConfigError

GIB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
SAVE_CHUNK_ELEMENTS = 2**25  # fp32 values of the save's one device buffer: 128 MiB
# Host memory of one process beyond the buffers counted here (Python, torch, CUDA runtime, NCCL host buffers,
# tokenizers). Estimates, not measured on a GPU node: the GPU twin is where to refine them.
TRAINER_PROCESS_HOST_GIB = 6.0
SERVER_PROCESS_HOST_GIB = 8.0  # SGLang: tokenizer manager, scheduler, detokenizer of one server rank
REWARD_WORKER_HOST_GIB = 0.5


SLAB_BYTES = 2**30  # the offload mirror's slab (megamu.training.host_mirror): a power of two, nothing rounded off
SLAB_ALIGN = 512  # bytes: every buffer in a slab starts at a multiple (any dtype's view of the slab is aligned)


def pack_slabs(sizes: list[int], slab_bytes: int = SLAB_BYTES) -> tuple[int, list[tuple[int, int]]]:
    """(slab size, [(slab index, byte offset)] per size): first-fit decreasing into slabs of
    max(slab_bytes, the largest size rounded up to a power of two), each buffer aligned to ``SLAB_ALIGN``."""
    slab = max(slab_bytes, pow2_ceil(max(sizes, default=0)))
    used: list[int] = []
    places: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        need = -(-sizes[k] // SLAB_ALIGN) * SLAB_ALIGN
        i = next((i for i, u in enumerate(used) if u + need <= slab), len(used))
        if i == len(used):
            used.append(0)
        places[k] = (i, used[i])
        used[i] += need
    return slab, places


def pow2_ceil(n: int) -> int:
    """``c10::llvm::PowerOf2Ceil``: the smallest power of two >= n (0 stays 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class Row:
    phase: str
    part: str
    bytes: int
    counted: bool = True  # False: shown for comparison (another recompute setting, SGLang's free share), not summed

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class HostRow:
    phase: str  # "every phase" or the phase it belongs to
    part: str
    bytes: int

    @property
    def gib(self) -> float:
        return self.bytes / GIB


class HostPlan:
    """Rows per node; the total is what every phase holds plus the largest phase."""

    ALWAYS = "every phase"

    def __init__(self, rows: list[HostRow], host_memory_gib: float, ranks_per_node: int):
        self._rows, self.host_memory_gib, self.ranks_per_node = rows, host_memory_gib, ranks_per_node

    def rows(self) -> list[HostRow]:
        return list(self._rows)

    def phase_total(self, phase: str) -> int:
        return sum(r.bytes for r in self._rows if r.phase == phase)

    def peak(self) -> tuple[str | None, int]:
        """(the largest phase besides ``ALWAYS``, its bytes)."""
        phases = [p for p in dict.fromkeys(r.phase for r in self._rows) if p != self.ALWAYS]
        best = max(phases, key=self.phase_total, default=None)
        return best, 0 if best is None else self.phase_total(best)

    def total(self) -> int:
        return self.phase_total(self.ALWAYS) + self.peak()[1]

    def table(self, width: int) -> str:
        lines = [f"host (GiB per node of {self.ranks_per_node} trainer ranks; RAM {self.host_memory_gib:.0f} GiB)"]
        for phase in dict.fromkeys(r.phase for r in self._rows):
            lines.append(f"  {phase}" + ("" if phase == self.ALWAYS else " (phases that never overlap: the largest "
                                                                          "counts)"))
            lines += [f"{'    ' + r.part:<{width}}{r.gib:8.2f}" for r in self._rows if r.phase == phase]
        total, ram = self.total() / GIB, self.host_memory_gib
        verdict = "fits" if total <= ram else f"OVER by {total - ram:.2f}"
        lines.append(f"{'  total (every phase + ' + str(self.peak()[0]) + ')':<{width}}{total:8.2f}  / {ram:.0f}  "
                     f"{verdict}")
        return "\n".join(lines)

    def check(self) -> None:
        need = self.total() / GIB
        if need <= self.host_memory_gib:
            return
        always = {r.part: r.gib for r in self._rows if r.phase == self.ALWAYS}
        biggest = max(always, key=always.get)
        raise ConfigError("host_memory_gib", (
            f"the node's host memory plan needs {need:.0f} GiB of {self.host_memory_gib:.0f} GiB (largest: "
            f"'{biggest}', {always[biggest]:.0f} GiB; phase '{self.peak()[0]}', {self.peak()[1] / GIB:.0f} GiB). "
            "Pass --no-save-optim to save checkpoints without the optimiser state (its host copy is the save's "
            "largest part; a resume then restarts Adam), fewer ranks per node, or --host-memory-gib if the node "
            "has more RAM than was read"))


def param_tensor_numels(m, tp: int, ep: int, etp: int | None = None) -> tuple[list[int], list[int]]:
    """(dense, expert) parameter tensors on one trainer rank, as numels: what megatron's optimiser keeps one main
    param and two moments for. ``m``: a ``megamu.memory.model_shape.ModelShape``; the vocab as megatron pads it."""
    from megamu.memory.model_shape import padded_vocab

    h, f, q, kv, d = m.hidden_size, m.ffn_hidden_size, m.q_width, m.kv_width, m.head_dim
    layer = [h * (q + kv) // tp, q * h // tp, h, h]  # qkv, output projection, the two norms
    layer += [(q + kv) // tp] if m.qkv_bias else []
    layer += [d, d] if m.qk_norm else []
    layer += [m.num_experts * h] if m.num_experts else [2 * f * h // tp, f * h // tp]  # router, or the dense MLP
    vocab = padded_vocab(m.vocab_size, tp) // tp * h
    dense = layer * m.num_layers + [vocab] * (1 if m.tie_embeddings else 2) + [h]
    fe = m.moe_ffn_hidden_size
    et = tp if etp is None else etp  # each expert split over the expert-TP ranks
    experts = [2 * fe * h // et, fe * h // et] * (m.num_layers * m.num_experts // ep) if m.num_experts else []
    return dense, experts


def checkpoint_rows(phase: str, resident: list, chunk_bytes: int = SAVE_CHUNK_ELEMENTS * 4) -> list:
    """The ``checkpoint`` phase per GPU: ``resident`` (Rows of what the GPU holds after an update, in table order)
    renamed to the phase, plus the save's one assembly buffer."""

    return [Row(phase, r.part, r.bytes, r.counted) for r in resident] + [
        Row(phase, "optimiser state streamed to host (one fp32 buffer, optimizer_shards)", chunk_bytes)]


def mirror_slab_bytes(state_bytes: int, largest_tensor_bytes: int) -> int:
    """The offload mirror's slabs for ``state_bytes`` of tensors: whole slabs (``pack_slabs``' size) for the bytes,
    plus one for what first-fit leaves at the end of the others (an estimate: which tensors a DP rank holds, and so
    the packing, is megatron's bucket layout, not modelled)."""
    slab = max(SLAB_BYTES, pow2_ceil(largest_tensor_bytes))
    return (-(-state_bytes // slab) + 1) * slab if state_bytes else 0


def plan_host(c, *, n_dense: int, n_expert: int, mirrored: int) -> HostPlan:
    """The per-node host plan of ``c`` (a ``MemoryPlanConfig``; its ``host_memory_gib`` must be set).
    ``n_dense`` / ``n_expert``: one rank's parameter counts; ``mirrored``: the bytes of its optimiser tensors that
    an offload moves (fp32 main params and Adam moments)."""

    r = c.ranks_per_node
    e = DTYPE_BYTES[c.params_dtype]
    dense, experts = param_tensor_numels(c.model, c.tp, c.ep, c.expert_tp)
    A = HostPlan.ALWAYS
    rows = [HostRow(A, f"trainer processes ({r} x {TRAINER_PROCESS_HOST_GIB:g} GiB, estimate)",
                    int(r * TRAINER_PROCESS_HOST_GIB * GIB))]
    if c.offload_train:
        slabs = mirror_slab_bytes(mirrored, 4 * max(dense + experts))
        rows.append(HostRow(A, f"offload mirror, pinned slabs (main params, Adam moments; {r} ranks)", r * slabs))
        buffers = pow2_ceil(n_dense * e) + pow2_ceil(n_expert * e)
        rows.append(HostRow(A, f"megatron's pinned param buffers, 2^k rounded ({r} ranks)", r * buffers))
    if c.reward_workers:
        rows.append(HostRow(A, f"reward workers ({c.reward_workers} x {REWARD_WORKER_HOST_GIB:g} GiB, estimate)",
                            int(c.reward_workers * REWARD_WORKER_HOST_GIB * GIB)))
    mode = c.mode
    servers = c.servers_per_gpu * r if not mode.streams else 0
    if servers:  # a staged run's servers exit before the trainer updates and saves; colocated ones stay up
        rows.append(HostRow("rollout (servers up)" if mode.restarts_engine else A,
                            f"SGLang servers ({servers} x {SERVER_PROCESS_HOST_GIB:g} GiB, estimate)",
                            int(servers * SERVER_PROCESS_HOST_GIB * GIB)))
    # A save stages a shard on its main replica alone (torch_dist keeps only main replicas; megamu.training.
    # optimizer_shards stages the optimiser state likewise): data-parallel rank 0 of each DP group for the dense
    # parameters, expert-DP rank 0 of each expert-DP group for the experts. megatron orders ranks TP first, then
    # EP, then DP: those writers are the world's first TP (dense) and TP x EP (experts) ranks, the first node's.
    wd, we = min(c.tp, r), min(c.tp * c.ep, r)
    writers = f"writers: {wd} dense" + (f", {we} expert" if n_expert else "")
    if c.save_optimizer:
        keys = 3 if c.params_dtype != "fp32" else 2  # main params (bf16 only) and the two moments
        rows.append(HostRow("checkpoint save", f"optimiser state on the host (fp32 x {keys}, pageable; {writers})",
                            (wd * n_dense + we * n_expert) * 4 * keys))
    staged = wd * sum(pow2_ceil(n * e) for n in dense) + we * sum(pow2_ceil(n * e) for n in experts)
    rows.append(HostRow("checkpoint save", f"megatron's pinned staging of the model, 2^k rounded ({writers})", staged))
    return HostPlan(rows, c.host_memory_gib, r)


def server_rows(c, phase: str, trainer_at_launch: int | None, released: bool, *, ctx: int, device: int,
                server_weights: int, no_kv: list[str]) -> list[Row]:
    """Each server rank on this GPU in ``phase`` (``c`` a MemoryPlanConfig): it starts when the trainer holds
    ``trainer_at_launch`` (plus its context; None: no trainer on this GPU) and the earlier servers hold theirs, and
    keeps f x (free at its start). A server that would have no KV cache is said in ``no_kv`` (SGLang refuses to
    start it) and shown with 0."""
    out, held = [], 0 if trainer_at_launch is None else ctx + trainer_at_launch
    for i in range(c.servers_per_gpu):
        name = f"server {i}" if c.servers_per_gpu > 1 else "server"
        free = device - held - ctx
        kv = int(c.mem_fraction_static * free) - server_weights
        if kv <= 0:
            no_kv.append(f"phase '{phase}': {name} would have no KV cache: {c.mem_fraction_static} x "
                         f"{free / GIB:.1f} GiB free at its start is less than its weights, "
                         f"{server_weights / GIB:.1f} GiB")
            kv = 0
        out.append(Row(phase, f"{name}: CUDA context", ctx))
        out.append(Row(phase, f"{name}: weights ({c.params_dtype}, TP {c.server_tp})", server_weights, not released))
        out.append(Row(phase, f"{name}: KV cache at mem_fraction_static {c.mem_fraction_static}", kv, not released))
        out.append(Row(phase, f"{name}: left for its activations and graphs (1 - f)",
                       int((1 - c.mem_fraction_static) * free), False))
        held += ctx + server_weights + kv
    return out


def push_rows(c, ctx: int, trainer_state: list[tuple[str, int]], server_weights: int, gathered: int) -> list[Row]:
    """A colocated refresh as megamu.loop.staged.publish orders it: the weights gathered while the trainer holds
    them, the trainer offloaded, then each server's weights resumed (SGLang's /resume_memory_occupation, tag
    "weights"; its KV cache stays released until the push is done) and the push, bucket by bucket."""
    phase = "push (colocated refresh)"
    rows = [Row(phase, "CUDA context + NCCL (trainer)", ctx)]
    rows += [Row(phase, f"trainer {part}", b) for part, b in trainer_state]
    if gathered:
        rows.append(Row(phase, f"full weights gathered for the push (each pushing rank, {c.params_dtype})", gathered))
        rows.append(Row(phase, f"flattened push buckets ({c.push_bucket_copies} x {c.push_bucket_mb:g} MiB)",
                        int(c.push_bucket_copies * c.push_bucket_mb * 2**20)))
    for i in range(c.servers_per_gpu):
        name = f"server {i}" if c.servers_per_gpu > 1 else "server"
        rows += [Row(phase, f"{name}: CUDA context", ctx),
                 Row(phase, f"{name}: weights ({c.params_dtype}, TP {c.server_tp}), resumed", server_weights),
                 Row(phase, f"{name}: KV cache (released until the push is done)", 0, False)]
    return rows
