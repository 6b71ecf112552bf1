"""Megatron-LM's model arguments (``--num-layers``, ``--hidden-size``, ``--swiglu``, ...), as slime's
``scripts/models/*.sh`` and every Megatron-LM launch pass them: megamu builds the model from ``--hf-checkpoint``'s
config.json, so these flags change nothing; each one given is checked against that config, and a contradiction is an
error naming the flag, its value and the config's value. Values megamu never builds (LayerNorm, dropout, learned
position embeddings, partial RoPE) are refused with the reason, config or not.

The expected values are ``megamu.training.megatron_schema.megatron_model_args``: the same table the checkpoint's
Megatron-LM ``args`` record. A launch that states the model's shape (any of ``SHAPE_FLAGS``) is read as Megatron-LM
reads it: a boolean feature it leaves out is off there (``--qk-layernorm`` absent builds no q/k norm,
``--normalization`` absent is LayerNorm), so an omission that contradicts the config is an error too. Megatron-LM's
defaults: NVIDIA/Megatron-LM ``megatron/training/arguments.py`` (network-size group, d98e8a6:
``--position-embedding-type`` learned_absolute; ``--swiglu``, ``--group-query-attention`` and
``--untie-embeddings-and-output-weights`` store_true) and megatron-core ``TransformerConfig`` (normalization
"LayerNorm", add_bias_linear True, add_qkv_bias False, qk_layernorm False, attention/hidden dropout 0.1).
"""

from __future__ import annotations

import argparse
import os
import types
from dataclasses import dataclass

from megamu.arguments.flag_errors import flag_error
from megamu.model import ModelArch
from megamu.training.megatron_schema import megatron_model_args


@dataclass(frozen=True)
class ModelFlag:
    flag: str
    key: str  # the Megatron-LM argument (megatron_model_args' key) it sets
    kind: type  # int, float, str; bool: a store-true switch (--disable-bias-linear: stores False)
    hf: str  # where the HF config states it, for the error
    megatron_default: object = None  # what Megatron-LM builds when the flag is absent (checked for switches)


MODEL_FLAGS = (
    ModelFlag("--num-layers", "num_layers", int, "num_hidden_layers"),
    ModelFlag("--hidden-size", "hidden_size", int, "hidden_size"),
    ModelFlag("--ffn-hidden-size", "ffn_hidden_size", int, "intermediate_size"),
    ModelFlag("--num-attention-heads", "num_attention_heads", int, "num_attention_heads"),
    ModelFlag("--group-query-attention", "group_query_attention", bool,
              "num_key_value_heads < num_attention_heads", False),
    ModelFlag("--num-query-groups", "num_query_groups", int, "num_key_value_heads"),
    ModelFlag("--kv-channels", "kv_channels", int, "head_dim"),
    ModelFlag("--max-position-embeddings", "max_position_embeddings", int, "max_position_embeddings"),
    ModelFlag("--vocab-size", "vocab_size", int, "vocab_size"),
    ModelFlag("--make-vocab-size-divisible-by", "make_vocab_size_divisible_by", int,
              "megamu pads the vocab to a multiple of 128 x TP"),
    ModelFlag("--position-embedding-type", "position_embedding_type", str, "RoPE (every supported family)",
              "learned_absolute"),
    ModelFlag("--use-rotary-position-embeddings", "position_embedding_type", bool, "RoPE (every supported family)"),
    ModelFlag("--rotary-base", "rotary_base", float, "rope_theta"),
    ModelFlag("--rotary-percent", "rotary_percent", float, "RoPE over the whole head"),
    ModelFlag("--normalization", "normalization", str, "RMSNorm (rms_norm_eps)", "LayerNorm"),
    ModelFlag("--norm-epsilon", "norm_epsilon", float, "rms_norm_eps"),
    ModelFlag("--swiglu", "swiglu", bool, "hidden_act 'silu', gated MLP", False),
    ModelFlag("--disable-bias-linear", "add_bias_linear", bool, "no bias outside q/k/v", True),
    ModelFlag("--add-qkv-bias", "add_qkv_bias", bool, "model_type (qwen2: q/k/v biases)", False),
    ModelFlag("--qk-layernorm", "qk_layernorm", bool, "model_type (qwen3, qwen3_moe: per-head q/k RMSNorm)", False),
    ModelFlag("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights", bool,
              "tie_word_embeddings", False),
    ModelFlag("--num-experts", "num_experts", int, "num_experts"),
    ModelFlag("--moe-router-topk", "moe_router_topk", int, "num_experts_per_tok"),
    ModelFlag("--moe-ffn-hidden-size", "moe_ffn_hidden_size", int, "moe_intermediate_size"),
    ModelFlag("--attention-dropout", "attention_dropout", float, "megamu's layers have no dropout"),
    ModelFlag("--hidden-dropout", "hidden_dropout", float, "megamu's layers have no dropout"),
)
# A launch giving any of these describes the model as Megatron-LM reads it: absent switches are then checked too.
SHAPE_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads")

