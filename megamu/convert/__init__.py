"""HF <-> megatron: per-family mapping (mapping.py), TP split/merge (tp.py), HF folders in and out of a live model
(checkpoint.py), HF <-> torch_dist checkpoints through mbridge (bridge.py)."""

from megamu.convert.checkpoint import export_hf, load_hf_into_model
from megamu.convert.tp import full_state_dict, gather_tensor, load_full_state_dict, shard_tensor

__all__ = [
    "export_hf", "full_state_dict", "gather_tensor", "load_full_state_dict", "load_hf_into_model", "shard_tensor",
]
