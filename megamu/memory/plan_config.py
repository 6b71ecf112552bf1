"""The memory plan's input (``MemoryPlanConfig``): the model's shape, the parallel layout, the micro-batching, the
mode and the device, validated on construction. megamu.config.run_config builds it from the run; megamu.memory.
memory_plan turns it into rows."""

from __future__ import annotations

from dataclasses import dataclass

from megamu.errors import ConfigError
from megamu.memory.device_memory import CUDA_CONTEXT_GIB, H200_GIB
from megamu.memory.measured_peaks import MeasuredPeaks
from megamu.memory.memory_plan_phases import DTYPE_BYTES
from megamu.memory.model_shape import ModelShape, require_positive
from megamu.mode import DEFAULT_MODE, Mode, mode_of

RECOMPUTE = (None, "selective", "full")
IMPLS = ("transformer_engine", "local")


@dataclass(frozen=True)
class MemoryPlanConfig:
    """Everything the plan reads. Field names are the parts' own; megamu.arguments maps them to flags.

    ``micro_batch_size`` rows of ``max_seq_len`` tokens is the largest micro-batch the model reads, one sample per
    row (prompt + response), causal; with a token budget (``max_tokens_per_micro_batch``, the padded rows x longest
    row ``megamu.training.batch.split_micro_batches`` caps) no micro-batch holds more than the budget, or one row.
    The local spec's shared-prompt rows (``megamu.training.batch``, share_prompts: a group's responses after one
    prompt, under an explicit attention mask) are not modelled: torch SDPA with a mask may materialise the s x s
    scores, which this count leaves out.
    """

    model: ModelShape
    micro_batch_size: int
    max_seq_len: int  # the longest row: prompt + response
    max_tokens_per_micro_batch: int | None = None  # padded tokens per micro-batch (None: micro_batch_size rows)
    max_response_len: int | None = None  # scored positions per row (train_step scores responses); None: max_seq_len
    params_dtype: str = "bf16"
    tp: int = 1
    ep: int = 1  # expert-parallel size (MoE): experts split over ep ranks, expert-data-parallel size tp dp / (etp ep)
    etp: int | None = None  # expert-TP size (MoE): each expert split over etp ranks; None: tp (megatron's default)
    dp: int = 1
    distributed_optimizer: bool = True
    recompute_granularity: str | None = None
    sequence_parallel: bool = False  # megatron's SP: the per-token tensors outside the TP blocks split over tp ranks
    transformer_impl: str = "transformer_engine"  # "local": megamu's CPU layer spec (torch norms, torch SDPA)
    rollout_mode: str = DEFAULT_MODE.name
    offload_train: bool = True
    servers_per_gpu: int = 1  # SGLang server ranks on each rollout GPU
    server_tp: int = 1
    mem_fraction_static: float = 0.85
    release_during_training: bool = False  # colocated servers /release_memory_occupation while the trainer trains
    # colocated refreshes: "memory" pushes gathered tensors (rank 0 holds the full model, plus each bucket flattened
    # once per server TP rank it goes to), "disk" reloads an export; None: no push phase (staged, async)
    weight_push: str | None = None
    push_bucket_mb: float = 512.0
    # flattened copies of one bucket alive at once on a GPU: 1 when each rank pushes its own (rank_push.py); one
    # process pushing to all servers (tensor_sync.send_tensors): servers on the node x server TP
    push_bucket_copies: int = 1
    gpu_memory_gib: float = H200_GIB  # a run's: RunConfig.gpu_memory_gib (--gpu-memory-gib)
    cuda_context_gib: float = CUDA_CONTEXT_GIB
    temperature: float = 1.0  # the log-probs' T: at T != 1 one more fp32 copy of the logits
    reference_model: bool = False  # the KL term's frozen π_ref (training/reference.py): params like the actor's
    # the host plan (megamu.memory.memory_plan_phases): None plans no host memory (a caller with no node to read)
    host_memory_gib: float | None = None  # a run's: RunConfig.host_memory_gib (--host-memory-gib)
    ranks_per_node: int = 8  # trainer ranks (GPUs) on one node
    reward_workers: int = 0
    save_optimizer: bool = True  # checkpoints carry the optimiser state (--no-save-optim: they do not)
    # what tools/gpu_check.py measured of the activation and logits terms (--measured-peaks): None, the plan adds
    # measured_peaks.UNMEASURED_MARGIN of both
    measured_peaks: MeasuredPeaks | None = None
    world_source: str = ""  # where the launch's world size came from, for the table's second line

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelShape):
            raise ConfigError("model", f"must be a ModelShape, got {type(self.model).__name__}")
        for name in ("micro_batch_size", "max_seq_len", "tp", "ep", "dp", "servers_per_gpu", "server_tp"):
            require_positive(name, getattr(self, name))
        if self.max_tokens_per_micro_batch is not None:
            require_positive("max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
        if self.max_response_len is not None:
            require_positive("max_response_len", self.max_response_len)
            if self.max_response_len > self.max_seq_len:
                raise ConfigError("max_response_len", f"{self.max_response_len} exceeds max_seq_len={self.max_seq_len}")
        if self.params_dtype not in DTYPE_BYTES:
            raise ConfigError("params_dtype", f"{self.params_dtype!r}: expected one of {tuple(DTYPE_BYTES)}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel", "needs tensor parallelism (tp > 1): it splits the sequence over "
                                                   "the TP ranks")
        if self.recompute_granularity not in RECOMPUTE:
            raise ConfigError("recompute_granularity", f"{self.recompute_granularity!r}: expected one of {RECOMPUTE}")
        if self.transformer_impl not in IMPLS:
            raise ConfigError("transformer_impl", f"{self.transformer_impl!r}: expected one of {IMPLS}")
        mode = self.mode  # ConfigError for a name that is no mode
        m = self.model
        for name in ("num_heads", "num_kv_heads", "ffn_hidden_size"):  # whole KV groups
            if getattr(m, name) % self.tp:
                raise ConfigError("tp", f"{self.tp} does not divide the model's {name}={getattr(m, name)}")
        if self.ep > 1 and not m.num_experts:
            raise ConfigError("ep", f"{self.ep}: expert parallelism needs a mixture-of-experts model")
        require_positive("etp", self.expert_tp)
        if m.num_experts and m.moe_ffn_hidden_size % self.expert_tp:
            raise ConfigError("etp", f"{self.expert_tp} does not divide the model's moe_ffn_hidden_size="
                                     f"{m.moe_ffn_hidden_size}")
        if m.num_experts % self.ep or (self.tp * self.dp) % (self.expert_tp * self.ep):
            raise ConfigError("ep", f"{self.ep} must divide num_experts={m.num_experts}, and ETP x EP = "
                                    f"{self.expert_tp} x {self.ep} the world TP x DP = {self.tp * self.dp} "
                                    "(megatron's expert-data-parallel size is the world / (ETP x EP))")
        if m.num_kv_heads % self.server_tp and self.server_tp % m.num_kv_heads:
            raise ConfigError("server_tp", f"{self.server_tp} does not split num_kv_heads={m.num_kv_heads}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError("mem_fraction_static", f"must be in (0, 1), got {self.mem_fraction_static}")
        for name in ("gpu_memory_gib", "cuda_context_gib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(name, f"must be a positive number of GiB, got {value!r}")
        if self.weight_push not in (None, "memory", "disk"):
            raise ConfigError("weight_push", f"{self.weight_push!r}: expected 'memory', 'disk' or None")
        require_positive("push_bucket_copies", self.push_bucket_copies)
        require_positive("ranks_per_node", self.ranks_per_node)
        if self.host_memory_gib is not None and not self.host_memory_gib > 0:
            raise ConfigError("host_memory_gib", f"must be a positive number of GiB, got {self.host_memory_gib!r}")
        if self.release_during_training and not mode.shares_trainer_devices:
            raise ConfigError("release_during_training", f"only colocated servers share the trainer's GPUs "
                              f"(rollout_mode={self.rollout_mode!r})")

    @property
    def mode(self) -> Mode:
        """The run's mode, from the name the plan was given (the config is built from the run's plan)."""
        return mode_of(self.rollout_mode)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """megatron's expert-data-parallel size: the world over ETP x EP (parallel_state.py:791)."""
        return self.tp * self.dp // (self.expert_tp * self.ep)

    @property
    def scored_len(self) -> int:
        return self.max_seq_len if self.max_response_len is None else self.max_response_len

    @property
    def micro_batch_tokens(self) -> int:
        """Padded tokens of the largest micro-batch: r rows of at most L tokens with r <= micro_batch_size and, under
        a budget B, r x L <= B (a row longer than B alone): at most min(micro_batch_size x max_seq_len,
        max(B, max_seq_len))."""
        rows = self.micro_batch_size * self.max_seq_len
        if self.max_tokens_per_micro_batch is None:
            return rows
        return min(rows, max(self.max_tokens_per_micro_batch, self.max_seq_len))

    @property
    def scored_tokens(self) -> int:
        """Scored (response) positions of the largest micro-batch: within its rows' responses and its tokens."""
        return min(self.micro_batch_size * self.scored_len, self.micro_batch_tokens)
