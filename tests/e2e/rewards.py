"""The tiny models' reward, under the name the tests pass as --reward-fn (megamu/reward/toy.py holds it)."""

from megamu.reward.toy import has_digit  # noqa: F401


def slow_has_digit(response: str, ground_truth: str) -> float:
    """has_digit, half a second per sample: rank 0 then waits for the engine far longer than a short collective
    timeout, as it does for hours at scale."""
    import time

    time.sleep(0.5)
    return has_digit(response, ground_truth)
