"""Weight-sync time into a real SGLang server: HF export + /update_weights_from_disk vs in-memory broadcast.

Side by side in one run, against one server (the CPU build of shared/sglang-cpu, launched by megamu), alternating the
two ways each repeat, with fresh weights every time (so neither side reloads what it already has). Disk = the export a
trainer writes (save_pretrained of the state dict, what megamu.convert.export_hf amounts to) + the server's reload;
memory = /begin_weight_update, bucketed /update_weights_from_distributed over a gloo group, /end_weight_update.
A last sync each way is checked with a teacher-forced log-prob probe against transformers.

    python -m bench.sglang_sync [--model smollm2|tiny] [--repeats 3] [--bucket-mb 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megamu.engines.sglang.client import SGLangEngine
from megamu.engines.sglang.weight_sync import LogprobProbe
from tests.sglang_real.cpu_build import cpu_config
from tests.tiny import save_tiny_model


def _perturbed(state: dict, k: int) -> dict:
    """New weights of the same layout (norm weights scaled): a real change for the server to load."""
    return {n: t * (1.0 + 0.01 * k) if n.endswith("norm.weight") else t.clone() for n, t in state.items()}


def _probe(model, ids: list[int]) -> LogprobProbe:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return LogprobProbe(ids, lp.tolist(), tolerance=1e-3)  # float32 on both sides, 30 layers: ~1e-5 expected


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--port", type=int, default=39500)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="megamu-sync-bench-"))
    if args.model == "smollm2":
        from megamu.model.demo_model import smollm2_hf_dir

        src = str(smollm2_hf_dir())
    else:
        src = str(save_tiny_model(work / "tiny", "llama", seed=0))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    base = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        base.pop("lm_head.weight", None)  # as in the folder: a tied head is the embedding
    t0 = time.monotonic()
    engine = SGLangEngine(src, cpu_config(args.port, work / "logs", weight_bucket_mb=args.bucket_mb,
                                          request_timeout_s=900))
    print(f"server up in {time.monotonic() - t0:.0f}s")
    disk, export, memory = [], [], []
    try:
        for k in range(1, args.repeats + 1):
            sd = _perturbed(base, k)
            t = time.monotonic()
            model.load_state_dict(sd, strict=False)
            out = work / f"export_{k}"
            model.save_pretrained(out, safe_serialization=True)
            for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                if (Path(src) / f).exists():
                    (out / f).write_bytes((Path(src) / f).read_bytes())
            t_export = time.monotonic() - t
            loaded = engine.update_weights(hf_dir=str(out))
            disk.append(t_export + loaded.seconds)
            export.append(t_export)
            sent = engine.update_weights(state_dict=_perturbed(base, k + 100))
            memory.append(sent.seconds)
            print(f"repeat {k}: disk {disk[-1]:.2f}s (export {t_export:.2f}s + load {loaded.seconds:.2f}s) | "
                  f"memory {memory[-1]:.2f}s ({sent.bytes / 2**20:.0f} MB)")
        ids = [1, 20, 30, 40, 50, 60, 70, 80, 90, 100, 11, 12]
        sd = _perturbed(base, 7)
        model.load_state_dict(sd, strict=False)
        checked = engine.update_weights(state_dict=sd, probe=_probe(model, ids))
    finally:
        engine.shutdown()
    result = dict(model=args.model, repeats=args.repeats, bucket_mb=args.bucket_mb,
                  disk_s=statistics.median(disk), export_s=statistics.median(export),
                  memory_s=statistics.median(memory), memory_probe_mean_abs_diff=checked.probe_mean_abs_diff,
                  disk_over_memory=statistics.median(disk) / statistics.median(memory))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
