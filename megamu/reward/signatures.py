"""The reward functions users bring, called one way: megamu's ``fn(response, ground_truth)``, verl's
``compute_score(data_source, solution_str, ground_truth, extra_info)`` and slime's ``custom_rm(args, sample)`` (with
``--group-rm``: ``custom_rm(args, samples) -> list``).

The style is detected once from the parameter names, so a verl or slime function works unchanged instead of raising
TypeError on every call. verl passes ``data_source`` and ``extra_info`` from the row
(verl/utils/reward_score/__init__.py ``default_compute_score``; verl/workers/reward_manager/naive.py); slime passes
the run's arguments and its ``Sample`` (slime/utils/types.py: the rendered ``prompt``, ``response``, ``label``,
``metadata``, ``status`` ...) and may be ``async`` (slime/rollout/rm_hub ``async_rm``; ``batched_async_rm`` for
``--group-rm``). A returned dict gives its ``--reward-key`` entry (default ``"score"``, the key verl's reward managers
read; slime's ``--reward-key``).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from types import SimpleNamespace

STYLES = ("megamu", "verl", "slime")
DEFAULT_REWARD_KEY = "score"


@dataclass
class RowMeta:
    """What the reward gets about one sample besides its response and ground truth: its row's ``data_source`` and
    ``extra_info`` (verl), the problem text, and (set by the rollout phase, for slime's Sample) the prompt as the model
    read it, the reply's finish reason and its tokens."""

    data_source: str = ""
    extra_info: dict = field(default_factory=dict)
    prompt: str = ""  # the problem text
    rendered_prompt: str = ""  # the prompt as the model read it (chat template applied): slime's ``sample.prompt``
    finish_reason: str = ""  # "stop" | "length" | "abort" ("": unknown)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)


class SampleStatus(StrEnum):
    """slime's ``Sample.Status`` values (slime/utils/types.py); a str, so ``status == "truncated"`` holds too."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


STATUS_OF_FINISH = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


@dataclass
class Sample:
    """What slime's ``custom_rm`` reads from its ``Sample``, under slime's field names."""

    Status = SampleStatus  # ``sample.Status.TRUNCATED``, as with slime's class

    index: int
    prompt: str  # rendered (slime applies the chat template before generating)
    response: str
    label: str
    metadata: dict
    status: SampleStatus
    tokens: list[int]  # prompt + response token ids
    response_length: int
    reward: float | None = None


def slime_sample(index: int, response: str, truth: str, meta: RowMeta) -> Sample:
    return Sample(index=index, prompt=meta.rendered_prompt or meta.prompt, response=response, label=truth,
                  metadata={"data_source": meta.data_source, **meta.extra_info},
                  status=STATUS_OF_FINISH.get(meta.finish_reason, SampleStatus.COMPLETED),
                  tokens=[*meta.prompt_ids, *meta.response_ids], response_length=len(meta.response_ids))


@dataclass(frozen=True)
class CallOptions:
    """How the worker calls the function (JSON-serialisable: it reaches the worker on its command line).
    ``run_args``: slime's ``args``, the run's flags by name; ``group``: one call per prompt group (``--group-rm``);
    ``concurrency``: calls of an async function in flight per worker; ``warm_up``: one call on a dummy item before
    the worker reports ready (megamu's own scorers only: a user's function is never called outside a timeout)."""

    reward_key: str = DEFAULT_REWARD_KEY
    run_args: dict = field(default_factory=dict)
    group: bool = False
    concurrency: int = 1
    warm_up: bool = False


def _params(fn: Callable) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: megamu's convention
        return []


def reward_style(fn: Callable) -> str:
    """"verl" (a ``solution_str`` parameter), "slime" (``(args, sample[s], ...)``) or "megamu" (two positionals)."""
    params = _params(fn)
    if "solution_str" in params:
        return "verl"
    if params[:1] == ["args"] and params[1:2] in (["sample"], ["samples"]):
        return "slime"
    return "megamu"


def is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(getattr(fn, "func", fn))  # a functools.partial's function


Item = tuple[str, str, RowMeta]  # (response, ground truth, meta)


def adapt(fn: Callable, options: CallOptions = CallOptions()) -> Callable[[list[Item]], list]:
    """``fn`` as ``call(items) -> scores``, one score per item, in its detected style: one call per item, or with
    ``options.group`` one call for the items (a prompt group). For an async ``fn`` the result is a coroutine."""
    style = reward_style(fn)
    args = SimpleNamespace(**options.run_args)
    key = options.reward_key

    if options.group:
        if style != "slime":
            raise TypeError(f"--group-rm calls slime's custom_rm(args, samples) once per group; {fn!r} has the "
                            f"{style} signature")

        def group_call(items: list[Item]):
            samples = [slime_sample(i, *item) for i, item in enumerate(items)]
            return _finish(fn(args, samples), lambda values: _group_scores(values, len(items), key))
        return group_call

    if style == "verl":
        accepted = inspect.signature(fn).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())

        def one(index: int, response: str, truth: str, meta: RowMeta):
            kwargs = {"data_source": meta.data_source, "solution_str": response, "ground_truth": truth,
                      "extra_info": meta.extra_info}
            return fn(**{k: v for k, v in kwargs.items() if takes_all or k in accepted})
    elif style == "slime":
        def one(index: int, response: str, truth: str, meta: RowMeta):
            return fn(args, slime_sample(index, response, truth, meta))
    else:
        def one(index: int, response: str, truth: str, meta: RowMeta):
            return fn(response, truth)

    if is_async(fn):
        async def call_async(items: list[Item]) -> list[float]:
            return [_number(await one(i, *item), key) for i, item in enumerate(items)]
        return call_async

    def call(items: list[Item]) -> list[float]:
        return [_number(_resolve(one(i, *item)), key) for i, item in enumerate(items)]
    call.style = style  # type: ignore[attr-defined]
    return call


def _finish(value, convert):
    """``convert(value)``, awaiting ``value`` first when it is a coroutine (async functions)."""
    if inspect.isawaitable(value):
        async def finish():
            return convert(await value)
        return finish()
    return convert(value)


def _resolve(value):
    """A coroutine returned by a function not declared ``async`` (a wrapper): run to its result."""
    return asyncio.run(_await(value)) if inspect.isawaitable(value) else value


async def _await(value):
    return await value


def _group_scores(values, n: int, key: str) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise TypeError(f"--group-rm: the reward function must return one reward per sample of the group ({n}), "
                        f"got {values!r:.200}")
    return [_number(v, key) for v in values]


def _number(value, key: str = DEFAULT_REWARD_KEY) -> float:
    if isinstance(value, dict):
        if key not in value:
            raise TypeError(f"the reward function returned a dict without the key {key!r} (--reward-key): "
                            f"{sorted(value)}")
        value = value[key]
    return float(value)
