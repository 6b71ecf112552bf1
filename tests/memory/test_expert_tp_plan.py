"""The memory plan with experts at their own TP (``MemoryPlanConfig.etp``): megatron-core forms the expert groups
ETP x EP x expert-DP over the same world as the dense TP x DP (parallel_state.py:786-805), so one rank holds
E / EP experts split over ETP, and their optimiser state is sharded over expert-DP = TP x DP / (ETP x EP)."""

import pytest

from megamu.errors import ConfigError
from megamu.memory.memory_plan import MemoryPlanConfig, ModelShape, plan_memory
from tests.memory.test_moe_plan import QWEN3_30B_A3B


def config(**kw) -> MemoryPlanConfig:
    base = dict(model=ModelShape.from_hf_config(QWEN3_30B_A3B), micro_batch_size=1, max_seq_len=8192, tp=4,
                sequence_parallel=True, ep=8, dp=2, recompute_granularity="full")
    return MemoryPlanConfig(**{**base, **kw})


def training(c: MemoryPlanConfig) -> dict[str, int]:
    return {r.part: r.bytes for r in plan_memory(c).rows() if r.phase == "training"}


def test_experts_split_over_etp_and_their_state_over_expert_dp():
    # hand count from the config: attention and the (padded, untied) vocab split over TP 4; norms, q/k norms, router
    # whole on every rank; 128 experts of (gate, up, down) 2048 x 768 in each of 48 layers
    h, layers, vocab = 2048, 48, 152064
    dense = (layers * (h * (4096 + 1024) + 4096 * h) + 2 * vocab * h) // 4 + layers * (2 * h + 256 + 128 * h) + h
    experts = 48 * 128 * 3 * h * 768
    for etp, ep, edp in ((1, 8, 1), (2, 4, 1), (1, 4, 2), (4, 2, 1)):  # ETP x EP x expert-DP = 8 ranks
        c = config(etp=etp, ep=ep)
        assert (c.expert_tp, c.expert_dp) == (etp, edp)
        rows = training(c)
        assert rows["params (bf16)"] == (dense + experts // (etp * ep)) * 2, (etp, ep)
        assert rows["Adam moments (fp32 x2)"] == dense * 8 // 2 + experts // (etp * ep) * 8 // edp, (etp, ep)
    assert "EP 8, ETP 1 x EDP 1 (16 of 128 experts per GPU)" in plan_memory(config(etp=1)).table()
    assert "ETP" not in plan_memory(config(etp=4, ep=2)).table()  # megatron's default layout reads as before


@pytest.mark.parametrize("kw, field", [(dict(etp=5), "etp"), (dict(etp=2, ep=8), "ep")])
def test_an_expert_layout_that_does_not_fit_is_refused(kw, field):
    with pytest.raises(ConfigError) as e:  # 768 / 5; ETP 2 x EP 8 = 16 > 8 ranks
        config(**kw)
    assert e.value.field == field
