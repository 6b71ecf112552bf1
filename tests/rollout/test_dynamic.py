"""Issue #45, item 3: DAPO's dynamic sampling (a stage refilled with informative groups, a bound on the rounds, the
record) and overlong shaping in the rollout phase, on the tiny model's real generations. References: the rounds'
groups and the DAPO paper's formula (Eq. 13), by hand."""

from dataclasses import replace

import pytest
import torch

from megamu.algo.dapo import OverlongShaping
from megamu.engines.local import LocalEngine
from megamu.rollout.dataset import StageDataset
from megamu.rollout.dynamic import SAMPLING_DIR, ShortStageError, run_dynamic_rollout
from megamu.rollout.phase import generate_groups, run_rollout_phase
from tests.rollout.test_phase import SAMPLING, ParityScorer, make_prompts
from tests.tiny import build_char_tokenizer

N, G = 3, 4  # prompts per stage, samples per prompt


class ConstantScorer:
    """Every reply scores the same: every group's rewards are all equal (no learning signal)."""

    def score(self, responses, truths):
        return [1.0] * len(responses)


def rounds_of(prompts):
    """Round r: prompts r*N .. r*N+N-1 of the problem list, ids r*N + j (as Prompts.for_sampling_round numbers them)."""
    return lambda r: [replace(p, prompt_id=r * N + j) for j, p in enumerate(prompts[(r * N) % 6:(r * N) % 6 + N])]


@pytest.fixture(scope="module")
def setup(tiny_llama):
    tok = build_char_tokenizer()
    return LocalEngine(tiny_llama), tok, make_prompts(tok)


def test_a_rollout_whose_groups_are_all_equal_stops_at_the_bound_as_verl_does(setup, tmp_path):
    """verl-recipe dapo/dapo_ray_trainer.py:280-286 (48ea0a7), ``fit``: num_gen_batches >= max_num_gen_batches > 0
    raises ValueError."""
    engine, tok, prompts = setup
    with pytest.raises(ShortStageError, match="found 0 of 3 groups with unequal seq_reward in 3 generation rounds"):
        run_dynamic_rollout(engine, rounds_of(prompts), tmp_path / "stage", max_rounds=3, n_samples=G, stage=0,
                            groups_per_shard=2, sampling=SAMPLING, scorer=ConstantScorer(), tokenizer=tok)
    assert not (tmp_path / "stage" / "manifest.json").exists()
    assert sorted(p.name for p in (tmp_path / "stage" / SAMPLING_DIR).iterdir()) == ["round_0", "round_1", "round_2"]


def test_fill_short_stage_keeps_megamus_fill_and_says_so(setup, tmp_path):
    engine, tok, prompts = setup
    m = run_dynamic_rollout(engine, rounds_of(prompts), tmp_path / "stage", max_rounds=3, n_samples=G, stage=0,
                            groups_per_shard=2, sampling=SAMPLING, scorer=ConstantScorer(), tokenizer=tok, fill=True)
    assert m.extra["dynamic_sampling"] == {"rounds": 3, "generated_groups": 9, "dropped_groups": 9,
                                           "filled_groups": 3}
    ds = StageDataset(tmp_path / "stage")
    assert ds.num_groups == N and [g[0].prompt_id for g in ds.groups()] == [0, 1, 2]
    assert all(s.advantage == 0.0 for s in ds.samples())  # the filling groups change no update
    assert not (tmp_path / "stage" / SAMPLING_DIR).exists()  # the rounds are gone once the stage is durable


def test_the_stage_keeps_the_rounds_informative_groups_in_order(setup, tmp_path):
    engine, tok, prompts = setup
    make = rounds_of(prompts)
    m = run_dynamic_rollout(engine, make, tmp_path / "stage", max_rounds=10, n_samples=G, stage=0, groups_per_shard=2,
                            sampling=SAMPLING, scorer=ParityScorer(), tokenizer=tok)
    record = m.extra["dynamic_sampling"]
    # the same rounds generated one by one (the engine draws from the seeds alone): their informative groups
    expected = []
    for r in range(record["rounds"]):
        groups = generate_groups(engine, make(r), replace(SAMPLING, n=G), G, ParityScorer(), tok)
        expected += [g for g in groups if len({s.reward for s in g}) > 1]
    assert record["filled_groups"] == 0 and len(expected) >= N
    assert record["dropped_groups"] == record["generated_groups"] - len(expected)
    got = StageDataset(tmp_path / "stage").groups()
    key = lambda g: [(s.prompt_ids, s.response_ids, s.reward) for s in g]
    assert [key(g) for g in got] == [key(g) for g in expected[:N]]
    assert [g[0].prompt_id for g in got] == list(range(N))
    assert m.reward_mean == pytest.approx(sum(s.reward for g in got for s in g) / (N * G))


