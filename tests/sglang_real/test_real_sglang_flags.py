"""slime's ``--sglang-<name>`` flags as the real SGLang 0.5.23 server (CPU build) takes them (issue 49 item 4): a flag
SGLang knows is accepted on the command line megamu builds, one it does not know is refused by SGLang's own parser
(``sglang/srt/server_args.py`` ``prepare_server_args``: argparse, "unrecognized arguments"), and megamu stops with the
server's exit status and the log line naming the flag. Both go through megamu's real flag parser
(megamu.arguments.parse_args) and launcher; no list of SGLang's flags is kept by megamu."""

from dataclasses import replace
from pathlib import Path

import pytest

from megamu.engines.sglang.client import SGLangEngine, SGLangError
from tests.arguments.test_model_and_slime_flags import run
from tests.sglang_real.cpu_build import cpu_config
from tests.tiny import save_tiny_model
from tests.torchrun import server_ports


def _engine(tmp_path: Path, *flags: str) -> SGLangEngine:
    """A server for a tiny model launched with the CPU build's flags plus what ``flags`` forward."""
    forwarded = run(tmp_path, "Qwen3-4B", *flags).engine.sglang.extra_server_args
    model_dir = str(save_tiny_model(tmp_path / "model", "llama", seed=0))
    cfg = cpu_config(server_ports(), tmp_path / "logs", startup_timeout_s=300)
    return SGLangEngine(model_dir, replace(cfg, extra_server_args=[*cfg.extra_server_args, *forwarded]))


def test_an_sglang_flag_slime_passes_reaches_the_server(tmp_path):
    engine = _engine(tmp_path, "--sglang-max-prefill-tokens", "4096")
    try:
        with open(f"/proc/{engine.pids[0]}/cmdline", "rb") as f:
            cmd = [w.decode() for w in f.read().split(b"\0")]
        assert cmd[cmd.index("--max-prefill-tokens") + 1] == "4096"
    finally:
        engine.shutdown()


def test_a_flag_sglang_does_not_know_is_refused_by_sglang_naming_it(tmp_path):
    with pytest.raises(SGLangError) as e:
        _engine(tmp_path, "--sglang-no-such-server-flag", "3")
    assert "exited with code 2 during startup" in str(e.value)
    assert "unrecognized arguments: --no-such-server-flag 3" in str(e.value)
