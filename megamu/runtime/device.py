"""CPU or CUDA: the one decision every device difference follows.

Made once at start-up (``megamu.arguments`` for the trainer, each tool's ``main``) and passed down to the parts that
differ: the process-group backend (``megamu.runtime.parallel``), the layer implementation and weight placement
(``megamu.model.build``), the optimiser (``megamu.training.optimizer``) and the memory hand-off around rollouts.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Device:
    type: str  # "cpu" | "cuda"

    def __post_init__(self) -> None:
        if self.type not in ("cpu", "cuda"):
            raise ValueError(f"device type must be 'cpu' or 'cuda', got {self.type!r}")

    @staticmethod
    def detect() -> Device:
        return Device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    @property
    def backend(self) -> str:
        """torch.distributed backend of the default process group."""
        return "nccl" if self.is_cuda else "gloo"

    @property
    def transformer_impl(self) -> str:
        """Default layer implementation: Transformer Engine kernels on GPU, megatron's local spec on CPU."""
        return "transformer_engine" if self.is_cuda else "local"

    @property
    def rollout_engine(self) -> str:
        """Default rollout engine: SGLang servers on GPU, the in-process one on CPU (no SGLang to install there)."""
        return "sglang" if self.is_cuda else "local"

    def bind(self, local_rank: int) -> None:
        """Pin this process to its GPU (before any CUDA allocation); nothing on CPU."""
        if self.is_cuda:
            torch.cuda.set_device(local_rank)

    def describe(self) -> str:
        """What runs the math, for the plan and for reports: the GPU, or the CPU model and torch's kernel ISA (a
        duration measured on one CPU says little about another: see the README's demo paragraph)."""
        if self.is_cuda:  # no device name: asking for it would create a CUDA context before the rank binds its GPU
            return f"cuda, {torch.cuda.device_count()} devices visible"
        try:
            with open("/proc/cpuinfo") as f:
                model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
        except OSError:
            model = ""
        return (f"cpu: {model or platform.processor() or 'unknown model'}, {os.cpu_count()} cores, torch kernels "
                f"{torch.backends.cpu.get_cpu_capability()}")

    def import_megatron(self) -> None:
        """Import megatron-core for this device, without two costs its import has and megamu's runs do not use:
        - On CPU, its fused kernels are left uncompiled. They are decorated with megatron.core.jit.jit_fuser, which
          0.16.1 binds to torch.compile when that module is imported (jit.py:21, run by its last line), and building
          the wrappers imports torch's compiler stack: ~1-2 s of CPU per process (measured) for kernels the CPU path
          never calls (megamu.model.config.fusion_fields turns them off with the local spec). jit_fuser is bound to
          the identity instead, as megatron's disable_jit_fuser() would if it could run before those modules exist
          (later Megatron-LM versions read TORCHINDUCTOR_DISABLE=1 for that); torch.compile itself is put back at
          once. On CUDA the fusions keep megatron's torch.compile.
        - Its inference engine imports wandb, if installed, for its own metrics (inference/contexts/dynamic_context.py
          :70, inside try/except ImportError): 1.3 s per process. megamu generates with its own engines and imports
          wandb itself when a run logs to it (megamu.observability.tracking), so wandb is hidden from megatron's import.
        A megatron-core imported earlier is left as it is."""
        if "megatron.core.jit" in sys.modules:
            return
        hide_wandb = "wandb" not in sys.modules
        real_compile = torch.compile
        if hide_wandb:
            sys.modules["wandb"] = None  # `import wandb` raises ImportError while this entry is None
        if not self.is_cuda:
            torch.compile = _eager
        try:
            import megatron.core.jit  # noqa: F401  (imports megatron.core, whose modules bind jit_fuser here)
        finally:
            torch.compile = real_compile
            if hide_wandb and sys.modules.get("wandb", 0) is None:
                del sys.modules["wandb"]

    def release_cache(self) -> None:
        """Return the caching allocator's free blocks to the driver, so another process (the engine) can use them."""
        if self.is_cuda:
            torch.cuda.empty_cache()

    def ipc_collect(self) -> None:
        """Free the CUDA blocks this process shared over IPC whose consumers have closed them: torch keeps a shared
        block until then, and ``empty_cache`` does not reclaim it (slime calls it after each pushed bucket and after
        the push, update_weight_from_tensor.py). CPU tensors shared as files need nothing."""
        if self.is_cuda:
            torch.cuda.ipc_collect()

    def release_host_cache(self) -> None:
        """Return the free pinned blocks torch's CachingHostAllocator keeps (power-of-two rounded, ATen/core/
        CachingHostAllocator.h) to the OS: a checkpoint's pinned staging must not stay for the rest of the run. The
        same call as ``torch.cuda.graphs`` makes (``torch._C._host_emptyCache``); CPU builds have no such cache."""
        if self.is_cuda:
            torch._C._host_emptyCache()


CPU = Device("cpu")


def _eager(model=None, **_options):
    """torch.compile's call shapes (``compile(fn)`` and ``compile(**options)(fn)``), compiling nothing."""
    return model if model is not None else (lambda fn: fn)


def expandable_segments_on(env: dict[str, str] | None = None) -> bool:
    """Whether the caching allocator was told to use expandable segments (PYTORCH_ALLOC_CONF, or the older
    PYTORCH_CUDA_ALLOC_CONF, which torch reads when the first is unset)."""
    env = os.environ if env is None else env
    conf = env.get("PYTORCH_ALLOC_CONF", env.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    return any(o.replace(" ", "") == "expandable_segments:True" for o in conf.split(","))


@contextlib.contextmanager
def ipc_shareable_allocations(on_cuda: bool) -> Iterator[None]:
    """CUDA blocks allocated inside open in another process from a plain cudaIpc handle. Under expandable segments
    torch exports a block as a POSIX fd that the receiver fetches with pidfd_getfd, which needs ptrace rights over the
    sender and is refused in most containers; torch's allocator can turn expandable segments off for the allocations
    meant to cross processes and back on after (c10/cuda/CUDACachingAllocator.cpp, Note [Expandable Segments]).
    Nothing to do on CPU or when they are off."""
    if not (on_cuda and expandable_segments_on()):
        yield
        return
    import torch

    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
