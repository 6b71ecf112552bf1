"""Device.import_megatron: on CPU megatron-core's fused kernels are left uncompiled (their torch.compile wrappers cost
the compiler stack's import for kernels the local spec never calls); on CUDA they keep megatron's torch.compile. On
both, megatron's optional wandb import is skipped and a later `import wandb` works. Each case runs in a fresh
interpreter: the pytest worker may have imported megatron-core already."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys, torch
compile_before = torch.compile
{setup}
import megatron.core.jit as jit
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
def f(x):
    return x
x, b = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
y1, y2 = torch.chunk(x + b, 2, -1)
print(json.dumps({{
    "fuser_is_compile": jit.jit_fuser is compile_before,
    "fuser_is_identity": jit.jit_fuser(f) is f,
    "dynamo": "torch._dynamo" in sys.modules,
    "compile_restored": torch.compile is compile_before,
    "wandb_imported": "wandb" in sys.modules,
    # called only uncompiled: a compiled call would run inductor's C++ build on this CPU
    "swiglu_matches": None if jit.jit_fuser is compile_before
                      else torch.equal(bias_swiglu(x, b), torch.nn.functional.silu(y1) * y2),
}}))
import wandb  # megamu.observability.tracking's own import, after megatron's: it must still work
print(wandb.__name__)
"""


def _probe(setup: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    *_, report, last = out.stdout.strip().splitlines()
    assert last == "wandb", out.stdout[-2000:]
    return json.loads(report)


def test_cpu_processes_import_megatron_without_compiling_its_fusions():
    got = _probe("from megamu.runtime import parallel\nparallel.init_distributed(1)")  # the first import
    assert got == {"fuser_is_compile": False, "fuser_is_identity": True, "dynamo": False, "compile_restored": True,
                   "wandb_imported": False, "swiglu_matches": True}


def test_cuda_keeps_megatrons_compiled_fusions():
    # The upstream fact the CPU choice works around: megatron-core 0.16.1 binds jit_fuser to torch.compile at import
    # (megatron/core/jit.py:21), and building its wrappers imports torch._dynamo. Only imports run: no CUDA needed.
    got = _probe("from megamu.runtime.device import Device\nDevice('cuda').import_megatron()")
    assert got["fuser_is_compile"] and got["dynamo"] and got["compile_restored"] and not got["wandb_imported"]
