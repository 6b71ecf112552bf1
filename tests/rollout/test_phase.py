import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamu.data import load_prompts
from megamu.data.arithmetic import addition_problems
from megamu.engines.local import LocalEngine
from megamu.engines.types import EngineBase, SamplingParams
from megamu.rollout.dataset import MANIFEST, StageDataset, StageDatasetError
from megamu.rollout.phase import generate_groups, run_rollout_phase
from megamu.runtime.faults import CRASH_ENV
from tests.tiny import build_char_tokenizer

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, seed=123)
REPO = Path(__file__).resolve().parents[2]


def make_prompts(tok, instruction="", few_shot=()):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "add.jsonl"
        f.write_text("\n".join(json.dumps(r) for r in addition_problems(7, seed=1)))
        return load_prompts([str(f)], tok, instruction=instruction, few_shot=few_shot)


class ParityScorer:
    def score(self, responses, truths):
        return [float(len(r) % 2 == 0) for r in responses]


class ExplodingEngine(EngineBase):
    def generate(self, requests):
        raise AssertionError("a finished stage must not generate again")


def _assert_same_groups(a, b):
    """Identical tokens, rewards and metadata; log-probs and advantages equal up to float noise of batch shapes."""
    key = lambda s: (s.prompt_id, s.sample_index, s.prompt_ids, s.response_ids, s.reward, s.finish_reason, s.stage,
                     s.policy_version)
    assert [[key(s) for s in g] for g in a] == [[key(s) for s in g] for g in b]
    flat = lambda gs, f: torch.tensor([x for g in gs for s in g for x in f(s)])
    torch.testing.assert_close(flat(a, lambda s: s.behaviour_logprobs), flat(b, lambda s: s.behaviour_logprobs),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(flat(a, lambda s: [s.advantage]), flat(b, lambda s: [s.advantage]), atol=1e-6, rtol=0)


def test_generate_groups_rewards_and_advantages(tiny_llama):
    tok = build_char_tokenizer()
    prompts = make_prompts(tok)
    groups = generate_groups(LocalEngine(tiny_llama), prompts, SAMPLING, 5, ParityScorer(), tok, stage=1,
                             policy_version=3)
    assert [g[0].prompt_id for g in groups] == [p.prompt_id for p in prompts]
    for p, g in zip(prompts, groups):
        assert [s.sample_index for s in g] == list(range(5))
        rewards = torch.tensor([s.reward for s in g])
        for s in g:
            text = tok.decode(s.response_ids, skip_special_tokens=True)
            assert s.reward == float(len(text) % 2 == 0)
            assert s.prompt_ids == p.prompt_ids and (s.stage, s.policy_version) == (1, 3)
        # Eq. 1 by hand: (r - mean) / (sample std + eps), 0 for a group with equal rewards.
        std = rewards.std()
        expected = torch.zeros(5) if std == 0 else (rewards - rewards.mean()) / (std + 1e-6)
        torch.testing.assert_close(torch.tensor([s.advantage for s in g]), expected, atol=1e-5, rtol=0)
    assert len({s.reward for g in groups for s in g}) == 2  # the test exercises both reward values


def test_killed_phase_resumes_to_the_uninterrupted_result(tiny_llama, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "tests.rollout.workers.rollout_phase", tiny_llama]
    killed = subprocess.run(cmd + [str(tmp_path / "resumed")], env=dict(env, **{CRASH_ENV: "shard:1"}),
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert killed.returncode == 17, killed.stderr[-2000:]
    written = sorted(p.name for p in (tmp_path / "resumed").iterdir())
    assert written == ["plan.json", "shard-00000.parquet", "shard-00001.parquet"]  # no manifest, no partial shard
    with pytest.raises(StageDatasetError, match="unfinished"):
        StageDataset(tmp_path / "resumed")
    rerun = subprocess.run(cmd + [str(tmp_path / "resumed")], env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resuming, 2/4 shards" in rerun.stdout

    # The uninterrupted run, in this process, with a different batch size and several shards per engine call.
    from megamu.data import DEMO_FEW_SHOT, DEMO_INSTRUCTION

    tok = build_char_tokenizer()
    prompts = make_prompts(tok, DEMO_INSTRUCTION, DEMO_FEW_SHOT)
    from megamu.reward import RewardScorer

    with RewardScorer("tests.rollout.rewards:parity", num_workers=1) as scorer:
        m = run_rollout_phase(LocalEngine(tiny_llama, max_batch_size=64), prompts, tmp_path / "full",
                              sampling=SAMPLING, n_samples=4, scorer=scorer, tokenizer=tok, stage=2, policy_version=7,
                              groups_per_shard=2, shards_per_call=3, model_path=tiny_llama)
    resumed, full = StageDataset(tmp_path / "resumed"), StageDataset(tmp_path / "full")
    assert resumed.num_groups == full.num_groups == 7 and m.num_shards == 4
    _assert_same_groups(resumed.groups(), full.groups())
    # Manifest statistics against the samples themselves.
    samples = full.samples()
    assert m.reward_mean == pytest.approx(sum(s.reward for s in samples) / len(samples))
    assert m.truncation_rate == pytest.approx(sum(s.finish_reason == "length" for s in samples) / len(samples))
    assert m.mean_response_length == pytest.approx(sum(s.response_length for s in samples) / len(samples))
    groups = full.groups()
    assert m.all_wrong_fraction == pytest.approx(sum(all(s.reward == 0 for s in g) for g in groups) / 7)
    assert m.all_correct_fraction == pytest.approx(sum(all(s.reward == 1 for s in g) for g in groups) / 7)
    assert (m.engine, m.model_path, m.sampling["seed"], m.stage) == ("local", tiny_llama, 123, 2)

    # A finished stage returns its manifest without generating; different settings are refused.
    again = run_rollout_phase(ExplodingEngine(), prompts, tmp_path / "full", sampling=SAMPLING, n_samples=4,
                              scorer=ParityScorer(), tokenizer=tok, stage=2, groups_per_shard=2)
    assert again == m
    (tmp_path / "resumed" / MANIFEST).unlink()
    with pytest.raises(RuntimeError, match="different settings.*sampling"):
        run_rollout_phase(ExplodingEngine(), prompts, tmp_path / "resumed", sampling=SamplingParams(seed=9),
                          n_samples=4, scorer=ParityScorer(), tokenizer=tok, stage=2, groups_per_shard=2)


class ShortLogprobEngine:
    """Drops the last log-prob of every sample, as a server that trimmed the stop token from one list would."""

    def __init__(self, inner):
        self.inner = inner

    def generate(self, requests):
        out = self.inner.generate(requests)
        for s in out:
            s.output_logprobs = s.output_logprobs[:-1]
        return out


def test_generate_groups_refuses_a_logprob_per_token_mismatch(tiny_llama):
    tok = build_char_tokenizer()
    with pytest.raises(RuntimeError, match="tokens but .* log-probs for prompt 0 sample 0"):
        generate_groups(ShortLogprobEngine(LocalEngine(tiny_llama)), make_prompts(tok)[:1], SAMPLING, 2,
                        ParityScorer(), tok)


class UnseededEngine(EngineBase):
    """The local engine, labelled as one that ignores seeds (SGLang without deterministic inference)."""

    name = "sglang"
    deterministic = False

    def __init__(self, inner):
        self.generate = inner.generate


def test_each_shard_records_its_engines_mode_and_a_resume_says_it(tiny_llama, tmp_path, capsys):
    from megamu.rollout.dataset import read_manifest, shard_mode

    tok = build_char_tokenizer()
    prompts = make_prompts(tok)
    kw = dict(sampling=SAMPLING, n_samples=2, scorer=ParityScorer(), tokenizer=tok, stage=0, groups_per_shard=2)
    local = LocalEngine(tiny_llama)
    m = run_rollout_phase(local, prompts, tmp_path, **kw)
    assert m.deterministic is True and [s.deterministic for s in m.shards] == [True] * 4
    (tmp_path / MANIFEST).unlink()
    (tmp_path / "shard-00003.parquet").unlink()
    capsys.readouterr()
    m = run_rollout_phase(UnseededEngine(local), prompts, tmp_path, **kw)
    said = capsys.readouterr().out
    assert "resuming, 3/4 shards" in said and "made deterministically (from seeds alone)" in said
    assert "missing shards are drawn non-deterministically (seeds ignored) (new samples" in said
    assert [s.deterministic for s in m.shards] == [True, True, True, False] and m.deterministic is False
    assert read_manifest(tmp_path).deterministic is False and shard_mode(tmp_path / "shard-00003.parquet") is False
