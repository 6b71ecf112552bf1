"""The lab model: a small Llama-shaped model with the char tokenizer, fine-tuned here on the lab task until its
sampled (T = 1) accuracy first reaches a target, so that RL starts with room to learn and with wrong samples.

The build is seeded, runs on one thread and trains in float64 (``LabSpec.dtype``), then saves float32 weights. Why
float64: an fp32 build gave different weights on an Intel (AVX-512) and an AMD machine (base greedy accuracy 0.605 vs
0.48, issue 34), because the vector kernels sum in different orders; in float64 those differences stay ~1e-16 and
vanish when the weights are rounded to fp32. That is likely, not certain, so the build also records the sha256 of its
float32 weights (``weights_sha256``) and ``PINNED`` holds the checksum of the default spec's reference build: a
build or cache that differs is refused, and every fidelity run key carries the checksum. The result is cached under
``$MEGAMU_CACHE/lab-<hash of the settings>``, like the demo model, with ``lab_build.json`` recording the steps
taken, the accuracies reached and the checksum. bench/fidelity.py builds it on first use.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.lab.evaluate import _prompt_ids, accuracy
from bench.lab.task import max_reply_chars, problems, prompt_text, solution
from tests.tiny import build_char_tokenizer

CACHE = Path(os.environ.get("MEGAMU_CACHE", Path.home() / ".cache" / "megamu"))
# The lab task's operand length (issue 34): 4 digits were solved by standard GRPO in ~64 updates, leaving a stage of
# μ = 1024 nothing to learn; 6 digits give ~65-token replies with more places to go wrong.
LAB_DIGITS = 6


@dataclass(frozen=True)
class LabSpec:
    family: str = "llama"  # the only one: see hf_config
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    digits: int = LAB_DIGITS
    dtype: str = "float64"  # the build's training precision (weights are saved in float32): see the module doc
    seed: int = 0
    lr: float = 1e-3
    batch_size: int = 32
    max_steps: int = 4000
    # probes every eval_every steps from probe_from on. Two earlier builds of this spec (same seed, same steps):
    # probes every 50 steps read 0 up to step 350 and 0.05 -> 0.23 between steps 450 and 500; every 10 steps from 400,
    # 0.125 (470), 0.148 (480), 0.242 (490). The target below stops the build at step 480, the last probe near 0.15.
    eval_every: int = 10
    probe_from: int = 480
    probe_problems: int = 128  # sampled-accuracy probe set (its own seed: never a training or held-out row)
    target_accuracy: float = 0.14  # stop at the first probe whose T = 1 accuracy reaches this (issue 34: ~0.15)

    @property
    def max_new_tokens(self) -> int:
        # the longest reference reply, its EOS and room for a few stray tokens (a longer reply is wrong anyway)
        return max_reply_chars(self.digits) + 8

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def hf_config(spec: LabSpec, vocab_size: int):
    # Llama, not Qwen2: transformers maps a qwen2 folder to Qwen2Tokenizer, whose byte-level pre-tokenizer drops the
    # char vocabulary's newline and space; a llama folder keeps the saved tokenizer as it is.
    from transformers import LlamaConfig

    if spec.family != "llama":
        raise ValueError(f"lab model family {spec.family!r}: only 'llama' keeps the char tokenizer intact")
    return LlamaConfig(vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                       num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
                       num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=256, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _batch(tokenizer, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of prompt + reference reply + EOS, and labels that score only the reply and its EOS."""
    seqs, labels = [], []
    for a, b in pairs:
        p = _prompt_ids(tokenizer, prompt_text(a, b))
        r = list(tokenizer(solution(a, b), add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        seqs.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    lab = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
    return ids, lab


def train(spec: LabSpec, out: Path, log=print) -> dict:
    """Fine-tune from random weights until the probe's sampled accuracy reaches the target; save the HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(spec.seed)
        # the tokenizer as the trainer will load it from the folder, so fine-tuning sees the trainer's token ids
        build_char_tokenizer().save_pretrained(out)
        tok = AutoTokenizer.from_pretrained(out)
        model = AutoModelForCausalLM.from_config(hf_config(spec, len(tok)), dtype=getattr(torch, spec.dtype))
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.0)
        # training problems: their own seed; the probe set is drawn apart from them (held-out sets use other seeds)
        probe = problems(spec.probe_problems, spec.seed + 7919, spec.digits)
        probe_rows = [(prompt_text(a, b), str(a + b)) for a, b in probe]
        stream = problems(spec.batch_size * spec.max_steps, spec.seed + 104729, spec.digits, exclude=set(probe))
        t0, history, acc = time.perf_counter(), [], None
        for step in range(1, spec.max_steps + 1):
            model.train()
            ids, lab = _batch(tok, stream[(step - 1) * spec.batch_size:step * spec.batch_size])
            loss = model(input_ids=ids, labels=lab).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step >= spec.probe_from and step % spec.eval_every == 0:
                acc = accuracy(model, tok, probe_rows, greedy=False, seed=spec.seed,
                               max_new_tokens=spec.max_new_tokens)
                history.append({"step": step, "loss": round(loss.item(), 4), "sampled_accuracy": acc.accuracy})
                log(f"lab model: step {step} loss {loss.item():.3f} sampled accuracy {acc.accuracy:.3f}")
                if acc.accuracy >= spec.target_accuracy:
                    break
        if acc is None or acc.accuracy < spec.target_accuracy:
            raise RuntimeError(f"lab model: sampled accuracy {acc and acc.accuracy} < {spec.target_accuracy} "
                               f"after {spec.max_steps} steps")
        greedy = accuracy(model, tok, probe_rows, greedy=True, max_new_tokens=spec.max_new_tokens)
        model = model.to(torch.float32)
        model.save_pretrained(out, safe_serialization=True)
        GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out)
        record = {"spec": asdict(spec), "steps": step, "seconds": round(time.perf_counter() - t0, 1),
                  "sampled_accuracy": acc.accuracy, "greedy_accuracy": greedy.accuracy,
                  "sampled_mean_length": acc.mean_length, "weights_sha256": weights_sha256(out),
                  "history": history}
        (out / "lab_build.json").write_text(json.dumps(record, indent=1))
        return record
    finally:
        torch.set_num_threads(threads)


# weights_sha256 of the reference build of each spec in use, by LabSpec.key() (built on AMD EPYC, one thread)
PINNED: dict[str, str] = {
    "003c93051ffc": "b6f2780bca46289f372c5e14da693d1194e095f2cdcdfa78cfd825ea534ed9f6",  # LabSpec(): 480 steps, 441 s
}


def weights_sha256(folder: Path) -> str:
    """sha256 of a saved folder's weights: names, shapes, dtypes and raw bytes in name order (not the file's bytes,
    whose header layout belongs to the safetensors version)."""
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(str(folder / "model.safetensors")).items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_pinned(spec: LabSpec, folder: Path, pinned: dict[str, str] | None = None) -> str:
    """The folder's weights checksum, after refusing weights that differ from the build pinned for ``spec``
    (recomputed from the weights, so an edited or foreign cache is caught too)."""
    pinned = PINNED if pinned is None else pinned
    got = weights_sha256(folder)
    recorded = json.loads((folder / "lab_build.json").read_text()).get("weights_sha256")
    if recorded != got:
        raise RuntimeError(f"lab model {folder}: weights sha256 {got[:12]} is not the one its build recorded "
                           f"({str(recorded)[:12]}); delete the folder to rebuild")
    want = pinned.get(spec.key())
    if want is not None and got != want:
        raise RuntimeError(f"lab model {folder}: this machine's build has weights sha256 {got[:12]}, the pinned "
                           f"reference build has {want[:12]}: results here would not be comparable with the "
                           "committed ones (a CPU whose float64 kernels differ?)")
    return got


def lab_model_dir(spec: LabSpec = LabSpec(), cache: Path = CACHE, log=print,
                  pinned: dict[str, str] | None = None) -> Path:
    """The cached lab model for ``spec``, built on first use (minutes on one core), checked against ``PINNED``."""
    out = cache / f"lab-{spec.key()}"
    if (out / "lab_build.json").exists():
        check_pinned(spec, out, pinned)
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".lab-", dir=cache))
    try:
        train(spec, tmp, log)
        try:
            tmp.rename(out)
        except OSError:  # another process built it first: same spec, same seed, so keep theirs
            if not (out / "lab_build.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    check_pinned(spec, out, pinned)
    return out
