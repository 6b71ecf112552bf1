"""The reward functions users bring, called one way: megamu's ``fn(response, ground_truth)``, verl's
``compute_score(data_source, solution_str, ground_truth, extra_info)`` and slime's ``custom_rm(args, sample)``.

The style is detected once from the parameter names, so a verl or slime function works unchanged instead of raising
TypeError on every call. verl passes ``data_source`` and ``extra_info`` from the row
(verl/utils/reward_score/__init__.py ``default_compute_score``; verl/workers/reward_manager/naive.py); slime passes
its ``Sample`` (``prompt``, ``response``, ``label``, ``metadata``) and may be ``async`` (slime/rollout/rm_hub). A
returned dict gives its ``"score"`` (verl's reward managers read that key).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

STYLES = ("megamu", "verl", "slime")


@dataclass
class RowMeta:
    """What a prompt row gives the reward besides its ground truth (verl's ``data_source`` and ``extra_info``)."""

    data_source: str = ""
    extra_info: dict = field(default_factory=dict)
    prompt: str = ""  # the problem text (slime's ``sample.prompt``)


def reward_style(fn: Callable) -> str:
    """"verl" (a ``solution_str`` parameter), "slime" (``(args, sample, ...)``) or "megamu" (two positionals)."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: megamu's convention
        return "megamu"
    if "solution_str" in params:
        return "verl"
    if params[:2] == ["args", "sample"]:
        return "slime"
    return "megamu"


def adapt(fn: Callable) -> Callable[[str, str, RowMeta], float]:
    """``fn`` as ``call(response, ground_truth, meta) -> float`` in its detected style."""
    style = reward_style(fn)
    if style == "verl":
        accepted = inspect.signature(fn).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())

        def call(response: str, truth: str, meta: RowMeta) -> float:
            kwargs = {"data_source": meta.data_source, "solution_str": response, "ground_truth": truth,
                      "extra_info": meta.extra_info}
            return _number(fn(**{k: v for k, v in kwargs.items() if takes_all or k in accepted}))
    elif style == "slime":
        args = SimpleNamespace()  # slime's run arguments have no counterpart here; a function reading them fails loudly

        def call(response: str, truth: str, meta: RowMeta) -> float:
            sample = SimpleNamespace(prompt=meta.prompt, response=response, label=truth,
                                     metadata={"data_source": meta.data_source, **meta.extra_info})
            return _number(fn(args, sample))
    else:
        def call(response: str, truth: str, meta: RowMeta) -> float:
            return _number(fn(response, truth))
    call.style = style  # type: ignore[attr-defined]
    return call


def _number(value) -> float:
    if inspect.isawaitable(value):  # slime's reward functions are coroutines
        value = asyncio.run(_await(value))
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"the reward function returned a dict without a 'score' key: {sorted(value)}")
        value = value["score"]
    return float(value)


async def _await(value):
    return await value
