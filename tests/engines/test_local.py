import pytest
import torch
from transformers import AutoModelForCausalLM

from megamu.engines.local import LocalEngine, sample_tokens
from megamu.engines.types import GenerateRequest, SamplingParams


def _requests(sampling, lengths=(3, 11, 6, 17), prefix=()):
    # Different prompt lengths so left padding and position ids matter; a shared prefix (a system prompt, a few-shot
    # turn) is prefilled once and its cache copied, with the suffixes left-padded after it.
    return [GenerateRequest(100 + i, list(prefix) + [(7 * i + k) % 90 + 4 for k in range(n)], sampling)
            for i, n in enumerate(lengths)]


def _teacher_forced_logprobs(model, prompt, output, temperature):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(output)[:, None]).squeeze(1)


SHARED_PREFIX = (1, 30, 31, 32, 33, 34, 35, 36, 37)  # the 1-token prompt below is all prefix but its last token


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
@pytest.mark.parametrize("prefix", [(), SHARED_PREFIX], ids=["distinct", "shared-prefix"])
def test_logprobs_equal_teacher_forced_recomputation(family, temperature, top_k, top_p, prefix, request):
    hf_dir = request.getfixturevalue(family)
    engine = LocalEngine(hf_dir, max_batch_size=5)  # 4 prompts x 3 samples: several batches, rows dropped mid-way
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=24, n=3, seed=5)
    reqs = _requests(sp, lengths=(3, 11, 6, 17) if not prefix else (1, 11, 6, 17), prefix=prefix)
    out = engine.generate(reqs)
    assert [(s.prompt_id, s.sample_index) for s in out] == [(r.prompt_id, j) for r in reqs for j in range(3)]
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for s in out:
        prompt = next(r.prompt_ids for r in reqs if r.prompt_id == s.prompt_id)
        assert len(s.output_ids) == len(s.output_logprobs) > 0
        expected = _teacher_forced_logprobs(ref, prompt, s.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(s.output_logprobs), expected, atol=1e-5, rtol=0)
        if top_k:  # top-k / top-p restrict the sampled token, not the log-prob's distribution
            with torch.no_grad():
                logits = ref(torch.tensor([prompt + s.output_ids])).logits[0, len(prompt) - 1 : -1]
            ranks = (logits > logits.gather(1, torch.tensor(s.output_ids)[:, None])).sum(-1)
            assert int(ranks.max()) < top_k


@pytest.mark.parametrize("prefix", [(), SHARED_PREFIX], ids=["distinct", "shared-prefix"])
def test_greedy_matches_hf_generate(tiny_llama, prefix):
    engine = LocalEngine(tiny_llama)
    reqs = _requests(SamplingParams(temperature=0.0, max_new_tokens=16), prefix=prefix)
    out = engine.generate(reqs)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for r, s in zip(reqs, out):
        ref = model.generate(torch.tensor([r.prompt_ids]), do_sample=False, max_new_tokens=16)[0, len(r.prompt_ids) :]
        assert s.output_ids == ref.tolist()[: len(s.output_ids)]
        assert s.finish_reason == ("stop" if s.output_ids[-1] == 2 else "length")


def test_seeded_samples_independent_of_batch_composition(tiny_llama):
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, n=4, seed=11)
    reqs = _requests(sp)
    full = {(s.prompt_id, s.sample_index): s.output_ids for s in LocalEngine(tiny_llama).generate(reqs)}
    small = LocalEngine(tiny_llama, max_batch_size=3)
    alone = {(s.prompt_id, s.sample_index): s.output_ids for s in small.generate([reqs[2]])}
    reordered = {(s.prompt_id, s.sample_index): s.output_ids for s in small.generate(reqs[::-1])}
    assert alone == {k: v for k, v in full.items() if k[0] == reqs[2].prompt_id}
    assert reordered == full
    assert len({tuple(v) for v in full.values()}) == len(full)  # samples of a group differ
    other = LocalEngine(tiny_llama).generate([GenerateRequest(reqs[2].prompt_id, reqs[2].prompt_ids,
                                                              SamplingParams(max_new_tokens=20, n=4, seed=12))])
    assert [s.output_ids for s in other] != list(alone.values())


def test_stop_ids_and_length_limit(tiny_llama):
    engine = LocalEngine(tiny_llama)
    free = engine.generate(_requests(SamplingParams(max_new_tokens=30, n=2, seed=1)))
    # Stop on the most frequent token of the free run: every sample must end at its first occurrence.
    counts = torch.bincount(torch.tensor([t for s in free for t in s.output_ids]))
    stop = int(counts.argmax())
    out = engine.generate(_requests(SamplingParams(max_new_tokens=30, n=2, seed=1, stop_token_ids=[stop])))
    assert any(s.finish_reason == "stop" for s in out)
    for f, s in zip(free, out):
        cut = next((i + 1 for i, t in enumerate(f.output_ids) if t in (stop, 2)), len(f.output_ids))
        assert s.output_ids == f.output_ids[:cut]  # same seed: same prefix, cut at the stop token
        assert s.finish_reason == ("stop" if s.output_ids[-1] in (stop, 2) else "length")
        assert s.finish_reason == "stop" or len(s.output_ids) == 30


