"""tools/gpu_check.py's rows that compare megamu with an independent reference (issue 50 item 6). Each runs the
same code on the CPU (``cuda=False``, a tiny model in fp32) and on a GPU (bf16), and hands its numbers to a pure
verdict in tools/gpu_check_compare.py, which the CPU tests feed planted defects.

  logprobs   megatron-core's local spec (bf16, CUDA) against transformers' log-probs for the same weights (the
             weights rounded to bf16 on both sides, transformers in fp32), on a few layers of a real config
  te         the same weights on Transformer Engine's spec against the local spec (where TE imports)
  reshard    the torch_dist checkpoint the checkpoint row saved (on CUDA, TP 1) loaded at TP 2 in a CPU gloo world of
             2 (tools/gpu_check_reshard.py), its full tensors against the saving model's, bitwise
  ipc        tests/gpu/test_colocated_handoff.py (the CUDA IPC hand-off to a second process), run by pytest
  server     a weight push into a real SGLang server with the log-prob probe (tests/sglang_real, where SGLang
             imports and MEGAMU_SGLANG_VENV names its venv)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from tools.gpu_check_compare import compare_bitwise, compare_logprobs, pytest_verdict

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

    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tools" / "gpu_check_reshard.py"), str(ckpt_dir), str(hf_dir), str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired:
        return False, "the TP 2 load did not finish in 300 s"
    if proc.returncode != 0:
        return False, f"TP 2 load failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    got = torch.load(out)
    ok, verdict = compare_bitwise({n: t.float().cpu() for n, t in want.items()}, got)
    return ok, f"saved at TP 1, loaded at TP 2: {verdict}"


def ipc_check(cuda: bool) -> tuple[bool | None, str]:
    """tests/gpu/test_colocated_handoff.py: a push's CUDA IPC payload read bitwise by another process, and a stopped
    server's memory given back."""
    if not cuda:
        return None, "needs a CUDA device (the test skips without one)"
    return _pytest(["tests/gpu/test_colocated_handoff.py"], expected=2)


def server_check(cuda: bool) -> tuple[bool | None, str]:
    """A tensor push into a real SGLang server and its log-prob probe (tests/sglang_real)."""
    venv = os.environ.get("MEGAMU_SGLANG_VENV")
    if importlib.util.find_spec("sglang") is None and not venv:
        return None, "SGLang is not installed (and MEGAMU_SGLANG_VENV is unset)"
    if not cuda:
        return None, "the GPU server push needs CUDA (make test-sglang runs the CPU build)"
    return _pytest(["tests/sglang_real", "-k", "tensor_push_into_the_server or memory_sync_matches_the_new_weights"],
                   expected=2, env={"MEGAMU_SGLANG_TESTS": "1"})


def _pytest(args: list[str], expected: int, env: dict | None = None) -> tuple[bool | None, str]:
    full = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=300, env=full)
    except subprocess.TimeoutExpired:
        return False, "pytest did not finish in 300 s"
    return pytest_verdict(proc.returncode, proc.stdout + proc.stderr, expected)
