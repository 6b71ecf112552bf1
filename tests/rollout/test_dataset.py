import pyarrow.parquet as pq
import pytest

from megamu.data.prompts import PromptRecord
from megamu.engines.types import EngineBase, GeneratedSample, SamplingParams
from megamu.rollout.dataset import MANIFEST, SCHEMA, StageDataset, StageDatasetError
from megamu.rollout.phase import run_rollout_phase
from tests.tiny import build_char_tokenizer


class FakeEngine(EngineBase):
    """Deterministic outputs that encode (prompt_id, sample_index), so every row can be checked."""

    name = "fake"

    def generate(self, requests):
        return [GeneratedSample(r.prompt_id, j, [10 + r.prompt_id % 50, 10 + j, 2], [-0.5, -0.25, -0.125],
                                "stop" if j % 3 else "length")
                for r in requests for j in range(r.sampling.n)]


@pytest.fixture
def stage(tmp_path):
    tok = build_char_tokenizer()
    prompts = [PromptRecord(i, [5, 6, 7 + i], str(i), f"p{i}") for i in range(10)]

    class Scorer:
        def score(self, responses, truths):
            # reward 1 for sample 0 of every prompt, and for every sample of prompt 4 (an all-correct group)
            first = [float(r == tok.decode([10 + int(t) % 50, 10])) for r, t in zip(responses, truths)]
            return [max(f, float(t == "4")) for f, t in zip(first, truths)]

    m = run_rollout_phase(FakeEngine(), prompts, tmp_path / "stage", sampling=SamplingParams(seed=1), n_samples=3,
                          scorer=Scorer(), tokenizer=tok, stage=0, groups_per_shard=4)
    return tmp_path / "stage", m


def test_layout_and_contents(stage):
    path, m = stage
    assert (m.num_groups, m.group_size, m.num_shards) == (10, 3, 3)
    assert [s.num_groups for s in m.shards] == [4, 4, 2]
    assert pq.read_schema(path / m.shards[0].file).remove_metadata() == SCHEMA
    ds = StageDataset(path)
    groups = ds.groups()
    assert [[(s.prompt_id, s.sample_index) for s in g] for g in groups] == [[(i, j) for j in range(3)]
                                                                            for i in range(10)]
    s = groups[3][1]
    assert s.response_ids == [13, 11, 2] and s.behaviour_logprobs == [-0.5, -0.25, -0.125]
    assert s.finish_reason == "stop" and s.response_length == 3 and s.prompt_ids == [5, 6, 10]
    assert m.all_correct_fraction == pytest.approx(0.1) and m.truncation_rate == pytest.approx(1 / 3)
    assert m.all_wrong_fraction == pytest.approx(0.0)
    assert m.reward_mean == pytest.approx((10 + 2) / 30)


def test_corrupt_or_missing_shard_is_named(stage):
    path, m = stage
    shard = path / m.shards[1].file
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(StageDatasetError, match=f"{shard.name}: sha256"):
        StageDataset(path)
    shard.unlink()
    with pytest.raises(StageDatasetError, match=f"{shard.name}: shard listed in the manifest is missing"):
        StageDataset(path)
    (path / MANIFEST).unlink()
    with pytest.raises(StageDatasetError, match="unfinished"):
        StageDataset(path)


def test_minibatches_shuffle_chain_epochs_and_resume(stage):
    ds = StageDataset(stage[0])
    epoch = [[s.prompt_id for s in b][::3] for b in ds.minibatches(2, seed=7)]
    assert len(epoch) == 5 and sorted(p for b in epoch for p in b) == list(range(10))
    assert epoch != [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # shuffled
    assert epoch == [[s.prompt_id for s in b][::3] for b in ds.minibatches(2, seed=7)]  # seeded
    assert epoch != [[s.prompt_id for s in b][::3] for b in ds.minibatches(2, seed=8)]
    # Every minibatch holds complete groups.
    assert all(len(b) == 6 and [s.sample_index for s in b] == [0, 1, 2] * 2 for b in ds.minibatches(2, seed=7))
    # More updates than one epoch: epochs chain, each a full permutation; resuming at update 4 gives the tail.
    long = [[s.prompt_id for s in b][::3] for b in ds.minibatches(4, seed=3, num_updates=5)]
    stream = [p for b in long for p in b]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert long[:5] == [[s.prompt_id for s in b][::3] for b in ds.minibatches(4, seed=3, num_updates=5)]
    tail = [[s.prompt_id for s in b][::3] for b in ds.minibatches(4, seed=3, start_update=3, num_updates=5)]
    assert tail == long[3:]
    with pytest.raises(ValueError, match="groups_per_update"):
        next(ds.minibatches(11, seed=0))


def test_inspect_rollouts_prints_summary_and_samples(stage, capsys):
    from tests.tiny import save_tiny_model
    from tools.inspect_rollouts import main

    path, m = stage
    tok_dir = save_tiny_model(path.parent / "tok", "llama")
    main([str(path), "--tokenizer", str(tok_dir), "--num-samples", "2"])
    out = capsys.readouterr().out
    assert "10 groups x 3 samples in 3 shards | engine fake" in out
    assert f"reward mean {12 / 30:.4f}" in out and "all-correct groups 0.100" in out
    assert out.count("--- group") == 2 and "[response]" in out
