"""What each GPU holds in each phase of a run, from the model config and the parallel layout, before anything starts.

Pure arithmetic: no torch, no CUDA, no I/O. ``plan_memory(MemoryPlanConfig(...))`` gives a ``MemoryPlan`` whose
``table()`` the dry run prints and whose ``check()`` refuses a plan that cannot fit the device.

Where the numbers come from (bytes per GPU; t = TP, d = DP):
- Mixture of experts (Qwen3-MoE): the experts' parameters are split over the expert-parallel ranks (whole experts,
  each one split over TP as megatron's expert-TP size defaults to), their optimiser state sharded over the
  expert-data-parallel ranks (DP / EP) as megatron's DistributedOptimizer shards expert parameters; the router is
  whole on every rank. Activations follow the active parameters: each token passes through k experts.
- Trainer state, as megamu's GPU optimiser builds it (``megamu.training.optimizer``: megatron DDP with
  ``grad_reduce_in_fp32=True`` and the DistributedOptimizer): the params in their dtype, an fp32 gradient buffer
  (unsharded), and with the DistributedOptimizer fp32 main params (bf16 only) and the two fp32 Adam moments sharded
  over DP. fp32 params are their own main params.
- Activations: a count of the tensors autograd keeps per layer for megatron-core's GPT layer as megamu configures
  it (RMSNorm, GQA, SwiGLU, no dropout, no bias fusion, flash attention, sequence parallelism optional), see
  ``layer_activation_bytes``.
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198), give
  s*b*h*(34 + 5*a*s/h) bytes per layer for GPT-3's layer (GeLU MLP of 4h, LayerNorm, dropout, attention scores
  materialised). Here flash attention keeps no s x s scores (the 5as/h term goes), there is no dropout mask, the MLP is
  SwiGLU of width f and the K/V heads are grouped, so the count is redone per tensor instead of rescaled: read off
  autograd's saved tensors (``torch.autograd.graph.saved_tensors_hooks``) on the CPU path, checked against the
  measured peak of a CPU train_step (tests/memory/test_cpu_peak.py) and, for the GPU path, against
  ``torch.cuda.max_memory_allocated`` (tests/memory/test_gpu_peak.py, not yet run on a GPU).
- Logits: what ``megamu.model.logprobs.token_logprobs`` materialises over the vocab-parallel logits of the scored
  positions (train_step asks for the entropy too), see ``_logits_bytes``.
- Margin: the activation and logits counts have not been measured on TE's spec; the training phase adds a stated
  fraction of both (``megamu.memory.measured_peaks``: 15 %, or the measured excess + 5 % from ``--measured-peaks``).
  The device (``megamu.memory.device_memory``) is the card as nvidia-smi shows it; contexts are rows of their own.
- SGLang servers (0.5.23, ``profile_max_num_token``): a server started with ``--mem-fraction-static f`` ends up
  holding f x (memory free when it started): its weights plus a KV cache of (free after weights) - free x (1 - f).
  What other processes hold at launch is excluded from that base. The rest, (1 - f), is its activations and graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

from megamu.errors import ConfigError
from megamu.memory.device_memory import CUDA_CONTEXT_GIB, H100_GIB, H200_GIB, device_label
from megamu.memory.measured_peaks import margin
from megamu.memory.memory_plan_phases import (
    DTYPE_BYTES,
    GIB,
    Row,
    checkpoint_rows,
    plan_host,
    push_rows,
    server_rows,
)
from megamu.memory.model_shape import ModelShape, padded_vocab
from megamu.memory.plan_config import RECOMPUTE, MemoryPlanConfig

__all__ = ["CUDA_CONTEXT_GIB", "GIB", "H100_GIB", "H200_GIB", "MemoryPlan", "MemoryPlanConfig", "ModelShape", "Row",
           "padded_vocab", "plan_memory"]

_RECOMPUTE_LABEL = {None: "no recompute", "selective": "selective recompute", "full": "full recompute"}


def layer_activation_bytes(c: MemoryPlanConfig) -> dict[str, float]:
    """Bytes autograd keeps for one transformer layer at the longest micro-batch, by what keeps them.

    Per token, in activation-dtype elements (t = TP; h is replicated over TP without sequence parallelism):
    residual input x and the norm's output, for each of the two norms: 4h; the QKV GEMM's output (q + kv)/t (V is a
    view into it, so the flash attention's saved V keeps all of it); q and k after RoPE (new tensors): (q + kv/2)/t;
    the attention output, saved by flash attention and by the output projection (one storage): q/t; SwiGLU: fc1's
    output 2f/t (silu's saved input is a view of it), silu's output f/t, megatron's ``x_linear + glu_linear_offset``
    f/t, their product (fc2's input) f/t: 5f/t. fp32: the softmax log-sum-exp (heads/t) and the norms' 1/rms (2).
    Per position (not per row): RoPE's cos and sin, for q and for k (megamu turns megatron's RoPE fusion off, and its
    CPU core attention applies its own): 4 head_dim. megamu's CPU spec ("local") also keeps what torch's RMSNorm
    holds between the scaling and the weight: 2h more per token.
    Sequence parallelism (``sp`` = t) splits what lives outside the TP blocks along the sequence: the norms' inputs
    and outputs (the QKV and fc1 GEMMs save their local input and all-gather it again in the backward) and the
    norms' 1/rms, each divided by t. The attention and MLP terms are already /t; RoPE's per-position tables are not
    split (the attention sees the whole gathered sequence). Rows padded to a multiple of t (at most t - 1 tokens
    each) are left out.
    """
    m, t = c.model, c.tp
    sp = t if c.sequence_parallel else 1
    s = c.max_seq_len
    e = DTYPE_BYTES[c.params_dtype]
    tokens = c.micro_batch_tokens
    h, q, kv = m.hidden_size, m.q_width, m.kv_width
    parts = {
        "norm inputs and outputs": (6 if c.transformer_impl == "local" else 4) * h / sp * e * tokens,
        "attention (qkv, roped q/k, output)": (2 * q + kv + q + kv / 2) / t * e * tokens,
        **_mlp_activation_parts(m, t, e, tokens, sp),
        "fp32 statistics": (m.num_heads / t + 2 / sp) * 4 * tokens,
        "rope cos/sin": 4 * m.head_dim * s * e,
    }
    return parts


def _mlp_activation_parts(m: ModelShape, t: int, e: int, tokens: int, sp: int = 1) -> dict[str, float]:
    """The MLP's saved tensors: SwiGLU 5f/t per token (above); an MoE layer runs it on k rows per token (the
    permuted tokens), and also keeps the grouped GEMM's input (k h: the permuted tokens), the experts' output that
    the routing weights scale (k h), the router's fp32 logits and routing scores over all experts (2 E x 4 bytes),
    its routing map (E bools) and each routed row's weight (k x 4). Counted from megatron-core 0.16.1's MoE layer
    (alltoall dispatcher, grouped GEMM), not measured: no GPU has run it yet. Under sequence parallelism (``sp`` =
    t) the router runs on this rank's s/t tokens (its logits, scores and map /t); the dispatcher gathers the routed
    rows and their weights over TP before the experts (split over TP), so those stay per token of the row."""
    if not m.num_experts:
        return {"swiglu": 5 * m.ffn_hidden_size / t * e * tokens}
    k, experts = m.moe_top_k, m.num_experts
    return {"swiglu (k experts per token)": 5 * m.active_ffn_width / t * e * tokens,
            "moe dispatch (permuted tokens, expert outputs)": 2 * k * m.hidden_size * e * tokens,
            "moe router (fp32 logits and scores, map, weights)": ((2 * experts * 4 + experts) / sp + 4 * k) * tokens}


def _activation_bytes(c: MemoryPlanConfig, granularity: str | None) -> int:
    """All layers' saved activations plus the final norm and the output layer's input, at the longest micro-batch."""
    m = c.model
    e = DTYPE_BYTES[c.params_dtype]
    tokens = c.micro_batch_tokens
    sp = c.tp if c.sequence_parallel else 1  # full recompute's layer inputs and the final norm: split by SP
    layer = layer_activation_bytes(c)
    per_layer = sum(layer.values())
    if granularity is None:
        body = m.num_layers * per_layer
    elif granularity == "selective":
        # megatron-core recomputes the core attention only; with flash attention it keeps its inputs (q, k, v) and
        # the output projection keeps its output anyway, so only the log-sum-exp is saved
        body = m.num_layers * (per_layer - m.num_heads / c.tp * 4 * tokens)
    else:  # full, uniform, one layer per checkpoint: each layer keeps its input; backward rebuilds one layer at a time.
        # The rebuilt layer and the logits' forward peak are never alive together, so adding both over-counts the
        # step's peak by up to one layer: a bound, on the safe side.
        body = m.num_layers * m.hidden_size / sp * e * tokens + per_layer
    # final norm: its input (torch's RMSNorm also the scaled value); the output layer reads the scored positions only
    # (under SP, gathered from the ranks first: megamu.model.logprobs keeps the picked positions, not the gather)
    final_norm = (2 if c.transformer_impl == "local" else 1) * m.hidden_size / sp * e * tokens
    head_input = c.scored_tokens * m.hidden_size * e
    return int(body + final_norm + head_input)


# token_logprobs(with_entropy=True), the fp32 tensors the size of the scored logits [k, V/t] (k: the scored tokens,
# at most rows x scored_len) alive at once when it forms p * shifted: the logits (fp32: Float16Module casts its
# output), z = logits / T (only when T != 1: dividing by 1 is skipped), shifted = z - m (kept: gather's backward saves
# it), exp(shifted), p = exp / S, shifted with -inf set to 0, and the product p * shifted; plus the bool mask
# isneginf(shifted). 6 x 4 + 1 bytes per logit at T = 1, 7 x 4 + 1 otherwise. The backward needs less (the entropy's
# graph is dropped).
LOGIT_BYTES = 6 * 4 + 1
TEMPERATURE_COPY_BYTES = 4


def _logits_bytes(c: MemoryPlanConfig) -> int:
    vocab_local = padded_vocab(c.model.vocab_size, c.tp) // c.tp
    per_logit = LOGIT_BYTES + (TEMPERATURE_COPY_BYTES if c.temperature != 1.0 else 0)
    return per_logit * c.scored_tokens * vocab_local


class MemoryPlan:
    """Rows of (phase, part, bytes) per GPU; ``table()`` to print, ``check()`` to refuse what cannot fit."""

    def __init__(self, config: MemoryPlanConfig, rows: list[Row], no_kv_cache: list[str] | None = None,
                 host=None):
        self.config = config
        self._rows = rows
        self._no_kv_cache = list(no_kv_cache or [])  # servers SGLang would refuse to start
        self.host = host  # megamu.memory.memory_plan_phases.HostPlan, per node; None without --host-memory-gib

    def rows(self) -> list[Row]:
        return list(self._rows)

    def phases(self) -> list[str]:
        return list(dict.fromkeys(r.phase for r in self._rows))

    def total(self, phase: str) -> int:
        return sum(r.bytes for r in self._rows if r.phase == phase and r.counted)

    def table(self) -> str:
        device = self.config.gpu_memory_gib
        width = max(len(r.part) for r in self._rows) + 4
        c = self.config
        sp = " + SP" if c.sequence_parallel else ""
        etp = f", ETP {c.expert_tp} x EDP {c.expert_dp}" if c.expert_tp != c.tp else ""  # experts' own TP
        experts = f", EP {c.ep}{etp} ({c.model.num_experts // c.ep} of {c.model.num_experts} experts per GPU)"
        layout = f"TP {c.tp}{sp} x DP {c.dp}" + (experts if c.model.num_experts else "")
        batch = (f"micro-batch <= {c.micro_batch_tokens} tokens (" + (
            f"--max-tokens-per-micro-batch {c.max_tokens_per_micro_batch}, " if c.max_tokens_per_micro_batch else "")
            + f"{c.micro_batch_size} rows x {c.max_seq_len})")
        world, node = c.tp * c.dp, min(c.ranks_per_node, c.tp * c.dp)
        lines = [f"memory plan per GPU (GiB; device {device_label(device)}; trainer {layout}; {batch})",
                 f"world: {world} GPU{'s' if world > 1 else ''}, {-(-world // node)} node(s) x {node}"
                 + (f" ({c.world_source})" if c.world_source else "")]
        for phase in self.phases():
            lines.append(phase)
            for r in self._rows:
                if r.phase == phase:
                    label = f"  {r.part}" if r.counted else f"  ({r.part}: not counted)"
                    lines.append(f"{label:<{width + 16}}{r.gib:8.2f}")
            total = self.total(phase) / GIB
            verdict = "fits" if total <= device else f"OVER by {total - device:.2f}"
            lines.append(f"{'  total':<{width + 16}}{total:8.2f}  / {device:.1f}  {verdict}")
        if self.host is not None:
            lines.append(self.host.table(width + 16))
        return "\n".join(lines)

    def check(self) -> None:
        """Raise ConfigError (field gpu_memory_gib) naming each phase that does not fit and the line at which its
        running total, in table order, passes the device size; first (field mem_fraction_static) a server whose
        weights leave it no KV cache."""
        if self._no_kv_cache:
            raise ConfigError("mem_fraction_static", "; ".join(self._no_kv_cache))
        device = self.config.gpu_memory_gib * GIB
        problems = []
        for phase in self.phases():
            running = 0
            for r in self._rows:
                if r.phase != phase or not r.counted:
                    continue
                running += r.bytes
                if running > device:
                    problems.append(f"phase '{phase}' needs {self.total(phase) / GIB:.1f} GiB of "
                                    f"{self.config.gpu_memory_gib:.1f} GiB: it overflows at '{r.part}' "
                                    f"({r.gib:.1f} GiB, {running / GIB:.1f} GiB so far)")
                    break
        if problems:
            raise ConfigError("gpu_memory_gib", "the memory plan does not fit the device: " + "; ".join(problems))
        if self.host is not None:
            self.host.check()


@dataclass(frozen=True)
class _TrainerState:
    """One trainer rank's resident state: the table's rows and the byte counts the phases read."""

    rows: list[tuple[str, int]]
    params: int
    grads: int
    main: int
    moments: int
    dense_local: int  # parameters on this rank outside the experts
    expert_local: int


def _trainer_state(c: MemoryPlanConfig) -> _TrainerState:
    m, e = c.model, DTYPE_BYTES[c.params_dtype]
    split, whole = m.param_counts(c.tp, padded_vocab(m.vocab_size, c.tp))
    dense_local = split // c.tp + whole
    expert_local = m.expert_params() // (c.expert_tp * c.ep)
    n_local = dense_local + expert_local  # parameters on one trainer rank
    dp_shard, edp_shard = (c.dp, c.expert_dp) if c.distributed_optimizer else (1, 1)

    def sharded(bytes_per_param: int) -> int:
        return dense_local * bytes_per_param // dp_shard + expert_local * bytes_per_param // edp_shard

    params, grads = n_local * e, n_local * 4
    main = sharded(4) if c.params_dtype != "fp32" else 0
    moments = sharded(8)
    rows = [("params (" + c.params_dtype + ")", params), ("fp32 main params", main), ("fp32 grad buffer", grads),
            ("Adam moments (fp32 x2)", moments)]
    if c.reference_model:  # weights only, split like the actor's; offloaded with the trainer's state
        rows.append(("reference policy params (" + c.params_dtype + ")", params))
    return _TrainerState(rows, params, grads, main, moments, dense_local, expert_local)


def plan_memory(c: MemoryPlanConfig) -> MemoryPlan:
    """The per-GPU table for ``c``: training, then the rollout phase of its mode."""
    m, e = c.model, DTYPE_BYTES[c.params_dtype]
    ctx = int(c.cuda_context_gib * GIB)
    t = _trainer_state(c)
    state, params, grads, main = t.rows, t.params, t.grads, t.main

    s_split, s_whole = m.param_counts()
    server_weights = int(((s_split + m.expert_params()) / c.server_tp + s_whole) * e)

    no_kv: list[str] = []
    device = int(c.gpu_memory_gib * GIB)

    def servers(phase: str, trainer_at_launch: int | None, released: bool) -> list[Row]:
        return server_rows(c, phase, trainer_at_launch, released, ctx=ctx, device=device,
                           server_weights=server_weights, no_kv=no_kv)

    resident = sum(b for _, b in state)
    rows = [Row("training", "CUDA context + NCCL (trainer)", ctx)]
    mode = c.mode
    if mode.keeps_engine_up:
        # servers start once, before the first update: the trainer then holds params, grads and main params (Adam
        # moments come with the first step) unless offloaded; later rollouts see the moments as well. They are
        # listed before the trainer's state: they are there when training starts, and the overflow is the trainer's.
        at_launch = 0 if c.offload_train else params + grads + main
        rows += servers("training", at_launch, c.release_during_training)
        phase = "rollout (colocated)"
    elif mode.restarts_engine:
        at_launch = 0 if c.offload_train else resident  # servers restart every stage; later stages have moments
        phase = "rollout (staged)"
    else:
        at_launch = None  # the servers' own GPUs
        phase = "rollout (async, server GPUs)"
    rows += [Row("training", part, b) for part, b in state]
    rows.append(Row("training", f"activations, {_RECOMPUTE_LABEL[c.recompute_granularity]}",
                    _activation_bytes(c, c.recompute_granularity)))
    rows += [Row("training", f"activations, {_RECOMPUTE_LABEL[g]}", _activation_bytes(c, g), False)
             for g in RECOMPUTE if g != c.recompute_granularity]
    rows.append(Row("training", "logits and log-softmax temporaries (fp32)", _logits_bytes(c)))
    rows.append(Row("training", *margin(c.measured_peaks, c.transformer_impl, _activation_bytes(
        c, c.recompute_granularity), _logits_bytes(c))))
    # a save follows an update: the training phase's rows but its activations and logits
    rows += checkpoint_rows("checkpoint", [r for r in rows if r.phase == "training" and r.counted
                                           and not r.part.startswith(("activations", "logits", "margin"))])

    if not mode.streams:
        rows.append(Row(phase, "CUDA context + NCCL (trainer)", ctx))
        if not c.offload_train:
            rows += [Row(phase, f"trainer {part}", b) for part, b in state]
    rows += servers(phase, at_launch, False)
    if mode.keeps_engine_up and c.weight_push:
        rows += push_rows(c, ctx, [] if c.offload_train else state, server_weights,
                           (sum(m.param_counts()) + m.expert_params()) * e if c.weight_push == "memory" else 0)
    host = None if c.host_memory_gib is None else plan_host(c, n_dense=t.dense_local, n_expert=t.expert_local,
                                                            mirrored=t.main + t.moments)
    return MemoryPlan(c, rows, no_kv, host)

