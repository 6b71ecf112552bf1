from megamu.model.build import allreduce_tp_partial_grads, build_model, unwrap
from megamu.model.config import ModelArch, padded_vocab_size, transformer_config
from megamu.model.logprobs import forward_logprobs, score_tokens, token_logprobs

__all__ = [
    "ModelArch", "allreduce_tp_partial_grads", "build_model", "forward_logprobs", "padded_vocab_size", "score_tokens",
    "token_logprobs", "transformer_config", "unwrap",
]