# Values megamu never builds, refused whatever the config says: flag -> (the value it runs, why).
ONLY_VALUE = {
    "--normalization": ("RMSNorm", "megamu builds the Llama / Qwen families' RMSNorm layers (megatron-core's "
                                   "LayerNorm is not one of them)"),
    "--position-embedding-type": ("rope", "every model megamu builds uses rotary position embeddings"),
    "--rotary-percent": (1.0, "megamu's models rotate the whole head (partial_rotary_factor 1)"),
    "--attention-dropout": (0.0, "megamu builds its layers without dropout (Megatron-LM's default is 0.1: pass 0)"),
    "--hidden-dropout": (0.0, "megamu builds its layers without dropout (Megatron-LM's default is 0.1: pass 0)"),
    "--make-vocab-size-divisible-by": (128, "megamu pads the vocab to a multiple of 128 x TP, as the HF <-> "
                                            "Megatron converter and the checkpoints assume"),
}


def _dest(f: ModelFlag) -> str:
    return "model_" + f.flag.lstrip("-").replace("-", "_")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "model architecture (Megatron-LM's names; megamu reads the model from --hf-checkpoint's config.json and "
        "checks each flag given against it)")
    for f in MODEL_FLAGS:
        only = ONLY_VALUE.get(f.flag)
        note = f"{only[0]} only: {only[1]}" if only else f"checked against the HF config's {f.hf}"
        if f.kind is bool:
            g.add_argument(f.flag, dest=_dest(f), action="store_const", const=True, default=None, help=note)
        else:
            g.add_argument(f.flag, dest=_dest(f), type=f.kind, default=None, help=note,
                           metavar=f.flag.lstrip("-").replace("-", "_").upper())
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default=None,
                   help="checked against the HF config: Qwen3-MoE's router is a softmax")
    g.add_argument("--moe-layer-freq", default=None, metavar="N|PATTERN",
                   help="which layers are MoE, Megatron-LM's two forms (every N-th layer, or a list such as "
                        "'[1,1,0]' / '([1]*3+[0])*2'): checked against the HF config (Qwen3-MoE: every layer)")
    g.add_argument("--seq-length", type=int, default=None,
                   help="Megatron-LM's sequence length: megamu's rows are --max-prompt-length + "
                        "--rollout-max-response-len tokens; checked to fit max_position_embeddings")


def given_model_flags(args: argparse.Namespace) -> dict[str, object]:
    """The model flags the launch gave, flag -> value (a switch: True)."""
    return {f.flag: getattr(args, _dest(f)) for f in MODEL_FLAGS if getattr(args, _dest(f)) is not None}


def _stated(f: ModelFlag, value) -> object:
    """What the flag's value tells Megatron-LM (``--disable-bias-linear``: add_bias_linear False; the rotary switch:
    position_embedding_type rope)."""
    if f.flag == "--disable-bias-linear":
        return not value
    if f.flag == "--use-rotary-position-embeddings":
        return "rope" if value else "learned_absolute"
    return value


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and float(a) == float(b)
    return a == b


def check_model_arguments(args: argparse.Namespace, hf_config: dict | None) -> None:
    """Refuse what megamu never builds, then (config readable) every model flag that contradicts the HF config."""
    given = given_model_flags(args)
    moe_given = args.moe_router_score_function is not None or args.moe_layer_freq is not None
    for flag, value in given.items():
        if flag in ONLY_VALUE and not _same(value, ONLY_VALUE[flag][0]):
            supported, why = ONLY_VALUE[flag]
            flag_error(flag, f"{value} is not supported: {why} (give {supported} or drop the flag)")
    if not given and args.seq_length is None and not moe_given:
        return
    if hf_config is None:
        print("warning: model flags (--num-layers, ...) not checked: --hf-checkpoint's config.json is not readable "
              "here", flush=True)
        return
    try:
        arch = ModelArch.from_hf(types.SimpleNamespace(**hf_config))
    except (ValueError, KeyError) as e:
        flag_error("--hf-checkpoint", f"the model flags cannot be checked against this config: {e}")
    expected = megatron_model_args(arch)
    where = f"--hf-checkpoint {args.hf_checkpoint}'s config.json"
    describes_model = any(flag in given for flag in SHAPE_FLAGS)
    if describes_model and "--position-embedding-type" not in given and "--use-rotary-position-embeddings" in given:
        given["--position-embedding-type"] = "rope"  # the deprecated switch and the type state the same thing
    for f in MODEL_FLAGS:
        if f.flag in given:
            stated, shown = _stated(f, given[f.flag]), given[f.flag]
        elif describes_model and f.megatron_default is not None:
            stated, shown = f.megatron_default, "absent"  # Megatron-LM would build its default
        else:
            continue
        want = expected[f.key]
        if not _same(stated, want):
            reading = f" (Megatron-LM then builds {f.key}={stated})" if shown in (True, "absent") else ""
            hf = f"{f.hf} = {hf_config[f.hf]}" if f.hf in hf_config else f"{f.hf}, i.e. {f.key}={want}"
            flag_error(f.flag, f"{'given' if shown is True else shown}{reading} contradicts {where}: {hf}")
    if arch.num_experts:  # a dense model has no router and no MoE layers: Megatron-LM ignores both flags there
        _check_moe_layout(args, arch, where)
    if args.seq_length is not None and args.seq_length > arch.max_position_embeddings:
        flag_error("--seq-length", f"{args.seq_length} exceeds {where}: max_position_embeddings="
                                   f"{arch.max_position_embeddings}")


