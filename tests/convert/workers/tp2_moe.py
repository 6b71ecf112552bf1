"""torchrun worker (2 ranks): a Qwen3-MoE at TP=2. mbridge (with megamu's SequentialMLP name entries) loads the HF
folder bitwise as megamu's own mapping does; a torch_dist checkpoint written at TP=1 loads at TP=2 to the same
weights; both exports (mbridge's torch_dist_to_hf, megamu's export_hf) go to folders the test compares with the HF
files. Then where megatron-core 0.16.1 stops on CPU: the MoE forward at TP=2, and at EP=2, reaches
tensor_parallel/mappings.py:141 (a CUDA allocation). Args: hf_dir, torch_dist_dir, mbridge_export, megamu_export."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # this checkout's megamu and tests, not an installed one


def _forward_is_refused(model, vocab: int) -> str:
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    model.eval()
    try:
        with torch.no_grad():
            model(ids, torch.arange(8).expand(2, 8), None)
    except (AssertionError, RuntimeError) as e:
        assert "CUDA" in str(e), e
        return "refused"
    return "ran"


def main(hf_dir, dist_dir, mbridge_export, megamu_export):
    from megatron.core import parallel_state

    from megamu.convert import export_hf
    from megamu.model import ModelArch, build_model
    from megamu.runtime.parallel import init_distributed
    from megamu.training.torch_dist import torch_dist_to_hf
    from tests.convert.workers.tp2_mbridge import three_loads_agree

    torch.set_num_threads(1)
    init_distributed(2)
    arch = ModelArch.from_hf(hf_dir)
    ref = three_loads_agree(arch, hf_dir, dist_dir)
    experts = sum(".local_experts." in name for name, _ in ref.named_parameters())
    assert experts == arch.num_layers * arch.num_experts * 2
    torch_dist_to_hf(dist_dir, hf_dir, mbridge_export, dtype="fp32")
    export_hf(ref, arch, megamu_export, hf_source_dir=hf_dir, dtype="fp32")
    print(f"OK TP=2 rank {torch.distributed.get_rank()}: {experts} expert tensors bitwise", flush=True)
    print(f"FORWARD TP=2 {_forward_is_refused(ref, arch.vocab_size)}", flush=True)

    # expert parallelism: megatron-core builds the experts split over EP=2 under gloo, but its forward is refused
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2)
    ep_model = build_model(arch)
    local = {n for n, _ in ep_model.named_parameters() if ".local_experts." in n}
    assert len(local) == arch.num_layers * arch.num_experts // 2 * 2  # half the experts on each rank
    print(f"FORWARD EP=2 {_forward_is_refused(ep_model, arch.vocab_size)}", flush=True)


if __name__ == "__main__":
    from tests.torchrun import rank_main

    rank_main(main, *sys.argv[1:])
