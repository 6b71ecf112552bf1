"""A RunConfig written back as flags (``config_flags``): the command line that ``parse_args`` turns into the same
config, to check that the two ways of building a run agree (tests/config/test_config_tree.py). Generated from the same
field metadata as the parser: a flag-carrying field is written when its value is not what the flag gives by default;
the flags megamu.arguments writes out (the plan's counts, the mode, the algorithm, the data) are written from their
fields."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

from megamu.algo import AlgoConfig
from megamu.config.run_config import RunConfig
from megamu.config_fields import FlagSpec, flag_spec

# Fields whose flag is a string the parser converts (megamu.arguments.engine.engine_flags): written the same way.
_SPELLING: dict[str, Callable[[object], str]] = {
    "engine.sglang.urls": lambda urls: ",".join(urls),
    "engine.sglang.extra_server_args": lambda args: shlex.join(args),
    "engine.sglang.server_env": lambda env: " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()),
}


def config_flags(run: RunConfig) -> list[str]:
    """The flags that build ``run`` on its device (``parse_args(config_flags(run), device=run.device) == run``).
    A setting no flag can spell (a value the parser never produces, e.g. None where the flag needs a value) raises
    ValueError naming its dotted path; fields no flag sets (derived, e.g. the launch's world size) are not written."""
    plan, prompts = run.plan, run.prompts
    argv = ["--rollout-mode", plan.rollout_mode, "--algorithm", run.algo.name,
            "--prompts-per-update", str(plan.prompts_per_update)]
    argv += ["--train-iters", str(plan.train_iters)] if plan.mode.streams else \
        ["--num-stages", str(plan.num_stages), "--mu", str(plan.mu)]
    if prompts.files:
        argv += ["--prompt-data", ",".join(prompts.files)]
    if prompts.eval_sets:
        argv += ["--eval-prompt-data", *(word for pair in prompts.eval_sets for word in pair)]
    argv += ["--answer-key", prompts.answer_key]
    if run.recompute_behaviour_logprobs:
        argv += ["--behaviour-logprobs", "recompute"]
    preset = AlgoConfig.preset(run.algo.name)
    for path, spec, value, default in _carried(run, ""):
        if path.startswith("algo."):  # the algorithm's flags override its preset
            default = getattr(preset, path.removeprefix("algo."))
        if value != default and not (path in _SPELLING and not value):  # an empty list or dict: the flag's ""
            argv += _spelled(path, spec, value)
    return argv


def _carried(part: object, prefix: str) -> Iterator[tuple[str, FlagSpec, object, object]]:
    """(dotted path, flag, value, the flag's default) of every field below ``part`` that carries a flag."""
    for f in dataclasses.fields(part):
        value, path = getattr(part, f.name), prefix + f.name
        spec = flag_spec(type(part), f.name)
        if spec is not None:
            if "default" in spec.argparse:
                default = spec.argparse["default"]
            else:
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            yield path, spec, value, default
        elif dataclasses.is_dataclass(value):
            yield from _carried(value, path + ".")


def _spelled(path: str, spec: FlagSpec, value: object) -> list[str]:
    name, action = spec.names[0], spec.argparse.get("action")
    if action == "optional_bool":
        return [name if value else "--no-" + name.removeprefix("--")]
    if action == "store_true":
        if value is not True:
            raise ValueError(f"{path}: {value!r} has no spelling as {name} (a switch)")
        return [name]
    if value is None:
        raise ValueError(f"{path}: None has no spelling as {name} (it takes a value)")
    if path in _SPELLING:
        return [name, _SPELLING[path](value)]
    return [name, str(value) if isinstance(value, (str, Path)) else repr(value)]
