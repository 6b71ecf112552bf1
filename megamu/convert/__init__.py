"""HF <-> megatron checkpoints: per-family mapping (mapping.py), TP split/merge (tp.py), folders (checkpoint.py)."""

from megamu.convert.checkpoint import (
    export_hf,
    hf_to_mcore,
    load_hf_into_model,
    load_mcore_into_model,
    mcore_to_hf,
    read_arch,
    save_mcore,
)
from megamu.convert.tp import full_state_dict, gather_tensor, load_full_state_dict, shard_tensor

__all__ = [
    "export_hf", "full_state_dict", "gather_tensor", "hf_to_mcore", "load_full_state_dict", "load_hf_into_model",
    "load_mcore_into_model", "mcore_to_hf", "read_arch", "save_mcore", "shard_tensor",
]
