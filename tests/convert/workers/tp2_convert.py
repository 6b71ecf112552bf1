"""torchrun worker (2 ranks, TP=2): mcore folder -> live TP=2 model gives transformers' logits and log-probs;
export_hf from the live model. Args: pairs of (hf_dir, mcore_dir, export_dir)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # this checkout's megamu and tests, not an installed one


def main(args):
    from transformers import AutoModelForCausalLM

    from megamu.convert import export_hf, load_mcore_into_model, read_arch
    from megamu.model import build_model, forward_logprobs
    from megamu.parallel import init_distributed, tp_group

    torch.set_num_threads(1)
    init_distributed(2)
    for hf_dir, mcore_dir, export_dir in zip(args[0::3], args[1::3], args[2::3]):
        arch = read_arch(mcore_dir)
        model = build_model(arch)
        load_mcore_into_model(model, arch, mcore_dir)
        ids = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(ids).logits
        with torch.no_grad():
            local = model(ids, torch.arange(24).expand(2, 24), None)
            parts = [torch.empty_like(local) for _ in range(2)]
            torch.distributed.all_gather(parts, local.contiguous(), group=tp_group())
            logits = torch.cat(parts, dim=-1)[..., : arch.vocab_size]
            err = (logits - ref).abs().max().item()
            assert err <= 1e-4, f"{arch.family}: TP=2 logits differ from transformers by {err}"
            for t in (1.0, 0.7):
                logp, _ = forward_logprobs(model, ids, temperature=t)
                want = torch.log_softmax(ref[:, :-1] / t, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
                lerr = (logp - want).abs().max().item()
                assert lerr <= 1e-4, f"{arch.family}: TP=2 log-probs at T={t} differ by {lerr}"
        export_hf(model, arch, export_dir, hf_source_dir=mcore_dir, dtype="fp32")
        print(f"OK {arch.family} logits {err:.1e}")


if __name__ == "__main__":
    from tests.torchrun import rank_main

    rank_main(main, sys.argv[1:])
