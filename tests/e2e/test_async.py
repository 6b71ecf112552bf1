"""End to end: `pretrain_mu_grpo.py --rollout-mode async` on a tiny random model (issue 13, paper §5.1).

Every check is made against the durable queue itself: the groups each update consumed are read back from the shards,
and their stored policy versions give the lags, the drops and the trained groups independently of the trainer.
"""

import re
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megamu.arguments import parse_args
from tests.e2e.runs import launch, records
from tests.processes import pid_alive

B_MINI, G, PER_SHARD = 2, 4, 2


def async_flags(model: Path, save: Path, *, iters: int, lag: int, sync: int, extra: tuple = ()) -> list[str]:
    return [
        "--hf-checkpoint", str(model), "--save", str(save), "--rollout-mode", "async", "--train-iters", str(iters),
        "--prompts-per-update", str(B_MINI), "--n-samples-per-prompt", str(G), "--rollout-max-response-len", "8",
        "--eval-prompts", "2", "--lr", "1e-3", "--reward-fn", "tests.e2e.rewards:has_digit", "--micro-batch-size", "4",
        "--rollout-groups-per-shard", str(PER_SHARD), "--save-interval", "2", "--seed", "7",
        "--max-policy-lag", str(lag), "--weight-sync-interval", str(sync), "--no-skip-zero-advantage", *extra,
    ]


def stored_groups(save: Path) -> dict[int, tuple[int, int]]:
    """Queue position -> (policy_version, rows) of every group in the stored shards, from the Parquet files."""
    out: dict[int, list] = {}
    for shard in sorted((save / "rollouts" / "async").glob("shard-*.parquet")):
        cols = pq.read_table(shard, columns=["prompt_id", "policy_version"]).to_pydict()
        for pid, version in zip(cols["prompt_id"], cols["policy_version"]):
            out.setdefault(pid, []).append(version)
    assert all(len(set(v)) == 1 for v in out.values()), "a group mixes policy versions"
    return {pid: (v[0], len(v)) for pid, v in out.items()}


def check_consumption(save: Path, iters: int, lag: int) -> None:
    """Each update's queue range, re-derived from the shards: contiguous, never overlapping, lags within K, drops
    counted exactly (in samples), and B_mini groups trained."""
    updates, stored = records(save, "update"), stored_groups(save)
    assert [u["update"] for u in updates] == list(range(iters))
    cursor, dropped = 0, 0
    for u in updates:
        assert u["queue_from"] == cursor, "a consumed group was repeated or skipped"
        positions = range(u["queue_from"], u["queue_to"])
        assert all(p in stored for p in positions), "a consumed group is missing from the queue"
        lags = [u["update"] - stored[p][0] for p in positions]  # version at update u = u (updates applied)
        kept = [x for x in lags if x <= lag]
        dropped += sum(stored[p][1] for p, x in zip(positions, lags) if x > lag)
        assert len(kept) == B_MINI and all(stored[p][1] == G for p in positions)
        assert u["policy_lag_max"] == max(kept) <= lag
        assert u["policy_lag_mean"] == pytest.approx(sum(kept) / len(kept))
        assert u["dropped_stale"] == dropped
        assert u["trainer_idle_s"] >= 0 and 0 <= u["idle_ratio"] <= 1 and u["queue_depth"] >= 0
        cursor = u["queue_to"]
    # nothing stored is lost: every group before the cursor was consumed (trained or counted as dropped) ...
    assert set(range(cursor)) <= set(stored)
    # ... and the queue holds no holes beyond it (whole shards only)
    assert sorted(stored) == list(range(len(stored))) and len(stored) % PER_SHARD == 0


def wait_workers_gone(save: Path, timeout_s: float = 120) -> None:
    """Every engine process the run started has exited (an orphan finishes its current shard first)."""
    pids = [int(p) for p in re.findall(r"\[async worker (\d+)\]", (save / "rollouts/async/worker.log").read_text())]
    assert pids
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(pid_alive(p) for p in pids), "an engine process outlived its trainer"


