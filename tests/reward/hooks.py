"""Misbehaving reward functions for the pool tests (imported by the worker processes)."""

import os
import time


def hang_on_hang(response: str, ground_truth: str) -> float:
    if response == "hang":
        time.sleep(3600)
    return 1.0 if response == ground_truth else 0.0


def crash_on_crash(response: str, ground_truth: str) -> float:
    if response == "crash":
        os._exit(3)
    if response == "raise":
        raise ValueError("bad")
    return 1.0 if response == ground_truth else 0.0


def worker_pid(response: str, ground_truth: str) -> float:
    return float(os.getpid())


def verify_only(response: str, ground_truth: str) -> float:
    """math-verify alone, without math_score's exact-match shortcut."""
    from megamu.reward.math import extract_boxed, verify_answer

    return float(verify_answer(extract_boxed(response) or "", ground_truth))


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature (verl/utils/reward_score): the row's data_source and extra_info reach it; a dict result."""
    bonus = extra_info.get("bonus", 0.0) if extra_info else 0.0
    return {"score": float(solution_str == ground_truth) + bonus, "source": data_source}


async def custom_rm(args, sample):
    """slime's signature (a coroutine taking its run arguments and a Sample)."""
    return float(sample.response == sample.label) + len(sample.metadata.get("data_source", ""))


def always_raises(response: str, ground_truth: str) -> float:
    raise KeyError("answer_field")
