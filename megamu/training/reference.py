"""The frozen reference policy π_ref of the KL term (megamu.algo.kl): a second model, weights only, never trained.

π_ref scores the responses about to be trained on (its log-probs at the policy's temperature) before each update,
as slime's ``train_actor`` (slime/backends/megatron_utils/actor.py) does with ``compute_log_prob(store_prefix="ref_")``
and verl's ref worker does. slime swaps host-kept "ref" weights into the actor's own module for that forward
(``_switch_model("ref")``); megamu keeps a second module instead, so the actor's weights are never overwritten: it
costs one copy of the parameters on the device while training (a row of the memory plan) and leaves the device while
an engine generates, as the actor's weights do. No gradients, no optimiser state.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megamu.rollout.records import RolloutSample
from megamu.training.host_mirror import HostMirror
from megamu.training.step import compute_logprobs


class ReferencePolicy:
    """``model``: built like the actor and loaded with the run's initial weights by the caller (Policy)."""

    def __init__(self, model: torch.nn.Module, *, pin_memory: bool):
        self.model = model
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()
        self._mirror = HostMirror(pin=pin_memory)
        self._offloaded = False

    def score(self, samples: list[RolloutSample], **logprob_options) -> list[RolloutSample]:
        """``samples`` with ``ref_logprobs`` set (collective over data-parallel ranks, like compute_logprobs)."""
        values = compute_logprobs(self.model, samples, **logprob_options)
        return [replace(s, ref_logprobs=v) for s, v in zip(samples, values)]

    def offload(self) -> None:
        """The weights that live on an accelerator go to host memory (nothing moves on CPU, where the actor's
        weights stay too): the same tensors the actor's GPU offload moves (host_mirror.device_tensors' rule)."""
        if not self._offloaded:
            self._mirror.offload([p for p in self.model.parameters() if p.is_cuda])
            self._offloaded = True

    def reload(self) -> None:
        if self._offloaded:
            self._mirror.reload()
            self._offloaded = False
