"""Packing, micro-batching and data-parallel shares, against hand-built expectations."""

import pytest
import torch

from megamu.rollout.records import RolloutSample
from megamu.training.batch import PAD_ID, data_parallel_bounds, pack, split_micro_batches, unpack_response


def sample(pid, prompt, response, logps=None, adv=0.5):
    logps = logps if logps is not None else [-0.1 * (i + 1) for i in range(len(response))]
    return RolloutSample(pid, 0, prompt, response, logps, 1.0, adv, "stop")


def test_pack_one_row_per_sample_scores_each_response_token_at_its_predecessor():
    a = sample(0, [5, 6, 7], [8, 9], [-1.0, -2.0], adv=1.0)
    b = sample(1, [5, 6], [10, 11, 12], [-3.0, -4.0, -5.0], adv=-1.0)
    batch = pack([a, b])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, 11, 12]]
    assert batch.attention_mask is None
    # row a (flat positions 0..4): 8 is predicted at 7 (position 2), 9 at 8 (3); row b (5..9): 10 at 6 (6), ...
    assert batch.targets.tolist() == [[8, 9, PAD_ID], [10, 11, 12]]
    assert batch.score_index[0, :2].tolist() == [2, 3] and batch.score_index[1].tolist() == [6, 7, 8]
    assert batch.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert batch.behaviour_logp.tolist() == [[-1.0, -2.0, 0.0], [-3.0, -4.0, -5.0]]
    assert batch.advantages.tolist() == [1.0, -1.0]
    assert batch.n_tokens == 5 and batch.n_sequences == 2
    values = torch.arange(6, dtype=torch.float32).view(2, 3)
    assert unpack_response(values, batch) == [[0.0, 1.0], [3.0, 4.0, 5.0]]


def test_pack_shared_prompt_row_and_mask():
    group = [sample(4, [5, 6, 7], [8, 9, 10]), sample(4, [5, 6, 7], [11]), sample(4, [5, 6, 7], [12, 13])]
    other = sample(9, [1, 2], [3, 4])
    batch = pack([*group, other], share_prompts=True)
    # row 0: prompt, then each response without its last token: 8 9 | (none) | 12; row 1: 1 2 | 3
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 12], [1, 2, 3, PAD_ID, PAD_ID, PAD_ID]]
    # first tokens at the prompt's last position (2, resp. 6 + 1); later ones at their predecessor
    assert batch.score_index[0].tolist() == [2, 3, 4] and batch.score_index[1, 0].tolist() == 2
    assert batch.score_index[2, :2].tolist() == [2, 5] and batch.score_index[3, :2].tolist() == [7, 8]
    assert batch.targets.tolist() == [[8, 9, 10], [11, 0, 0], [12, 13, 0], [3, 4, 0]]
    visible = (~batch.attention_mask[:, 0]).int().tolist()
    assert visible[0] == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],  # 8: the prompt and itself
        [1, 1, 1, 1, 1, 0],  # 9: the prompt, 8 and itself
        [1, 1, 1, 0, 0, 1],  # 12: the prompt and itself, not the other response
    ]
    assert visible[1][2] == [1, 1, 1, 0, 0, 0] and visible[1][4] == [0, 0, 0, 0, 1, 0]  # padding sees itself
    assert batch.n_sequences == 4 and batch.n_tokens == 8
    # a group whose prompts differ is not a group: same id, other tokens -> rows of its own
    assert pack([group[0], sample(4, [5, 6], [8])], share_prompts=True).input_ids.shape[0] == 2


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


def test_micro_batch_budget_counts_shared_rows():
    g = [sample(0, [1] * 6, [2] * 3) for _ in range(4)]  # one shared row: 6 + 4 * 2 = 14 tokens
    assert [len(m) for m in split_micro_batches(g, 8, max_tokens_per_micro_batch=14, share_prompts=True)] == [4]
    # rows of their own would be 4 x 9 = 36 tokens: two per micro-batch within 18
    assert [len(m) for m in split_micro_batches(g, 8, max_tokens_per_micro_batch=18)] == [2, 2]


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
