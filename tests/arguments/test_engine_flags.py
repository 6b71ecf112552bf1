"""The engine flags of issue 25 reach SGLangConfig: per-server concurrency and opt-in deterministic inference."""

import pytest

from megamu.arguments import build_parser, engine_config
from megamu.errors import ConfigError


def _engine(*flags):
    return engine_config(build_parser().parse_args(list(flags)))


def test_server_concurrency_and_deterministic_flags():
    default = _engine("--rollout-engine", "sglang", "--sglang-url", "http://h:1")
    assert default.sglang.server_concurrency is None and default.sglang.deterministic is False
    cfg = _engine("--rollout-engine", "sglang", "--sglang-url", "http://h:1", "--sglang-server-concurrency", "1024",
                  "--rollout-deterministic")
    assert cfg.sglang.server_concurrency == 1024 and cfg.sglang.deterministic is True
    with pytest.raises((ConfigError, SystemExit), match="server-concurrency"):
        _engine("--rollout-engine", "sglang", "--sglang-url", "http://h:1", "--sglang-server-concurrency", "0")
    with pytest.raises((ConfigError, SystemExit), match="only used with --rollout-engine sglang"):
        _engine("--sglang-server-concurrency", "64")
    assert _engine("--rollout-deterministic").kind == "local"  # the local engine always draws from seeds alone
