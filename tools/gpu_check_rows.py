"""tools/gpu_check.py's rows that compare megamu with an independent reference (issue 50 item 6). Each runs the
same code on the CPU (``cuda=False``, a tiny model in fp32) and on a GPU (bf16), and hands its numbers to a pure
verdict in tools/gpu_check_compare.py, which the CPU tests feed planted defects.

  logprobs   megatron-core's local spec (bf16, CUDA) against transformers' log-probs for the same weights (the
             weights rounded to bf16 on both sides, transformers in fp32), on a few layers of a real config
  te         the same weights on Transformer Engine's spec against the local spec (where TE imports)
  reshard    the torch_dist checkpoint the checkpoint row saved (on CUDA, TP 1) loaded at TP 2 in a CPU gloo world of
             2 (tools/gpu_check_reshard.py), its full tensors against the saving model's, bitwise
  ipc        tests/gpu/test_colocated_handoff.py (the CUDA IPC hand-off to a second process), run by pytest
  server     a tensor push (CUDA IPC) into a real SGLang server megamu launches on this GPU, judged by the
             log-prob probe before (must fail) and after (must pass) the push, where SGLang imports
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from tools.gpu_check_compare import PROBE_TOLERANCE, compare_bitwise, compare_logprobs, push_verdict, pytest_verdict
from tools.gpu_check_path import run_world

REPO = Path(__file__).resolve().parents[1]
REAL_CONFIG = REPO / "tests" / "fixtures" / "hf" / "Qwen3-4B" / "config.json"
REAL_LAYERS = 2  # a few layers of the real config: its widths, heads, vocab and norms, in ~1.2 GiB of bf16


def write_real_config_model(out: Path, layers: int = REAL_LAYERS, seed: int = 0) -> Path:
    """Qwen3-4B's config cut to ``layers`` layers, random weights (transformers' own init), saved as an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**{**json.loads(REAL_CONFIG.read_text()), "num_hidden_layers": layers})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return out


def _megamu_logprobs(hf_dir: Path, cuda: bool, transformer_impl: str, ids):
    import torch

    from megamu.convert import load_hf_into_model
    from megamu.model import ModelArch, build_model, forward_logprobs
    from megamu.runtime.device import Device

    arch = ModelArch.from_hf(hf_dir)
    model = build_model(arch, device=Device("cuda" if cuda else "cpu"), transformer_impl=transformer_impl, bf16=cuda)
    load_hf_into_model(model, arch, hf_dir)
    model.eval()
    with torch.no_grad():
        logp, _ = forward_logprobs(model, ids.to("cuda" if cuda else "cpu"))
    del model
    return logp.float().cpu(), arch.num_layers


def _reference(hf_dir: Path, cuda: bool, ids):
    """transformers' log-probs of ``ids`` in fp32 (weights as bf16 on a GPU run: what megamu computes with)."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16 if cuda else torch.float32).float()
    ref = ref.to("cuda" if cuda else "cpu").eval()
    with torch.no_grad():
        logits = ref(ids.to(ref.device)).logits[:, :-1].double()
    del ref
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None].to(logits.device)).squeeze(-1)
    return logp.cpu(), logits.abs().amax(-1).cpu()


def sample_ids(vocab: int, batch: int = 4, seq: int = 128, seed: int = 0):
    import torch

    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def logprobs_check(hf_dir: Path, cuda: bool, seq: int = 128) -> tuple[bool, str]:
    """megamu's local spec against transformers for the weights in ``hf_dir``."""
    from megamu.model import ModelArch

    ids = sample_ids(ModelArch.from_hf(hf_dir).vocab_size, seq=seq)
    ours, layers = _megamu_logprobs(hf_dir, cuda, "local", ids)
    ref, scale = _reference(hf_dir, cuda, ids)
    return compare_logprobs(ours, ref, scale, layers)


