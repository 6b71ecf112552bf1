"""Rewards the tiny random models of tests.tiny can earn, for tests, benches and tools/gpu_check.py (as
``--reward-fn tests.e2e.rewards:has_digit``, run from the checkout): their char-level outputs contain digits at random,
so groups get mixed rewards and every algorithm preset sees non-zero advantages (math answers would score 0 for every
sample)."""


def has_digit(response: str, ground_truth: str) -> float:
    return float(any(c.isdigit() for c in response))


def slow_has_digit(response: str, ground_truth: str) -> float:
    """has_digit, half a second per sample: rank 0 then waits for the engine far longer than a short collective
    timeout, as it does for hours at scale."""
    import time

    time.sleep(0.5)
    return has_digit(response, ground_truth)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """has_digit under verl's signature (verl/utils/reward_score/__init__.py default_compute_score's)."""
    return {"score": has_digit(solution_str, ground_truth)}


def compute_score_typo(data_source, solution_str, ground_truth, extra_info=None):
    """A verl user's function that fails on every call (a key their rows do not have)."""
    return float(extra_info["answer"] in solution_str)


async def custom_rm(args, sample):
    """slime's signature: the row's metadata column reaches the Sample (and a label it must see)."""
    assert sample.label.isdigit(), sample.label
    return sample.metadata["weight"]


def always_hangs(response: str, ground_truth: str) -> float:
    """A remote judge that never answers."""
    import time

    time.sleep(3600)
    return 0.0


def group_checks(args, samples):
    """slime's --group-rm custom_rm: one call per prompt group; 1.0 per sample when what slime would give it holds
    (a rollout group is the run's --n-samples-per-prompt samples, a held-out evaluation's one greedy reply;
    sample.prompt is the prompt as the model read it, after the chat template)."""
    assert len(samples) in (args.n_samples_per_prompt, 1), (len(samples), args.n_samples_per_prompt)
    for s in samples:
        assert s.prompt.startswith("<|im_start|>user\n") and s.prompt.endswith("<|im_start|>assistant\n"), s.prompt
        assert s.status in (s.Status.COMPLETED, s.Status.TRUNCATED) and len(s.tokens) > s.response_length
    return [1.0] * len(samples)
