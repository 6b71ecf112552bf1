"""The tiny models' reward, under the name the tests pass as --reward-fn (megamu/reward/toy.py holds it)."""

from megamu.reward.toy import has_digit  # noqa: F401


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
