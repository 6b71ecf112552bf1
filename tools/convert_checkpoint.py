"""Convert checkpoints between HF folders, megatron-core torch_dist checkpoints (what Megatron-LM and megamu's training
write and ``--load``) and megamu's TP-independent megatron ("mcore") folders.

  python tools/convert_checkpoint.py hf-to-torch-dist --load HF_DIR --save CKPT_DIR
  python tools/convert_checkpoint.py torch-dist-to-hf --load CKPT_DIR --hf-source HF_DIR --save HF_OUT [--dtype ...]
  python tools/convert_checkpoint.py hf-to-mcore --load HF_DIR --save MCORE_DIR --tensor-model-parallel-size N
  python tools/convert_checkpoint.py mcore-to-hf --load MCORE_DIR --save HF_DIR [--dtype bf16|fp16|fp32]

The torch_dist commands go through mbridge (megamu.convert.bridge) and build the model in this one process (TP=1);
the checkpoint loads at any TP size. CKPT_DIR is a Megatron save dir (latest_checkpointed_iteration.txt + iter_N/).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a source checkout


def _progress(desc: str, total: int | None):
    from tqdm import tqdm

    return lambda items: tqdm(items, desc=desc, total=total, unit="tensor")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    h2m = sub.add_parser("hf-to-mcore", help="HF safetensors folder -> mcore folder")
    h2m.add_argument("--load", required=True, type=Path, help="HF model folder (config.json + *.safetensors)")
    h2m.add_argument("--save", required=True, type=Path, help="output mcore folder (replaced atomically)")
    h2m.add_argument("--tensor-model-parallel-size", type=int, default=1,
                     help="TP size the model will be trained at (checked and recorded; the folder loads at any TP)")
    m2h = sub.add_parser("mcore-to-hf", help="mcore folder -> HF safetensors folder")
    m2h.add_argument("--load", required=True, type=Path, help="mcore folder written by hf-to-mcore or training")
    m2h.add_argument("--save", required=True, type=Path, help="output HF folder (replaced atomically)")
    m2h.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    h2d = sub.add_parser("hf-to-torch-dist", help="HF safetensors folder -> torch_dist checkpoint (via mbridge)")
    h2d.add_argument("--load", required=True, type=Path, help="HF model folder (config.json + *.safetensors)")
    h2d.add_argument("--save", required=True, type=Path, help="output save dir (tracker + iter_0000000/)")
    d2h = sub.add_parser("torch-dist-to-hf", help="torch_dist checkpoint -> HF safetensors folder (via mbridge)")
    d2h.add_argument("--load", required=True, type=Path, help="save dir of megamu or Megatron-LM (tracker + iter_N/)")
    d2h.add_argument("--hf-source", required=True, type=Path, help="HF folder of the model: config and tokenizer")
    d2h.add_argument("--save", required=True, type=Path, help="output HF folder (replaced atomically)")
    d2h.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    for p in (h2m, m2h, d2h):
        p.add_argument("--max-shard-size-gb", type=float, default=2.0, help="max bytes per safetensors shard, in GiB")
    args = parser.parse_args(argv)
    if not args.load.is_dir():
        parser.error(f"--load {args.load}: no such folder")
    if args.command in ("hf-to-torch-dist", "torch-dist-to-hf"):
        return _torch_dist(args)

    from megamu.convert.checkpoint import hf_to_mcore, mcore_to_hf, read_arch
    from megamu.convert.mapping import plan
    from megamu.model.config import ModelArch

    shard_bytes = int(args.max_shard_size_gb * 1024**3)
    try:
        if args.command == "hf-to-mcore":
            total = len(plan(ModelArch.from_hf(args.load)))
            hf_to_mcore(args.load, args.save, tp=args.tensor_model_parallel_size, max_shard_bytes=shard_bytes,
                        progress=_progress("hf-to-mcore", total))
        else:
            total = len(plan(read_arch(args.load)))
            mcore_to_hf(args.load, args.save, dtype=args.dtype, max_shard_bytes=shard_bytes,
                        progress=_progress("mcore-to-hf", total))
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"error: {args.command} --load {args.load}: {e.args[0] if e.args else e}", file=sys.stderr)
        return 1
    print(f"wrote {args.save}")
    return 0


def _torch_dist(args) -> int:
    from megamu.convert.bridge import hf_to_torch_dist, torch_dist_to_hf
    from megamu.parallel import init_distributed

    init_distributed(1)
    try:
        if args.command == "hf-to-torch-dist":
            hf_to_torch_dist(args.load, args.save)
        else:
            torch_dist_to_hf(args.load, args.hf_source, args.save, dtype=args.dtype,
                             max_shard_bytes=int(args.max_shard_size_gb * 1024**3))
    except (KeyError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {args.command} --load {args.load}: {e.args[0] if e.args else e}", file=sys.stderr)
        return 1
    print(f"wrote {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
