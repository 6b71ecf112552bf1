"""Tiny, offline, random HF models and a character-level tokenizer: for tests, benchmarks and dry runs.

Nothing here downloads anything; everything is built from code, so CI and benchmarks never touch a hub.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

# A chat template in the ChatML shape SmolLM2/Qwen use, so prompt code paths are the same as for real models.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]


def build_char_tokenizer():
    """A fast tokenizer over printable ASCII: ids 0..3 special (<|im_end|> = 2 is EOS), then one id per char."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<|im_start|>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


TINY_DEFAULTS = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def tiny_hf_config(family: str = "llama", vocab_size: int | None = None, **overrides):
    """A transformers config for a tiny model of ``family`` in {llama, qwen2, qwen3, qwen3_moe}; GQA by default.
    qwen3_moe: 4 experts of width 32, top-2, renormalised routing weights (Qwen3-30B-A3B's router settings)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    vocab = vocab_size if vocab_size is not None else len(build_char_tokenizer())
    kw = dict(TINY_DEFAULTS, vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    if family == "llama":
        kw.setdefault("tie_word_embeddings", True)
        return LlamaConfig(**kw)
    if family == "qwen2":
        kw.setdefault("tie_word_embeddings", False)
        return Qwen2Config(**kw)
    if family == "qwen3":
        kw.setdefault("tie_word_embeddings", False)
        kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
        return Qwen3Config(**kw)
    if family == "qwen3_moe":
        kw.setdefault("tie_word_embeddings", False)
        kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
        for key, value in (("num_experts", 4), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32),
                           ("norm_topk_prob", True)):
            kw.setdefault(key, value)
        return Qwen3MoeConfig(**kw)
    raise ValueError(f"unknown tiny model family {family!r}; expected llama, qwen2, qwen3 or qwen3_moe")


def save_tiny_model(out_dir: str | Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a random tiny HF model (fp32 safetensors), the char tokenizer and a generation config to ``out_dir``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = tiny_hf_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init with std 0.02 gives near-uniform outputs; a larger spread makes sampling and log-prob tests sharper.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    build_char_tokenizer().save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out)
    (out / "megamu_tiny.json").write_text(json.dumps({"family": family, "seed": seed}))
    return out
