"""torchrun --nproc_per_node 2 worker: a 3 s process-group timeout, and rank 0 busy for 8 s.

Rank 1 also reaches the rendezvous 5 s after rank 0, as a slow node does: it must still join.
Usage: wait_worker.py MODE DIR. MODE "wait": rank 1 waits in parallel.wait_for_main_rank (must survive, then
a collective on the short-timeout groups still works); MODE "barrier": rank 1 waits in a plain barrier (must time out);
MODE "export": both ranks export DIR/hf's model (TP=1, DP=2) with export_hf while rank 0's write is slow (must
survive: rank 1 waits for the write on the CPU-side group); MODE "save": both ranks save a training checkpoint of
DIR/hf's model (DP=2) while rank 1 writes its shards slowly and rank 0's retention is slow (must survive: the save's
collectives and waits run on its own gloo group), then load it back.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megamu.runtime import parallel  # noqa: E402

BUSY_S = 8.0
LATE_S = 5.0  # rank 1 starts this much later than rank 0: more than the 3 s timeout


def export_slowly(folder: Path) -> None:
    """export_hf of the model in ``folder/hf``; rank 0's write (the only rank that writes) takes BUSY_S longer, as a
    large model's last shard on a slow disk does."""
    from megamu.convert import checkpoint, load_hf_into_model
    from megamu.model import ModelArch, build_model

    arch = ModelArch.from_hf(folder / "hf")
    model = build_model(arch)
    load_hf_into_model(model, arch, folder / "hf")
    write = checkpoint._write_hf

    def slow_write(*args, **kwargs):
        time.sleep(BUSY_S)
        return write(*args, **kwargs)

    checkpoint._write_hf = slow_write
    checkpoint.export_hf(model, arch, folder / "export", hf_source_dir=folder / "hf", dtype="fp32")
    assert (folder / "export" / "config.json").exists()  # rank 1 returns only once rank 0's folder is complete


def save_slowly(folder: Path) -> None:
    """save_checkpoint with rank 1's shard write BUSY_S slower (inside torch.distributed.checkpoint, between its plan
    and finish collectives, as a slow disk is) and rank 0's retention BUSY_S slower (while the others wait for
    publish), then load_checkpoint of the result on both ranks."""
    import torch.distributed.checkpoint as dcp

    from megamu.model import ModelArch, build_model
    from megamu.training import OptimizerConfig, build_optimizer, checkpoint_dirs, load_checkpoint, save_checkpoint

    arch = ModelArch.from_hf(folder / "hf")
    model = build_model(arch)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3))
    if dist.get_rank() == 1:
        write = dcp.FileSystemWriter.write_data

        def slow_write(self, *args, **kwargs):
            time.sleep(BUSY_S)
            return write(self, *args, **kwargs)

        dcp.FileSystemWriter.write_data = slow_write
    else:
        prune = checkpoint_dirs.prune_checkpoints

        def slow_prune(*args, **kwargs):
            time.sleep(BUSY_S)
            return prune(*args, **kwargs)

        checkpoint_dirs.prune_checkpoints = slow_prune
    out = save_checkpoint(folder / "save", 1, model, arch, opt, extra={"stage": 0})
    assert out == folder / "save" / "iter_0000001" and out.is_dir()  # every rank returns once it is in place
    assert load_checkpoint(folder / "save", build_model(arch), arch, opt)["iteration"] == 1


def main(mode: str, _dir: str) -> None:
    import os

    torch.set_num_threads(1)
    if int(os.environ["RANK"]) == 1:
        time.sleep(LATE_S)  # a node that starts late: the rendezvous must wait for it beyond the short timeout
    parallel.init_distributed(tensor_model_parallel_size=1, distributed_timeout_minutes=0.05)
    print(f"rank {dist.get_rank()} initialised", flush=True)
    if dist.get_rank() == 0 and mode not in ("export", "save"):
        time.sleep(BUSY_S)  # the rollout
    start = time.monotonic()
    if mode == "export":
        export_slowly(Path(_dir))
    elif mode == "save":
        save_slowly(Path(_dir))
    elif mode == "wait":
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
