"""torchrun worker (4 ranks, one node of 4 "GPUs"): each rank pushes its own copy of the weights to the server on its
GPU (megamu/engines/sglang/rank_push.py). Local rank 0 alone knows the servers' URLs and key, as after a launch.
Args: urls (comma-separated), server_tp, out prefix (each rank writes <prefix>.<rank>: its pid and bytes sent)."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # this checkout's megamu and tests, not an installed one


def main(urls: str, server_tp: str, out: str) -> None:
    from megamu.engines.sglang.launch import SGLangConfig
    from megamu.engines.sglang.rank_push import RankPush
    from megamu.runtime import parallel
    from tests.engines.test_rank_push import state_dict

    torch.set_num_threads(1)
    parallel.init_distributed(1)
    rank = parallel.rank()
    cfg = SGLangConfig(tp_size=int(server_tp), weight_bucket_mb=2000 / 2**20, backoff_s=0.05)  # 3 buckets: a, b, c
    first = parallel.is_node_main()
    pusher = RankPush(urls.split(",") if first else None, "secret" if first else None, cfg, parallel.ranks_per_node())
    sent = pusher.push(state_dict(), "v7")
    pusher.close()
    Path(f"{out}.{rank}").write_text(json.dumps({"pid": os.getpid(), "sent": sent}))


if __name__ == "__main__":
    from tests.torchrun import rank_main

    rank_main(main, *sys.argv[1:])