def resolve_hf_checkpoint(args: argparse.Namespace) -> None:
    """--hf-checkpoint as a hub id (``org/name``, not a folder here): the snapshot in the local HF cache
    (``huggingface_hub.snapshot_download(local_files_only=True)``: HF_HUB_CACHE / HF_HOME honoured). megamu never
    downloads: a hub id absent from the cache is an error saying how to fetch it (a warning in a dry run)."""
    name = args.hf_checkpoint
    if not name or os.path.exists(name) or name.count("/") != 1 or name.startswith((".", "/", "~")):
        return
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        args.hf_checkpoint = snapshot_download(name, local_files_only=True)
        print(f"note: --hf-checkpoint {name} -> {args.hf_checkpoint} (the local HF cache)", flush=True)
    except LocalEntryNotFoundError:
        message = (f"{name} is neither a folder here nor in the local HF cache (megamu does not download): fetch it "
                   f"first, e.g. `huggingface-cli download {name}`, or give the model's folder")
        if not args.dry_run:
            flag_error("--hf-checkpoint", message)
        print(f"warning: --hf-checkpoint: {message} (ignored by --dry-run)", flush=True)


def moe_layer_pattern(value: str, num_layers: int) -> list[int]:
    """Megatron-LM's ``--moe-layer-freq`` as the 0/1 list of MoE layers. Its two forms (``moe_freq_type``,
    megatron/training/arguments.py): an integer N, one MoE layer every N (layer i when i % N == 0, megatron-core
    ``models/gpt/gpt_layer_specs.py:583-586``), or a Python list expression such as ``[1,1,0]`` or
    ``([1]*3+[0])*2`` that Megatron-LM evaluates; megamu reads such expressions itself (lists of 0/1, + and * by an
    integer only), and the list must have one entry per layer (gpt_layer_specs.py:589)."""
    import ast

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = ev(node.left), ev(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(ast.dump(node))

    text = value.strip()
    try:
        if "[" not in text:
            n = int(text)
            if n < 1:
                raise ValueError(text)
            return [int(i % n == 0) for i in range(num_layers)]
        pattern = ev(ast.parse(text, mode="eval"))
    except (ValueError, SyntaxError, TypeError):
        flag_error("--moe-layer-freq", f"{value!r} is neither an integer N >= 1 nor a list of 0/1 such as '[1,0,1]' or "
                                       "'([1]*3+[0])*2'")
    if not isinstance(pattern, list) or any(x not in (0, 1) for x in pattern) or len(pattern) != num_layers:
        flag_error("--moe-layer-freq", f"{value!r} must give one 0 or 1 per layer ({num_layers} layers), got {pattern}")
    return pattern


def _check_moe_layout(args: argparse.Namespace, arch: ModelArch, where: str) -> None:
    """The router's score function and the MoE layers are the HF config's: Qwen3-MoE softmaxes its router logits
    (transformers' Qwen3MoeSparseMoeBlock) and has every layer sparse (decoder_sparse_step 1, no mlp_only_layers:
    ModelArch refuses other configs)."""
    if args.moe_router_score_function not in (None, "softmax"):
        flag_error("--moe-router-score-function", f"{args.moe_router_score_function} contradicts {where}: model_type "
                                                  f"{arch.family} routes with a softmax (give softmax or drop the "
                                                  "flag)")
    if args.moe_layer_freq is not None:
        pattern = moe_layer_pattern(args.moe_layer_freq, arch.num_layers)
        dense = [i for i, x in enumerate(pattern) if not x]
        if dense:
            flag_error("--moe-layer-freq", f"{args.moe_layer_freq} makes layers {dense} dense, which contradicts "
                                           f"{where}: every layer is MoE (decoder_sparse_step 1, mlp_only_layers [])")
