"""Convert between HF folders and megatron-core torch_dist checkpoints (what Megatron-LM and megamu's training write
and what ``--load`` / ``--pretrained-checkpoint`` read).

  python tools/convert_checkpoint.py hf-to-torch-dist --load HF_DIR --save CKPT_DIR
  python tools/convert_checkpoint.py torch-dist-to-hf --load CKPT_DIR --hf-source HF_DIR --save HF_OUT [--dtype ...]

Both go through mbridge (megamu.convert.bridge) and build the model in this one process (TP=1); the checkpoint loads
at any TP size. CKPT_DIR is a Megatron save dir (latest_checkpointed_iteration.txt + iter_N/). The trainer also reads
HF folders directly (``--hf-checkpoint``), so hf-to-torch-dist is needed only where a torch_dist start point is wanted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a source checkout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    h2d = sub.add_parser("hf-to-torch-dist", help="HF safetensors folder -> torch_dist checkpoint (via mbridge)")
    h2d.add_argument("--load", required=True, type=Path, help="HF model folder (config.json + *.safetensors)")
    h2d.add_argument("--save", required=True, type=Path, help="output save dir (tracker + iter_0000000/)")
    d2h = sub.add_parser("torch-dist-to-hf", help="torch_dist checkpoint -> HF safetensors folder (via mbridge)")
    d2h.add_argument("--load", required=True, type=Path, help="save dir of megamu or Megatron-LM (tracker + iter_N/)")
    d2h.add_argument("--hf-source", required=True, type=Path, help="HF folder of the model: config and tokenizer")
    d2h.add_argument("--save", required=True, type=Path, help="output HF folder (replaced atomically)")
    d2h.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    d2h.add_argument("--max-shard-size-gb", type=float, default=2.0, help="max bytes per safetensors shard, in GiB")
    args = parser.parse_args(argv)
    if not args.load.is_dir():
        parser.error(f"--load {args.load}: no such folder")

    from megamu.runtime.parallel import init_distributed
    from megamu.training.torch_dist import hf_to_torch_dist, torch_dist_to_hf

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
