"""Generating and storing a stage: the rollout phase (phase.py) writes the static dataset D_k (dataset.py); async mode's
engine process (async_worker.py) fills its durable queue with shards of the same format.

``RolloutConfig`` (rollout_config.py) holds how a stage's samples are drawn and stored; which engine draws them is
the engines' config.
Nothing here imports the trainer (megamu.training): the loops hand the phase an engine and prompts.
"""

from __future__ import annotations

from megamu.rollout.rollout_config import RolloutConfig

__all__ = ["RolloutConfig"]