@pytest.mark.slow
def test_async_run_bounds_lag_syncs_and_reports_idle(tiny, tmp_path):
    save, iters, lag, sync = tmp_path / "async", 24, 3, 2
    launch(async_flags(tiny, save, iters=iters, lag=lag, sync=sync))
    check_consumption(save, iters, lag)
    syncs = records(save, "sync")
    assert [s["update"] for s in syncs] == list(range(sync, iters, sync))  # every N updates, none after the last
    assert all(s["version"] == s["update"] and s["t_sync"] >= 0 for s in syncs)
    assert all(s["in_flight"] == "finish_on_old_weights" for s in syncs)
    updates = records(save, "update")
    assert updates[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # θ = β: the engine served the trainer's θ_0
    assert max(u["engine_version"] for u in updates) > 0  # the engine did reload pushed weights
    assert len(records(save, "eval")) == 1 and (save / "hf" / "final" / "config.json").exists()
    wait_workers_gone(save, timeout_s=10)


@pytest.mark.slow
def test_tiny_lag_drops_stale_and_engine_and_trainer_kills_resume(tiny, tmp_path):
    """K = 1 with a deep queue, so groups may wait longer than K updates: whatever the engine's timing, every drop is
    counted and no stale group trained (check_consumption; drops are forced deterministically in
    tests/rollout/test_async_queue.py). The engine process dying mid-run is a clear error, not a hang; a trainer
    killed mid-run resumes at its checkpointed cursor without repeating or losing a group. (Two tests of a kill and a
    resume each, before: one chain launches 3 trainers instead of 4.)"""
    save, iters, lag = tmp_path / "tiny-k", 10, 1
    flags = async_flags(tiny, save, iters=iters, lag=lag, sync=1, extra=("--rollout-queue-groups", "8"))
    t0 = time.monotonic()
    died = launch(flags, env={"MEGAMU_CRASH_AFTER": "shard:2"}, check=False)  # the engine process exits after shard 2
    assert died.returncode != 0 and time.monotonic() - t0 < 500  # launch's own timeout would fail a hang anyway
    assert "engine process exited with code 17" in died.stderr
    assert "rerun the same command to resume" in died.stderr
    crashed = launch(flags, env={"MEGAMU_CRASH_AFTER": "update:5"}, check=False)
    assert crashed.returncode != 0 and not (save / "hf" / "final").exists()
    assert "engine process exited" not in crashed.stderr  # the trainer's own kill this time
    launch(flags)
    check_consumption(save, iters, lag)
    wait_workers_gone(save)


@pytest.mark.slow
def test_tp2_ranks_wait_for_the_engine_on_the_cpu_group(tiny, tmp_path):
    """Rank 1 waits while rank 0 waits for the engine process (its start, a slow reward, a reload): that wait is on
    the CPU-side gloo group, so a collective timeout of 3 s does not end a run whose shards take longer than that."""
    save, iters, lag = tmp_path / "tp2", 4, 2
    flags = async_flags(tiny, save, iters=iters, lag=lag, sync=2,
                        extra=("--tensor-model-parallel-size", "2", "--distributed-timeout-minutes", "0.05"))
    flags[flags.index("tests.e2e.rewards:has_digit")] = "tests.e2e.rewards:slow_has_digit"
    launch(flags, nproc=2)
    check_consumption(save, iters, lag)
    assert max(u["trainer_idle_s"] for u in records(save, "update")) > 3  # the wait did outlast the timeout
    wait_workers_gone(save)


@pytest.mark.parametrize(
    "bad, flag",
    [
        (["--max-policy-lag", "1", "--weight-sync-interval", "2"], "--max-policy-lag"),
        (["--num-stages", "2"], "--num-stages"),
        (["--mu", "4"], "--mu"),
        (["--rollout-queue-groups", "1"], "--rollout-queue-groups"),
        (["--behaviour-logprobs", "recompute"], "--behaviour-logprobs"),
    ],
)
def test_bad_async_flags_name_the_flag(tiny, tmp_path, bad, flag):
    with pytest.raises(SystemExit, match=flag):
        parse_args(async_flags(tiny, tmp_path / "bad", iters=4, lag=2, sync=2, extra=tuple(bad)))
    assert not (tmp_path / "bad").exists()


def test_train_iters_is_num_stages_times_mu_in_staged_mode(tiny, tmp_path):
    base = ["--hf-checkpoint", str(tiny), "--save", str(tmp_path / "s"), "--prompts-per-stage", "8",
            "--prompts-per-update", "2"]
    assert parse_args(base + ["--train-iters", "12"]).plan.num_stages == 3  # μ = 4
    with pytest.raises(SystemExit, match="--train-iters"):
        parse_args(base + ["--train-iters", "10"])
    with pytest.raises(SystemExit, match="--train-iters"):
        parse_args(base + ["--train-iters", "12", "--num-stages", "2"])
    plan = parse_args(async_flags(tiny, tmp_path / "a", iters=9, lag=4, sync=4)).plan
    assert (plan.total_updates, plan.prompts_per_update, plan.summary()["weight_syncs"]) == (9, B_MINI, 2)
