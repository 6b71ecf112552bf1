"""torchrun worker (2 ranks, TP=2), per family: mbridge loads the HF folder into megamu's TP=2 model bitwise as
megamu's own mapping does; a torch_dist checkpoint written at TP=1 (hf_to_torch_dist) loads at TP=2 to the same
weights and gives transformers' logits and log-probs; torch_dist_to_hf exports it back, and so does export_hf (the
trainer's export) from the live TP=2 model. Args: quadruples of
(hf_dir, torch_dist_dir, export_dir, live_export_dir)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # this checkout's megamu and tests, not an installed one


def three_loads_agree(arch, hf_dir, dist_dir):
    """megamu's mapping, mbridge and the torch_dist checkpoint give the TP-sharded model the same weights, bitwise;
    returns the model loaded from the checkpoint."""
    from megamu.convert import load_hf_into_model
    from megamu.convert.bridge import load_hf_via_mbridge
    from megamu.model import build_model
    from megamu.training.checkpoint import load_model_checkpoint

    ref = build_model(arch)
    load_hf_into_model(ref, arch, hf_dir)  # megamu's own mapping
    bridged = build_model(arch)
    load_hf_via_mbridge(bridged, arch, hf_dir)
    from_dist = build_model(arch)
    assert load_model_checkpoint(dist_dir, from_dist) == 0
    rows = arch.vocab_size - torch.distributed.get_rank() * (ref.embedding.word_embeddings.weight.shape[0])
    for (name, want), (_, a), (_, b) in zip(ref.named_parameters(), bridged.named_parameters(),
                                            from_dist.named_parameters()):
        if "word_embeddings" in name or "output_layer" in name:  # padded vocab rows are masked, never read
            want, a, b = want[:max(rows, 0)], a[:max(rows, 0)], b[:max(rows, 0)]
        assert torch.equal(a, want), f"{arch.family} mbridge: {name}"
        assert torch.equal(b, want), f"{arch.family} torch_dist TP1 -> TP2: {name}"
    return from_dist


def main(args):
    from transformers import AutoModelForCausalLM

    from megamu.convert import export_hf
    from megamu.model import ModelArch, forward_logprobs
    from megamu.runtime.parallel import init_distributed, tp_group
    from megamu.training.torch_dist import torch_dist_to_hf

    torch.set_num_threads(1)
    init_distributed(2)
    for hf_dir, dist_dir, export_dir, live_dir in zip(args[0::4], args[1::4], args[2::4], args[3::4]):
        arch = ModelArch.from_hf(hf_dir)
        from_dist = three_loads_agree(arch, hf_dir, dist_dir)
        ids = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        hf_logits = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(ids).logits
        with torch.no_grad():
            local = from_dist(ids, torch.arange(24).expand(2, 24), None)
        parts = [torch.empty_like(local) for _ in range(2)]
        torch.distributed.all_gather(parts, local.contiguous(), group=tp_group())
        err = (torch.cat(parts, dim=-1)[..., : arch.vocab_size] - hf_logits).abs().max().item()
        assert err <= 1e-4, f"{arch.family}: logits differ from transformers by {err}"
        for t in (1.0, 0.7):
            with torch.no_grad():
                logp, _ = forward_logprobs(from_dist, ids, temperature=t)
            want = torch.log_softmax(hf_logits[:, :-1] / t, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            lerr = (logp - want).abs().max().item()
            assert lerr <= 1e-4, f"{arch.family}: TP=2 log-probs at T={t} differ by {lerr}"
        torch_dist_to_hf(dist_dir, hf_dir, export_dir, dtype="fp32", max_shard_bytes=40_000)
        export_hf(from_dist, arch, live_dir, hf_source_dir=hf_dir, dtype="fp32")
        print(f"OK {arch.family} logits {err:.1e}", flush=True)


if __name__ == "__main__":
    from tests.torchrun import rank_main

    rank_main(main, sys.argv[1:])
