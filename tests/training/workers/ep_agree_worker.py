"""torchrun --nproc_per_node 2 worker: at EP 2 both ranks of the expert-parallel group run the same number of
forward/backward passes when their data-parallel shares differ (skip_zero_advantage, uneven log-prob shares).

Usage: ep_agree_worker.py HF_DIR OUT_JSON [alltoall]
With ``alltoall`` (an MoE model in HF_DIR): megatron-core's alltoall dispatcher, the GPU path's, through
tests/cpu_cuda_shim.py, so every padding pass enters the same all-to-alls as the other rank's real passes.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megamu.algo import ALGORITHM_PRESETS  # noqa: E402
from megamu.runtime import parallel  # noqa: E402
from megamu.training import step  # noqa: E402
from megamu.training.batch import data_parallel_share  # noqa: E402
from tests.training.helpers import make_samples, tiny_model  # noqa: E402


class NoOptimizer:
    def zero_grad(self):
        pass

    def step(self):
        return 0.0, 0.0


def main(hf_dir: str, out: str, dispatcher: str = "") -> None:
    torch.set_num_threads(1)
    if dispatcher == "alltoall":
        import megamu.model.config as model_config
        from tests import cpu_cuda_shim

        cpu_cuda_shim.install()
        model_config.moe_impl = lambda impl: model_config.MoeImpl(grouped_gemm=False, token_dispatcher="alltoall",
                                                                  cpu_router=True)
    parallel.init_distributed(tensor_model_parallel_size=1, seed=0, expert_model_parallel_size=2,
                              distributed_timeout_minutes=1.5)  # a rank left in a collective fails, not hangs
    assert parallel.ep_size() == 2 and parallel.dp_size() == 2
    model, arch = tiny_model(hf_dir)
    calls = {"n": 0}
    real = step.response_logprobs

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    step.response_logprobs = counted
    samples = make_samples(4, 2, arch.vocab_size, seed=1)
    zero = {id(s) for s in data_parallel_share(samples, 0, 2)}  # rank 0's share: nothing to train
    for s in samples:
        s.advantage = 0.0 if id(s) in zero else (s.advantage or 1.0)
    metrics = step.train_step(model, NoOptimizer(), samples, ALGORITHM_PRESETS["mu-grpo"], micro_batch_size=1,
                              skip_zero_advantage=True)
    train_calls = calls["n"]
    # the experts apart: at EP 2 rank 0's experts get rank 1's tokens' gradient through the all-to-all's backward
    grad_abs = [sum(float(p.grad.abs().sum()) for n, p in model.named_parameters()
                    if p.grad is not None and (".local_experts." in n) == expert) for expert in (False, True)]
    calls["n"] = 0
    step.compute_logprobs(model, samples[:3], micro_batch_size=1)  # shares of 2 and 1 sample
    logprob_calls = calls["n"]
    rows = parallel.all_gather_object((train_calls, logprob_calls, metrics["n_micro_batches"], *grad_abs))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    parallel.destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
