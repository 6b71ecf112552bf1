"""GPU twins of the colocated hand-off's CPU tests: a tensor push's CUDA IPC payload is readable, bitwise, by another
process (as an SGLang server on the same GPU reads it), and a server whose child outlives its leader has given its
device memory back when the stop returns.

Skipped where there is no CUDA device: a skip here is not a pass, and CI (CPU only) never runs it. Only torch is
needed (no SGLang): the reader below maps the device UUID as SGLang 0.5.23's receiver does.
"""

import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

READER = """
import base64, pickle, sys, torch
import torch.multiprocessing.reductions as r
original = r.rebuild_cuda_tensor
def by_uuid(*args):  # the payload names its GPU by UUID; map it to this process's index
    uuids = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    return original(*args[:6], uuids[args[6]], *args[7:])
r.rebuild_cuda_tensor = by_uuid
obj = pickle.loads(base64.b64decode(open(sys.argv[1]).read()))
m = obj["metadata"][0]
t = obj["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).view(m.shape)
print(float(t.double().sum()), t.device.type)
"""


def test_tensor_payload_crosses_processes_by_cuda_ipc(tmp_path):
    from megamu.engines.sglang.tensor_sync import serialize_bucket

    weight = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    payload, keep = serialize_bucket([("w", weight)])
    (tmp_path / "p.b64").write_text(payload)
    out = subprocess.run([sys.executable, "-c", READER, str(tmp_path / "p.b64")], capture_output=True, text=True,
                         timeout=120)
    del keep
    assert out.returncode == 0, out.stderr[-3000:]
    total, device = out.stdout.split()
    assert device == "cuda" and float(total) == pytest.approx(float(weight.double().sum()), abs=0.0)


HOLDER = """
import os, signal, subprocess, sys, time
child = ("import signal, sys, time, torch\\n"
         "x = torch.empty(2**30, dtype=torch.uint8, device='cuda')\\n"
         "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2), sys.exit(0)))\\n"
         "print('ready', flush=True)\\ntime.sleep(600)")
p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
p.stdout.readline()
print('ready', flush=True)
time.sleep(600)
"""


def test_a_stopped_server_group_has_given_its_memory_back():
    from megamu.engines.sglang.launch import stop_processes

    free_before, _ = torch.cuda.mem_get_info()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    held, _ = torch.cuda.mem_get_info()
    assert free_before - held >= 2**30  # the child holds its GiB
    stop_processes([proc], grace_s=30)
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after >= free_before - 64 * 2**20  # back, give or take the driver's own bookkeeping
