"""slime's ``--sglang-<name>`` flags reach megamu's SGLang servers as SGLang's own ``--<name>`` (issue 49 item 4).

slime adds SGLang's ServerArgs under the prefix ``--sglang-`` (slime @624b824
``slime/backends/sglang_utils/arguments.py:41-121``) and passes each to its servers; its launch scripts give e.g.
``--sglang-cuda-graph-bs 1 2 4 8`` (``scripts/run-qwen3-30B-A3B.sh``). megamu keeps no list of SGLang's flags: the
server command line (``launch.server_command``, what megamu runs) is checked here, and SGLang's refusal of a flag it
does not know is checked against the real server in tests/sglang_real/test_real_sglang_flags.py (make test-sglang).
"""

import pytest

from megamu.arguments import parse_args
from megamu.arguments.sglang_flags import split_sglang_flags
from megamu.engines.sglang.launch import server_command
from tests.arguments.test_model_and_slime_flags import refused, run
from tests.config_flags import config_flags


def _server_args(tmp_path, *flags) -> list[str]:
    """The words after megamu's own flags on a server's command line, for a dry run of Qwen3-4B with ``flags``."""
    cmd = server_command(run(tmp_path, "Qwen3-4B", *flags).engine.sglang, "model", 30000, 0, "key")
    return cmd[cmd.index("--api-key") + 2:]


def test_a_slime_sglang_flag_lands_as_sglangs_flag_on_the_server_command_line(tmp_path):
    args = _server_args(tmp_path, "--sglang-cuda-graph-bs", "1", "2", "4", "--lr", "1e-6",
                        "--sglang-enable-torch-compile", "--sglang-chunked-prefill-size=4096")
    assert args == ["--cuda-graph-bs", "1", "2", "4", "--enable-torch-compile", "--chunked-prefill-size=4096"]


def test_megamus_own_sglang_flags_keep_their_meaning(tmp_path):
    cfg = run(tmp_path, "Qwen3-4B", "--sglang-tp-size", "2", "--sglang-mem-fraction-static", "0.7",
              "--sglang-cuda-graph-bs", "8").engine.sglang
    assert cfg.tp_size == 2  # megamu's flag: the servers' --tp-size, not a forwarded word
    cmd = server_command(cfg, "model", 30000, 0, "key")
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd.count("--tp-size") == 1
    assert cfg.extra_server_args == ["--cuda-graph-bs", "8", "--mem-fraction-static", "0.7"]


def test_a_forwarded_flag_survives_the_config_written_back_as_flags(tmp_path):
    first = run(tmp_path, "Qwen3-4B", "--sglang-cuda-graph-bs", "1", "2")
    assert parse_args(config_flags(first), device=first.device) == first


@pytest.mark.parametrize("flags, message", [
    (["--sglang-port", "31000"], "--sglang-port: megamu sets the servers' --port itself"),
    (["--sglang-dtype", "bfloat16"], "--sglang-dtype: megamu sets the servers' --dtype itself"),
    (["--sglang-cuda-graph-bs", "1", "--sglang-server-args", "--cuda-graph-bs 4"],
     "--sglang-cuda-graph-bs: contradicts --sglang-server-args' --cuda-graph-bs"),
    (["--no-such-flag", "3"], "unrecognized arguments: --no-such-flag 3"),
])
def test_what_megamu_cannot_forward_is_refused_by_name(tmp_path, capsys, flags, message):
    refused(tmp_path, "Qwen3-4B", *flags)
    assert message in capsys.readouterr().err


def test_the_split_takes_each_flags_values_up_to_the_next_flag():
    assert split_sglang_flags(["--sglang-a", "1", "-2", "--x", "5", "--sglang-b=3", "7"]) == (
        ["--a", "1", "-2", "--b=3"], ["--x", "5", "7"])
