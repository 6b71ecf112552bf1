"""Two ranks playing two nodes (torchrun, gloo): each "node" launches a fake SGLang server, rank 0 dispatches over both.

argv: model_dir record_dir port_base. Writes what rank 0 saw to record_dir/rank0.json."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from megamu.engines.sglang.launch import SGLangConfig
from megamu.engines.sglang.nodes import start_sglang
from megamu.engines.types import GenerateRequest, SamplingParams


def main(model_dir: str, record: str, port_base: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.environ["LOCAL_RANK"] = "0"  # one process per "node"
    repo = str(Path(__file__).resolve().parents[3])
    cfg = SGLangConfig(server_python=sys.executable, port_base=port_base + 10 * rank, startup_timeout_s=120,
                       log_dir=f"{record}/logs{rank}", backoff_s=0.05,
                       server_env={"PYTHONPATH": f"{repo}/tests/engines/fake_sglang", "FAKE_SGLANG_REPO": repo,
                                   "FAKE_SGLANG_RECORD": record})
    dispatcher, node = start_sglang(model_dir, cfg)
    assert node is not None and (dispatcher is not None) == (rank == 0)
    dist.barrier()
    if rank == 0:
        reqs = [GenerateRequest(i, [5, 6, 7 + i], SamplingParams(max_new_tokens=3, n=2, seed=1)) for i in range(4)]
        out = dispatcher.generate(reqs)
        Path(record, "rank0.json").write_text(json.dumps({
            "urls": dispatcher.urls, "node_urls": node.urls, "samples": len(out), "api_key": dispatcher.api_key,
            "node_pids": node.pids}))
    dist.barrier()  # rank 1's servers stay up until rank 0 is done with them
    node.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
