"""Two ranks under torchrun (gloo): DP=2 gradient invariance for every aggregation, TP=1 vs TP=2 after one update,
checkpoints saved at TP=2 loaded at TP=1 and back (see workers/parallel_worker.py for the assertions)."""

import json
import re
from pathlib import Path

import pytest

from tests.tiny import save_tiny_model
from tests.torchrun import run_torchrun

pytestmark = pytest.mark.slow  # torchrun worlds

WORKER = Path(__file__).parent / "workers" / "parallel_worker.py"


# qwen3: its q/k norms are replicated over TP but each rank sees only its heads' part of their gradient.
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_data_and_tensor_parallel_training_and_resharding(tmp_path, family):
    hf = save_tiny_model(tmp_path / "hf", family, seed=4, vocab_size=48)
    proc = run_torchrun(WORKER, 2, str(hf), str(tmp_path / "ckpt"), timeout=240)
    print(proc.stdout)
    assert proc.stdout.strip().endswith("OK")
    assert "max rel grad diff" in proc.stdout and "TP=1 checkpoint loaded at TP=2" in proc.stdout


WAIT_WORKER = Path(__file__).parent / "workers" / "wait_worker.py"


def test_ranks_wait_for_a_long_rank0_phase_on_the_cpu_group_despite_a_short_timeout(tmp_path):
    proc = run_torchrun(WAIT_WORKER, 2, "wait", str(tmp_path), timeout=120)
    # the ranks share stdout, so their lines may interleave: find the reports anywhere in it
    waited = {int(r): float(t) for r, t in re.findall(r"rank (\d) waited ([\d.]+)s OK", proc.stdout)}
    assert set(waited) == {0, 1} and waited[1] > 3.0, proc.stdout  # rank 1 waited past the 3 s timeout and survived


def test_ranks_wait_for_rank0s_hf_export_on_the_cpu_group_despite_a_short_timeout(tmp_path):
    """export_hf: only rank 0 writes; the other ranks wait for it on the CPU-side group, whatever the collective
    timeout (3 s here, with a write 8 s slower than usual)."""
    save_tiny_model(tmp_path / "hf", "llama", 0)
    proc = run_torchrun(WAIT_WORKER, 2, "export", str(tmp_path), timeout=180)
    waited = {int(r): float(t) for r, t in re.findall(r"rank (\d) waited ([\d.]+)s OK", proc.stdout)}
    assert set(waited) == {0, 1} and waited[1] > 3.0, proc.stdout
    assert any((tmp_path / "export").glob("*.safetensors"))


def test_a_save_survives_a_slow_writer_and_a_slow_retention_despite_a_short_timeout(tmp_path):
    """A torch_dist save (issue 50): rank 1 writes its shards 8 s late and rank 0's retention takes 8 s, under a 3 s
    collective timeout; the ranks wait for each other on the save's gloo group (parallel.save_group) and the
    checkpoint loads back. On the default group either wait times out (the barrier control below)."""
    save_tiny_model(tmp_path / "hf", "llama", 0)
    proc = run_torchrun(WAIT_WORKER, 2, "save", str(tmp_path), timeout=180)
    waited = {int(r): float(t) for r, t in re.findall(r"rank (\d) waited ([\d.]+)s OK", proc.stdout)}
    # each rank waits 8 s for the other (past the 3 s timeout) besides its own 8 s
    assert set(waited) == {0, 1} and min(waited.values()) > 2 * 8.0, proc.stdout
    assert (tmp_path / "save" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_save_timeout_is_sized_to_the_largest_rank_and_never_below_the_collective_timeout(monkeypatch):
    from datetime import timedelta

    from megamu.runtime import parallel

    monkeypatch.setattr(parallel, "_collective_timeout", None)
    gb = 47_500_000_000  # a 30B-A3B checkpoint's ~380 GB over 8 ranks
    assert parallel.save_timeout(gb) == timedelta(minutes=10) + timedelta(seconds=gb / 50e6)  # 10 + 15.8 min
    monkeypatch.setattr(parallel, "_collective_timeout", timedelta(hours=2))
    assert parallel.save_timeout(gb) == timedelta(hours=2)


def test_the_short_timeout_really_applies_to_plain_barriers(tmp_path):
    with pytest.raises(AssertionError, match="failed") as failure:  # the control: same wait through the default group
        run_torchrun(WAIT_WORKER, 2, "barrier", str(tmp_path), timeout=120)
    assert "rank 1 initialised" in str(failure.value) and "Timed out" in str(failure.value)


# llama: a dense model (EP groups, no all-to-all). qwen3_moe: megatron-core's own alltoall dispatcher (the GPU path's)
# through tests/cpu_cuda_shim.py, so rank 0's padding passes must meet rank 1's real ones in every all-to-all: without
# the padding (megamu before parallel.ep_agreed_count) rank 0 leaves for the gradient all-reduce while rank 1 waits in
# layer 0's dispatch, and gloo's 90 s timeout fails the run.
@pytest.mark.parametrize("family,dispatcher", [("llama", ""), ("qwen3_moe", "alltoall")])
def test_expert_parallel_ranks_run_the_same_number_of_micro_batches(tmp_path, family, dispatcher):
    """Every MoE layer's forward and backward is a collective over the expert-parallel group: megatron-core 0.16.1's
    MoEAlltoAllTokenDispatcher exchanges tokens with ``all_to_all(self.ep_group, ...)`` in ``token_dispatch`` and
    back in ``token_combine`` (transformer/moe/token_dispatcher.py:666 and :810), and autograd runs them again in the
    backward. EP ranks are different
    data-parallel ranks, so a rank whose share is all zero-advantage (skipped) or shorter must still enter as many
    passes as the others: padded with zero-weight passes that leave its gradient at exactly zero."""
    hf = tmp_path / "hf"
    save_tiny_model(hf, family, 0)  # written once here, read by both ranks
    out = tmp_path / "rows.json"
    run_torchrun(Path(__file__).parent / "workers" / "ep_agree_worker.py", 2, str(hf), str(out), dispatcher,
                 timeout=240)
    (train0, lp0, real0, grad0, experts0), (train1, lp1, real1, grad1, experts1) = json.loads(out.read_text())
    assert real0 == 0 and real1 > 0  # rank 0 had nothing to train, rank 1 had its share
    assert train0 == train1 == real1  # rank 0 entered rank 1's number of passes
    assert grad0 == 0.0 and grad1 > 0.0  # the padding passes are zero-weight
    if dispatcher:  # rank 0's experts served rank 1's tokens: their gradient came back through the all-to-all
        assert experts0 > 0.0 and experts1 > 0.0
    assert lp0 == lp1 == 2  # log-prob shares of 2 and 1 samples at micro-batch 1
