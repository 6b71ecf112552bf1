"""A reward the tiny random models of tests.tiny can earn (benches, tests and dry runs): their char-level outputs
contain digits at random, so groups get mixed rewards and every algorithm preset sees non-zero advantages (math
answers would score 0 for every sample). Use it as ``--reward-fn megamu.reward.toy:has_digit``."""


def has_digit(response: str, ground_truth: str) -> float:
    return float(any(c.isdigit() for c in response))
