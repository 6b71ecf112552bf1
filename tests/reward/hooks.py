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


def always_hangs(response: str, ground_truth: str) -> float:
    """A remote judge that never answers."""
    time.sleep(3600)
    return 1.0


def logs_calls(response: str, ground_truth: str) -> float:
    """Appends each call's response to the file $MEGAMU_TEST_CALLS (every call the worker makes, warm-ups included)."""
    with open(os.environ["MEGAMU_TEST_CALLS"], "a") as f:
        f.write(response + "\n")
    return 1.0


_in_flight = 0


async def peak_in_flight(args, sample):
    """slime's async signature: how many calls this worker had in flight at once, seen from inside one."""
    import asyncio

    global _in_flight
    _in_flight += 1
    await asyncio.sleep(0.5)
    peak = _in_flight
    await asyncio.sleep(0.5)  # every call is still in flight while the others read the count
    _in_flight -= 1
    return float(peak)


def custom_rm_reads_args_and_sample(args, sample):
    """slime's custom_rm reading its run arguments and the Sample's fields, as a hand-checkable number."""
    return (args.n_samples_per_prompt * 1000 + 100 * (sample.prompt == "<user>1+1=?<assistant>")
            + 10 * len(sample.tokens) + (sample.status == sample.Status.TRUNCATED)
            + 0.5 * (sample.status == "truncated")
            + 0.25 * (sample.response_length == 2) + 0.125 * (sample.metadata == {"data_source": "toy", "level": 3}))


def judge_dict(response: str, ground_truth: str) -> dict:
    """A judge returning several numbers (slime's --reward-key picks one)."""
    return {"acc": float(response == ground_truth), "score": -1.0}


def group_rank(args, samples):
    """slime's --group-rm signature: one call per prompt group, one reward per sample (here its rank by length)."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
    return [float(order.index(i)) for i in range(len(samples))]


def group_short(args, samples):
    return [1.0]
