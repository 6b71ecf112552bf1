"""The policy π_θ on the trainer's side: model, optimiser, checkpoints, HF exports and weights for an engine.

Everything here is collective: every rank calls every method (tensor-parallel gathers, barriers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megamu import parallel
from megamu.algo import AlgoConfig
from megamu.atomic import atomic_write
from megamu.convert import export_hf, full_state_dict, load_hf_into_model
from megamu.convert.mapping import mcore_to_hf_tensors
from megamu.device import Device
from megamu.model import ModelArch, build_model
from megamu.records import RolloutSample
from megamu.training.checkpoint import load_checkpoint, save_checkpoint
from megamu.training.optimizer import OptimizerConfig, build_optimizer
from megamu.training.step import compute_logprobs, train_step


@dataclass(frozen=True)
class PolicyConfig:
    hf_checkpoint: str | None  # initial weights (None: the demo model)
    device: Device
    optimizer: OptimizerConfig
    save_dir: Path  # checkpoints and HF exports (<save_dir>/hf/<name>)
    load_dir: Path  # resume from here when it holds a checkpoint
    transformer_impl: str | None = None  # None: the device's default
    bf16: bool = False
    micro_batch_size: int = 8
    max_tokens_per_micro_batch: int | None = None
    temperature: float = 1.0  # log-probs of softmax(logits / T), like the engine's behaviour log-probs
    skip_zero_advantage: bool = True
    export_dtype: str = "float32"  # HF exports and in-memory pushes: the dtype the engine runs (bfloat16 with --bf16)


def resolve_hf_checkpoint(path: str | None) -> Path:
    if path is None:
        from megamu.demo_model import smollm2_hf_dir

        return smollm2_hf_dir()
    return Path(path)


class Policy:
    def __init__(self, cfg: PolicyConfig):
        self.cfg = cfg
        self.hf_source = resolve_hf_checkpoint(cfg.hf_checkpoint)
        self.arch = ModelArch.from_hf(self.hf_source)
        self.model = build_model(self.arch, device=cfg.device, transformer_impl=cfg.transformer_impl, bf16=cfg.bf16)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, cfg.device)

    def restore(self) -> dict | None:
        """Load the latest checkpoint under load_dir (returns its ``extra``), else the initial HF weights (None).

        After building the optimiser: the bf16 optimiser's fp32 main weights are refreshed from the loaded model."""
        if Path(self.cfg.load_dir).exists():
            extra = load_checkpoint(self.cfg.load_dir, self.model, self.arch, self.optimizer)
            if extra is not None:
                return extra
        load_hf_into_model(self.model, self.arch, self.hf_source)
        return None

    @property
    def version(self) -> int:
        """Optimiser updates applied to these weights: the policy version samples generated from them carry."""
        return self.optimizer.iteration

    def update(self, samples: list[RolloutSample], algo: AlgoConfig) -> dict[str, float]:
        c = self.cfg
        return train_step(self.model, self.optimizer, samples, algo, micro_batch_size=c.micro_batch_size,
                          max_tokens_per_micro_batch=c.max_tokens_per_micro_batch, temperature=c.temperature,
                          skip_zero_advantage=c.skip_zero_advantage)

    def behaviour_anchors(self, samples: list[RolloutSample], cache: Path) -> dict[tuple[int, int], list[float]]:
        """--behaviour-logprobs recompute: b_t = this policy's log-probs of ``samples``, cached in ``cache``."""
        if cache.exists():
            return torch.load(cache)
        values = compute_logprobs(self.model, samples, temperature=self.cfg.temperature,
                                  micro_batch_size=self.cfg.micro_batch_size)
        anchors = {(s.prompt_id, s.sample_index): v for s, v in zip(samples, values)}
        if parallel.is_main_rank():
            atomic_write(cache, lambda tmp: torch.save(anchors, tmp))
        parallel.barrier()
        return anchors

    def save(self, iteration: int, extra: dict) -> None:
        save_checkpoint(self.cfg.save_dir, iteration, self.model, self.arch, self.optimizer, extra=extra)

    def export(self, name: str) -> Path:
        """The weights as an HF folder <save_dir>/hf/<name> (atomic; a finished folder of the same name is reused)."""
        out = Path(self.cfg.save_dir) / "hf" / name
        exists = (out / "config.json").exists()
        parallel.barrier()  # every rank has looked before rank 0 writes: all take the same branch (export_hf's
        # collectives and barrier), whichever rank the scheduler delays
        if not exists:
            export_hf(self.model, self.arch, out, hf_source_dir=self.hf_source,
                      dtype={"float32": "fp32", "bfloat16": "bf16"}[self.cfg.export_dtype])
        parallel.barrier()
        return out

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors for an in-memory push (gathered over TP; every rank gets them, rank 0 uses them),
        in the export dtype, like an export."""
        dtype = getattr(torch, self.cfg.export_dtype)
        return {n: t.to(dtype) for n, t in mcore_to_hf_tensors(self.arch, full_state_dict(self.model, self.arch))}

    def logprob_probe(self, token_ids: list[int]):
        """The trainer's teacher-forced log-probs of ``token_ids`` at temperature 1 (collective), to check that an
        engine serves these weights after a sync. Tolerance on the mean |difference| by dtype: float32 agrees to
        ~1e-6 (1e-3 leaves room for other kernels); bfloat16 keeps 8 mantissa bits, ~1e-2 per log-prob."""
        from megamu.rollout.sglang_sync import LogprobProbe

        sample = RolloutSample(prompt_id=0, sample_index=0, prompt_ids=token_ids[:1], response_ids=token_ids[1:],
                               behaviour_logprobs=[0.0] * (len(token_ids) - 1), reward=0.0, advantage=0.0,
                               finish_reason="length")
        values = compute_logprobs(self.model, [sample], temperature=1.0, micro_batch_size=1)[0]
        return LogprobProbe(list(token_ids), values, tolerance=1e-3 if self.cfg.export_dtype == "float32" else 0.05)

    def release_memory(self) -> None:
        """Before an engine generates: give back what the trainer does not need (§4). Today: the allocator cache."""
        self.cfg.device.release_cache()
