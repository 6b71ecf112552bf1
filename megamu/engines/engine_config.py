"""Which engine generates and in what precision (``EngineConfig``), as the trainer and tools/evaluate.py both
configure it; megamu.engines re-exports it beside ``build_engine``, which makes the engine it names."""

from __future__ import annotations

from dataclasses import dataclass

from megamu.config_fields import derived, flag
from megamu.engines.sglang.launch import SGLangConfig
from megamu.errors import ConfigError, check_choice, check_positive

ENGINE_KINDS = ("local", "sglang")
ENGINE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """Which engine generates, as the trainer and tools/evaluate.py both configure it."""

    # None (the trainer's flag unset): the run's device decides (RunConfig.derive: Device.rollout_engine)
    kind: str | None = flag("--rollout-engine", default="local", flag_default=None, choices=ENGINE_KINDS, help=(
        "default: sglang for a run on GPUs, local on CPU"))
    # None: a run's is its training precision (RunConfig fills it in); an engine on its own computes in float32.
    dtype: str | None = flag("--rollout-dtype", default=None, choices=ENGINE_DTYPES, help=(
        "the precision the engine computes in: the local engine's weights, SGLang servers' --dtype (default: "
        "bfloat16 with --bf16, else float32; the weights it loads: --export-dtype)"))
    max_batch_size: int = flag("--local-engine-batch-size", default=128, type=int, help=(
        "local engine: sequences decoded together (slime's --rollout-batch-size is prompts per rollout: megamu's "
        "--prompts-per-stage)"))
    # servers, launch and weight sync: as a whole, set only with --rollout-engine sglang (its fields carry their flags)
    sglang: SGLangConfig = derived("engine.kind", default_factory=SGLangConfig)

    def __post_init__(self):
        if self.kind is not None:
            check_choice(self, "kind", ENGINE_KINDS)
        if self.dtype is not None:
            check_choice(self, "dtype", ENGINE_DTYPES)
        check_positive(self, "max_batch_size")
        if self.kind == "local" and self.sglang != SGLangConfig():
            raise ConfigError("sglang", "SGLang settings are only used with the sglang engine (on CPU the default "
                                        "engine is the local one)")