def te_check(hf_dir: Path, cuda: bool, seq: int = 128) -> tuple[bool | None, str]:
    """Transformer Engine's spec against the local spec, same weights (both bf16: twice the rounding of one)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None, "transformer_engine is not installed"
    if not cuda:
        return None, "Transformer Engine runs on CUDA only"
    from megamu.model import ModelArch

    ids = sample_ids(ModelArch.from_hf(hf_dir).vocab_size, seq=seq)
    local, layers = _megamu_logprobs(hf_dir, cuda, "local", ids)
    te, _ = _megamu_logprobs(hf_dir, cuda, "transformer_engine", ids)
    _, scale = _reference(hf_dir, cuda, ids)
    return compare_logprobs(te, local, scale, 2 * layers + 1)


def reshard_check(ckpt_dir: Path, hf_dir: Path, want: dict, out: Path) -> tuple[bool, str]:
    """The checkpoint in ``ckpt_dir`` loaded at TP 2 on the CPU (a gloo world of 2); ``want``: the saving model's
    full tensors (``megamu.convert.tp.full_state_dict``), compared in fp32 (bf16 -> fp32 is exact)."""
    import torch

    failed = run_world([str(REPO / "tools" / "gpu_check_reshard.py"), str(ckpt_dir), str(hf_dir), str(out)],
                       "the TP 2 load", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    if failed:
        return False, failed
    got = torch.load(out)
    ok, verdict = compare_bitwise({n: t.float().cpu() for n, t in want.items()}, got)
    return ok, f"saved at TP 1, loaded at TP 2: {verdict}"


def ipc_check(cuda: bool) -> tuple[bool | None, str]:
    """tests/gpu/test_colocated_handoff.py: a push's CUDA IPC payload read bitwise by another process, and a stopped
    server's memory given back."""
    if not cuda:
        return None, "needs a CUDA device (the test skips without one)"
    return _pytest(["tests/gpu/test_colocated_handoff.py"], expected=2)


def server_check(cuda: bool, root: Path) -> tuple[bool | None, str]:
    """A tensor push into a real SGLang server on this GPU (megamu launches it), judged by the log-prob probe: the
    probe of the new weights must fail before the push (it tells the weights apart) and pass after it."""
    if importlib.util.find_spec("sglang") is None:
        return None, "SGLang is not installed"
    if not cuda:
        return None, "the GPU server push needs CUDA (make test-sglang runs the CPU build)"
    import torch
    from transformers import AutoModelForCausalLM

    from megamu.engines.sglang.client import SGLangEngine
    from megamu.engines.sglang.launch import SGLangConfig
    from megamu.engines.sglang.tensor_sync import send_tensors
    from megamu.engines.sglang.weight_sync import WeightMismatch, check_probe
    from megamu.engines.weights import LogprobProbe
    from tests.ports import server_ports
    from tests.tiny import save_tiny_model

    base, new = save_tiny_model(root / "base", "llama", seed=0), save_tiny_model(root / "new", "llama", seed=13)
    model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).eval()
    ids = [5, 9, 14, 20, 33, 41, 50, 61]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
    probe = LogprobProbe(ids, want, tolerance=PROBE_TOLERANCE)
    config = SGLangConfig(port_base=server_ports(), log_dir=str(root / "sglang-logs"), dtype="float32",
                          extra_server_args=["--mem-fraction-static", "0.3"], startup_timeout_s=300,
                          ).placed(colocated=True)  # one server, in-memory pushes, no memory saver (no trainer here)
    engine = SGLangEngine(str(base), config)
    try:
        def probed() -> float:  # megamu's probe, its mean |served - reference| whether or not it is within tolerance
            served = engine.teacher_forced_logprobs(ids)
            return sum(abs(a - b) for a, b in zip(served, want)) / len(want) if len(served) == len(want) else math.inf

        before = probed()
        sent = send_tensors(engine.pool, {k: v.cuda() for k, v in model.state_dict().items()}, "1")
        after = probed()
        try:
            check_probe(engine, probe)  # what a colocated refresh runs after its push
        except WeightMismatch:
            after = max(after, PROBE_TOLERANCE * 2)
    finally:
        engine.shutdown()
    ok, verdict = push_verdict(before, after, PROBE_TOLERANCE)
    return ok, f"{verdict}; {sent / 2**20:.1f} MiB pushed"


def _pytest(args: list[str], expected: int, env: dict | None = None) -> tuple[bool | None, str]:
    full = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=300, env=full)
    except subprocess.TimeoutExpired:
        return False, "pytest did not finish in 300 s"
    return pytest_verdict(proc.returncode, proc.stdout + proc.stderr, expected)
