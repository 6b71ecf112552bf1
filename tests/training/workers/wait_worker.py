"""torchrun --nproc_per_node 2 worker: a 3 s process-group timeout, and rank 0 busy for 8 s.

Usage: wait_worker.py MODE MEET_DIR. MODE "wait": rank 1 waits in parallel.wait_for_main_rank (must survive, then
a collective on the short-timeout groups still works); MODE "barrier": rank 1 waits in a plain barrier (must time out).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megamu import parallel  # noqa: E402

BUSY_S = 8.0


def meet(folder: Path, rank: int, world: int) -> None:
    """Start-up on a busy machine can put the ranks seconds apart, more than the 3 s rendezvous allows: meet first."""
    (folder / f"rank{rank}").touch()
    deadline = time.monotonic() + 60
    while len(list(folder.glob("rank*"))) < world:
        assert time.monotonic() < deadline, "the other rank never started"
        time.sleep(0.01)


def main(mode: str, meet_dir: str) -> None:
    import os

    torch.set_num_threads(1)
    meet(Path(meet_dir), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    parallel.init_distributed(tensor_model_parallel_size=1, distributed_timeout_minutes=0.05)
    print(f"rank {dist.get_rank()} initialised", flush=True)
    if dist.get_rank() == 0:
        time.sleep(BUSY_S)  # the rollout
    start = time.monotonic()
    if mode == "wait":
        parallel.wait_for_main_rank()
    else:
        parallel.barrier()
    waited = time.monotonic() - start
    x = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(x, group=parallel.dp_group())  # megatron's groups still work after the long wait
    assert x.item() == 3.0, x
    print(f"rank {dist.get_rank()} waited {waited:.1f}s OK", flush=True)
    parallel.destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:3])
