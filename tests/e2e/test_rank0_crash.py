"""Rank 0 itself dies mid-rollout, on two ranks with a server megamu launched (the schema server of
tests/engines/fake_sglang): the job ends, nothing it started outlives it, and a rerun resumes at the first missing
shard, keeping the shards already written.

Rank 0 dies as a kill would end it (os._exit: no finally, no finaliser). Rank 1 is waiting out the rollout on the CPU
group; torchrun's agent sees rank 0's exit and stops it. The server goes with its launcher (launch._die_with_parent)."""

import json
import sys
import time

import pytest

from tests.e2e.runs import REPO, flags, launch, records
from tests.processes import pid_alive
from tests.torchrun import server_ports


@pytest.mark.slow
def test_rank0_crash_ends_the_job_leaves_no_server_and_resumes(tiny, tmp_path):
    save, record = tmp_path / "run", tmp_path / "servers"
    record.mkdir()
    port = server_ports()
    env = (f"PYTHONPATH={REPO / 'tests' / 'engines' / 'fake_sglang'} FAKE_SGLANG_REPO={REPO} "
           f"FAKE_SGLANG_RECORD={record} FAKE_SGLANG_DELAY=0.1")
    args = flags(tiny, save, "--num-stages", "1", "--eval-prompts", "0", "--tensor-model-parallel-size", "2",
                 "--rollout-engine", "sglang", "--sglang-python", sys.executable, "--sglang-env", env,
                 "--sglang-port-base", str(port), "--sglang-server-concurrency", "1")
    t0 = time.monotonic()
    crashed = launch(args, nproc=2, env={"MEGAMU_CRASH_AFTER": "shard:1"}, check=False, torchrun=True)
    seconds = time.monotonic() - t0
    after_crash = time.time() - (save / "rollouts" / "stage_0" / "shard-00001.parquet").stat().st_mtime
    assert crashed.returncode != 0, crashed.stdout[-2000:]
    server_pid = json.loads((record / f"{port}.json").read_text())["pid"]
    deadline = time.monotonic() + 10
    while pid_alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(server_pid), "the server rank 0 launched outlived it"
    stage = save / "rollouts" / "stage_0"
    written = {p.name: p.read_bytes() for p in stage.glob("shard-*.parquet")}
    assert sorted(written) == ["shard-00000.parquet", "shard-00001.parquet"] and not (stage / "manifest.json").exists()

    resumed = launch(args, nproc=2, torchrun=True)
    assert "[rollout] stage 0: resuming, 2/" in resumed.stdout, resumed.stdout[-3000:]
    assert {p: (stage / p).read_bytes() for p in written} == written  # the shards written before the crash, kept
    assert (stage / "manifest.json").exists() and len(records(save, "update")) == 4
    print(f"\nrank-0 crash: the job ended {after_crash:.1f}s after rank 0 died ({seconds:.1f}s after its start); "
          "the rerun resumed at shard 2")
