"""Packing, micro-batching and data-parallel shares, against hand-built expectations."""

import pytest
import torch

from megamu.records import RolloutSample
from megamu.training.batch import data_parallel_bounds, pack, split_micro_batches, unpack_response


def sample(pid, prompt, response, logps=None, adv=0.5):
    logps = logps if logps is not None else [-0.1 * (i + 1) for i in range(len(response))]
    return RolloutSample(pid, 0, prompt, response, logps, 1.0, adv, "stop")


def test_pack_aligns_response_with_shifted_logprob_frame():
    a = sample(0, [5, 6, 7], [8, 9], [-1.0, -2.0], adv=1.0)
    b = sample(1, [5, 6], [10, 11, 12], [-3.0, -4.0, -5.0], adv=-1.0)
    batch = pack([a, b])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, 11, 12]]
    # forward_logprobs column j scores input_ids[:, j+1]; the shortest prompt (2) puts the first response at column 1
    assert batch.first_column == 1
    # columns 1..3 of the [b, 4] frame: row a scores ids 7, 8, 9 (response = 8, 9); row b scores 10, 11, 12
    assert batch.response_mask.tolist() == [[False, True, True], [True, True, True]]
    assert batch.behaviour_logp.tolist() == [[0.0, -1.0, -2.0], [-3.0, -4.0, -5.0]]
    assert batch.advantages.tolist() == [1.0, -1.0]
    assert batch.n_tokens == 5 and batch.n_sequences == 2
    values = torch.arange(6, dtype=torch.float32).view(2, 3)
    assert unpack_response(values, batch) == [[1.0, 2.0], [3.0, 4.0, 5.0]]


def test_pack_rejects_mismatched_behaviour_logprobs():
    bad = sample(3, [1, 2], [4, 5], [-1.0])
    with pytest.raises(ValueError, match="prompt_id=3.*1 behaviour log-probs for 2 response tokens"):
        pack([bad])


def test_micro_batches_respect_size_and_token_budget():
    s = [sample(i, [1] * 2, [2] * n) for i, n in enumerate([2, 2, 6, 1, 1, 1])]  # lengths 4, 4, 8, 3, 3, 3
    assert [len(m) for m in split_micro_batches(s, 4)] == [4, 2]
    # budget 10 padded tokens: [4,4] -> 8; adding 8 -> 3*8=24 > 10; [8] alone (over nothing), [8,3] = 16 > 10 ...
    parts = split_micro_batches(s, 4, max_tokens_per_micro_batch=10)
    assert [[len(x.prompt_ids) + len(x.response_ids) for x in m] for m in parts] == [[4, 4], [8], [3, 3, 3]]
    # a single sample over the budget still gets its own micro-batch
    assert [len(m) for m in split_micro_batches(s, 4, max_tokens_per_micro_batch=2)] == [1] * 6
    assert sum(split_micro_batches(s, 3, 9), []) == s  # order kept, nothing lost


def test_data_parallel_bounds_follow_group_boundaries():
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    s = [sample(g, [1], [2]) for g in groups]
    assert data_parallel_bounds(s, 2) == [0, 6, 12]
    assert data_parallel_bounds(s, 4) == [0, 3, 6, 9, 12]
    uneven = [sample(g, [1], [2]) for g in [0, 0, 0, 0, 0, 1, 2]]  # boundaries at 5, 6
    assert data_parallel_bounds(uneven, 2) == [0, 5, 7]
    assert data_parallel_bounds(uneven, 3) == [0, 5, 6, 7]
    one_group = [sample(0, [1], [2]) for _ in range(5)]  # fewer groups than ranks: even sample split
    assert data_parallel_bounds(one_group, 2) == [0, 2, 5]