def test_overlong_shaping_adds_dapos_penalty_before_the_advantages(setup, tmp_path):
    engine, tok, prompts = setup
    shaping = OverlongShaping(max_len=SAMPLING.max_new_tokens, buffer=4, factor=0.5)  # punished past 8 tokens
    m = run_rollout_phase(engine, prompts[:N], tmp_path / "stage", sampling=SAMPLING, n_samples=G,
                          scorer=ConstantScorer(), tokenizer=tok, stage=0, overlong=shaping)
    samples = StageDataset(tmp_path / "stage").samples()
    lengths = [s.response_length for s in samples]
    assert min(lengths) <= 8 < max(lengths)  # both sides of the buffer's start
    for s in samples:  # Eq. 13 by hand: 1 + 0.5 * (12 - 4 - |y|) / 4 inside the buffer
        assert s.reward == pytest.approx(1.0 + (0.5 * (8 - s.response_length) / 4 if s.response_length > 8 else 0.0))
    for g in StageDataset(tmp_path / "stage").groups():  # Eq. 1 on the shaped rewards
        r = torch.tensor([s.reward for s in g], dtype=torch.float64)
        want = torch.zeros(G) if r.std() == 0 else (r - r.mean()) / (r.std() + 1e-6)
        torch.testing.assert_close(torch.tensor([s.advantage for s in g], dtype=torch.float64), want.double(),
                                   atol=1e-5, rtol=0)
    assert m.extra["overlong_fraction"] == pytest.approx(sum(n > 8 for n in lengths) / len(lengths))


def test_rounds_larger_than_the_stage_keep_its_first_informative_groups_and_zero_rounds_means_no_limit(setup,
                                                                                                       tmp_path):
    """verl's data.gen_batch_size > train_batch_size: each round generates more prompts than the stage trains on; the
    stage keeps the first B_train groups with unequal rewards (``batch[:traj_bsz]``, dapo_ray_trainer.py:294 at
    48ea0a7). max_num_gen_batches 0: no bound (:280; here the stage fills in the first round)."""
    engine, tok, prompts = setup
    per_round = 6  # all six problems in one round, B_train = N = 3
    make = lambda r: [replace(p, prompt_id=r * per_round + j) for j, p in enumerate(prompts[:per_round])]
    m = run_dynamic_rollout(engine, make, tmp_path / "stage", max_rounds=0, n_samples=G, stage=0, target=N,
                            groups_per_shard=2, sampling=SAMPLING, scorer=ParityScorer(), tokenizer=tok)
    groups = generate_groups(engine, make(0), replace(SAMPLING, n=G), G, ParityScorer(), tok)
    informative = [g for g in groups if len({s.reward for s in g}) > 1]
    assert len(informative) >= N  # so one round is enough
    record = m.extra["dynamic_sampling"]
    assert (record["rounds"], record["generated_groups"], record["filled_groups"]) == (1, per_round, 0)
    key = lambda g: [(s.prompt_ids, s.response_ids, s.reward) for s in g]
    assert [key(g) for g in StageDataset(tmp_path / "stage").groups()] == [key(g) for g in informative[:N]]


def test_a_sampling_round_larger_than_the_stage_begins_with_the_stages_own_prompts(tmp_path):
    """Prompts.for_sampling_round(stage, r, per_round): round 0 = the stage's B_train prompts then per_round - B_train
    more, ids 0..per_round-1; round r = per_round drawn prompts, ids r·per_round + j; per_round = B_train: as before."""
    from megamu.data.stage_prompts import Prompts, PromptsConfig

    prompts = Prompts(PromptsConfig(prompts_per_stage=3, seed=1, data_dir=tmp_path, builtin_rows=40, held_out=0,
                                    chat_template=False), build_char_tokenizer())
    own = prompts.for_stage(2)
    first = prompts.for_sampling_round(2, 0, 5)
    assert first[:3] == own and [p.prompt_id for p in first] == [0, 1, 2, 3, 4]
    assert [p.prompt_id for p in prompts.for_sampling_round(2, 2, 5)] == [10, 11, 12, 13, 14]
    assert prompts.for_sampling_round(2, 0) == own and prompts.for_sampling_round(2, 0, 3) == own
    assert [p.prompt_id for p in prompts.for_sampling_round(2, 1)] == [3, 4, 5]
    with pytest.raises(ValueError, match="smaller than the stage's 3"):
        prompts.for_sampling_round(2, 0, 2)
