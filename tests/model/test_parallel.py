import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os
    import pytest
    from megamu.runtime import parallel as P

    P.init_distributed(1, seed=3)
    P.init_distributed(1, seed=3)  # idempotent
    assert (P.tp_size(), P.tp_rank(), P.dp_size(), P.dp_rank(), P.is_main_rank()) == (1, 0, 1, 0, True)
    assert P.tp_group() is not None and P.dp_group() is not None
    P.barrier()
    assert "RANK" not in os.environ  # a world of one leaves the env of child processes alone
    with pytest.raises(RuntimeError, match="already initialised"):
        P.init_distributed(2)
    P.destroy_distributed()
    with pytest.raises(ValueError, match="world size 1 is not divisible by --tensor-model-parallel-size 2"):
        P.init_distributed(2)
    print("OK")
""")


def test_single_process_world_idempotent_and_errors():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
