"""One "node" of a two-node staged stage (torchrun --nnodes 2 --nproc_per_node 1, c10d rendezvous): the lifecycle starts
a fake SGLang server on each node (tests/engines/fake_sglang), rank 0 writes the stage over both, and each node stops
its own servers before going on.

argv: model_dir record_dir port_base [kill | colocated model_dir_2 [disk | distributed | tensor]]. With "kill", node
1 SIGKILLs its server once rank 0 has written the stage's first shard. With "colocated", two colocated stages on the
same servers, the second after a push of model_dir_2: from its folder (disk), or in memory, broadcast by rank 0 to
every node's servers (distributed) or pushed by each node to its own (tensor: the transport of servers on the
trainer's GPUs). Writes record_dir/node<GROUP_RANK>.json."""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from megamu.data.prompts import stop_token_ids
from megamu.engines import EngineConfig
from megamu.engines.lifecycle import EngineLifecycle
from megamu.engines.local import LocalEngine
from megamu.engines.sglang.launch import SGLangConfig
from megamu.engines.weights import Weights
from megamu.mode import COLOCATED, STAGED
from megamu.observability.metrics import MetricsLogger
from megamu.reward.config import RewardConfig, make_scorer
from megamu.rollout import RolloutConfig
from megamu.rollout.phase import run_rollout_phase
from megamu.run.run_dir import RunDir
from megamu.runtime import parallel
from tests.rollout.test_phase import make_prompts
from tests.tiny import build_char_tokenizer


def kill_after_first_shard(first_shard: Path, pid: int) -> None:
    while not first_shard.exists():
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)


def generate(stages: EngineLifecycle, stage: int, tok, version: int, rollout: RolloutConfig, run: RunDir) -> None:
    """As train_staged: the engine's memory back, the engine up (every rank), rank 0 writes the stage."""
    stages.onload()
    stages.start(stage)
    if dist.get_rank() == 0:
        scorer = make_scorer(rollout.reward)
        run_rollout_phase(stages.serving(), make_prompts(tok), run.stage_rollouts(stage),
                          sampling=rollout.sampling(stage, stop_token_ids(tok)),
                          n_samples=rollout.n_samples, scorer=scorer, tokenizer=tok, stage=stage,
                          policy_version=version, groups_per_shard=rollout.groups_per_shard)
        scorer.close()


def colocated(stages: EngineLifecycle, model_dir: str, model_dir_2: str, record: str, node: int, tok, sync: str,
              rollout: RolloutConfig, run: RunDir) -> None:
    stages.update_weights(Weights(version=0, hf_dir=Path(model_dir)), 0)
    generate(stages, 0, tok, 0, rollout, run)
    pids, urls = stages.node.pids, stages.node.urls
    stages.offload()  # the servers stay up
    want = stages.wants()
    assert want.folder == (sync == "disk") and want.every_node == (sync == "tensor"), want
    holds = want.every_node or dist.get_rank() == 0  # as Policy.engine_weights: every rank pushes its own copy
    tensors = ({k: v.clone() for k, v in LocalEngine(model_dir_2).model.state_dict().items()}
               if want.tensors and holds else None)
    stages.update_weights(Weights(version=1, hf_dir=Path(model_dir_2) if want.folder else None, tensors=tensors), 1)
    node_version = stages.node.weight_version
    generate(stages, 1, tok, 1, rollout, run)
    kept = stages.node.pids == pids
    stages.offload()
    stages.stop()  # after rank 0 is done with every node's servers
    gone = not [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    Path(record, f"node{node}.json").write_text(json.dumps({"node": node, "rank": dist.get_rank(), "kept": kept,
                                                            "gone": gone, "urls": urls, "node_version": node_version}))


def main(model_dir: str, record: str, port_base: int, mode: str, model_dir_2: str | None, sync: str) -> None:
    dist.init_process_group("gloo")
    parallel._init_wait_group()  # the CPU-side group init_distributed makes for the trainer
    node = int(os.environ["GROUP_RANK"])
    repo = str(Path(__file__).resolve().parents[3])
    cfg = SGLangConfig(server_python=sys.executable, port_base=port_base + 10 * node, startup_timeout_s=120,
                       log_dir=f"{record}/logs{node}", backoff_s=0.05, server_concurrency=1, probe_period_s=0.5,
                       server_env={"PYTHONPATH": f"{repo}/tests/engines/fake_sglang", "FAKE_SGLANG_REPO": repo,
                                   "FAKE_SGLANG_RECORD": record, "FAKE_SGLANG_DELAY": "0.2"},
                       weight_sync="disk" if sync == "disk" else "memory",
                       **(dict(shares_trainer_devices=True, sync_backend="nccl") if sync == "tensor" else {}))
    rollout = RolloutConfig(n_samples=2, seed=1234, max_new_tokens=8, groups_per_shard=2,
                            reward=RewardConfig(reward_fn="tests.rollout.rewards:parity", num_workers=1))
    tok = build_char_tokenizer()
    run = RunDir(Path(record) / "run")
    metrics = MetricsLogger(str(Path(record) / "run"), None, enabled=dist.get_rank() == 0)
    engine = EngineConfig(kind="sglang", dtype="float32", sglang=cfg)
    stages = (COLOCATED if mode == "colocated" else STAGED).lifecycle(engine, metrics.log)
    if mode == "colocated":
        colocated(stages, model_dir, model_dir_2, record, node, tok, sync, rollout, run)
        dist.destroy_process_group()
        return
    kill = mode == "kill"
    stages.update_weights(Weights(version=0, hf_dir=Path(model_dir)), 0)
    killed = []
    if kill and node == 1:  # the servers start inside generate: watch for them from a thread
        def arm():
            while stages.node is None:
                time.sleep(0.01)
            killed.append(stages.node.pids[0])
            kill_after_first_shard(Path(record) / "run" / "rollouts" / "stage_0" / "shard-00000.parquet", killed[0])
        threading.Thread(target=arm, daemon=True).start()
    generate(stages, 0, tok, 0, rollout, run)
    parallel.wait_for_main_rank()  # rank 0's phase is over (offload waits here too): what did each side see?
    pids = killed + stages.node.pids
    seen = {"node": node, "rank": dist.get_rank(), "urls": stages.node.urls, "pids": pids,
            "node_events": stages.node.health_events,
            "dispatcher_events": stages.engine.health_events if stages.engine is not None else []}
    stages.offload()  # returns once this node's servers are gone
    seen["alive_after_release"] = [p for p in pids if os.path.exists(f"/proc/{p}") and
                                   open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    stages.stop()
    Path(record, f"node{node}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), (sys.argv[4:] or [""])[0], (sys.argv[5:] or [None])[0],
         (sys.argv[6:] or ["disk"])[0])