def test_sampler_frequencies_match_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    n = 20000
    u = torch.rand(n)
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.7), (1.0, 1, 1.0)]:
        tokens, _ = sample_tokens(logits.expand(n, -1), torch.full((n,), temperature), torch.full((n,), top_k),
                                  torch.full((n,), top_p), u)
        probs = torch.softmax(logits[0] / temperature, -1)
        order = probs.argsort(descending=True)
        keep = torch.zeros(12, dtype=torch.bool)
        mass = 0.0
        for rank, t in enumerate(order.tolist()):  # reference filter, written independently
            if (top_k and rank >= top_k) or mass >= top_p:
                break
            keep[t] = True
            mass += float(probs[t])
        expected = torch.where(keep, probs, torch.zeros(())) / probs[keep].sum()
        freq = torch.bincount(tokens, minlength=12).float() / n
        assert float((freq - expected).abs().max()) < 0.015
        assert not bool(freq[~keep].any())


def test_update_weights_from_folder_and_state_dict(tiny_llama, tmp_path):
    from tests.tiny import save_tiny_model

    other = save_tiny_model(tmp_path / "other", "llama", seed=3)
    sp = SamplingParams(max_new_tokens=12, n=1, seed=2)
    reqs = _requests(sp)[:2]
    ref_model = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    for how in ("folder", "state_dict"):
        engine = LocalEngine(tiny_llama)
        if how == "folder":
            engine.update_weights(str(other))
        else:
            engine.update_weights(state_dict=ref_model.state_dict())
        for r, s in zip(reqs, engine.generate(reqs)):
            expected = _teacher_forced_logprobs(ref_model, r.prompt_ids, s.output_ids, 1.0)
            torch.testing.assert_close(torch.tensor(s.output_logprobs), expected, atol=1e-5, rtol=0)
    engine = LocalEngine(tiny_llama)
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights(state_dict={"model.norm.weight": torch.full((64,), 3.0)})
    assert not bool((engine.model.model.norm.weight == 3.0).any())  # nothing copied from a bad dict


def test_sampler_never_picks_a_removed_token_when_the_uniform_rounds_to_one():
    # torch.rand(float64) can round to exactly 1.0 in float32; u * total then equals the CDF's end.
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")]])
    one = torch.ones(1)
    for top_k, top_p, allowed in [(0, 1.0, {0, 1, 2, 3, 4}), (2, 1.0, {0, 1}), (0, 0.5, {0, 1})]:
        token, logp = sample_tokens(logits, one, torch.tensor([top_k]), torch.tensor([top_p]), one)
        assert int(token) in allowed
        assert float(logp) == pytest.approx(float(torch.log_softmax(logits, -1)[0, int(token)]))


def test_eos_ids_from_config_and_generation_config(tmp_path):
    import json

    from tests.tiny import save_tiny_model

    d = save_tiny_model(tmp_path / "m", "llama", seed=0)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps(dict(gen, eos_token_id=[3, 4])))
    assert LocalEngine(str(d)).eos_ids == {2, 3, 4}  # SGLang stops on both files' EOS ids too


def test_shared_prefix_length_leaves_every_prompt_a_token():
    from megamu.engines.local import shared_prefix_length

    assert shared_prefix_length([[1, 2, 3, 9], [1, 2, 4]]) == 2
    assert shared_prefix_length([[1, 2], [1, 2, 3]]) == 1  # the shorter prompt keeps its last token
    assert shared_prefix_length([[5, 6, 7]]) == 2
    assert shared_prefix_length([[1], [1, 4]]) == 0
    assert shared_prefix_length([[3, 1], [4, 1]]) == 0


def test_engines_loaded_in_threads_leave_torch_init_intact(tiny_llama):
    """transformers' from_pretrained replaces torch.nn.init's functions by no-ops while it loads and puts back what it
    found; engines loading in two threads at once (folder pushes answered by in-process servers) must not leave the
    no-ops in place (they did within 30 rounds here without the engine's load lock): every later random init would be
    uninitialised memory."""
    import threading

    import torch.nn.init as init

    real = (init.normal_, init.uniform_, init.kaiming_uniform_)
    for _ in range(30):
        threads = [threading.Thread(target=LocalEngine, args=(tiny_llama,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert (init.normal_, init.uniform_, init.kaiming_uniform_) == real
