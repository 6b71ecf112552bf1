"""Cheap deterministic reward functions for rollout tests (imported by reward worker processes)."""


def parity(response: str, ground_truth: str) -> float:
    """1.0 when the response has an even number of characters: varied rewards without a real task."""
    return float(len(response) % 2 == 0)
