"""The memory plan with --sequence-parallel: the per-token tensors outside the TP blocks (norm inputs and outputs,
the norms' fp32 1/rms, full recompute's layer inputs, the final norm) divided by TP, against hand-computed bytes."""

from dataclasses import replace

import pytest

from megamu.errors import ConfigError
from megamu.memory.measured_peaks import UNMEASURED_MARGIN
from megamu.memory.memory_fixes import fixes
from megamu.memory.memory_plan import GIB, MemoryPlanConfig, ModelShape, plan_memory

# h 64, 2 layers; TP 2, bf16 (2 bytes), one row of 100 tokens: the micro-batch holds 100 tokens
SHAPE = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=96,
                   vocab_size=100)
BASE = MemoryPlanConfig(model=SHAPE, micro_batch_size=1, max_seq_len=100, params_dtype="bf16", tp=2, dp=1)


def row(config: MemoryPlanConfig, part: str) -> int:
    return next(r.bytes for r in plan_memory(config).rows() if r.phase == "training" and r.part == part)


@pytest.mark.parametrize("impl, recompute, saved", [
    # per layer: norm inputs and outputs 4h x 2 bytes x 100 tokens = 51200, half of it on each rank: 25600; the
    # norms' 1/rms, 2 fp32 per token = 800, half: 400; 2 layers: 52000. Final norm: h x 2 x 100 = 12800, half: 6400
    ("transformer_engine", None, 2 * (25600 + 400) + 6400),
    # full recompute: the layer inputs (h x 2 x 100 = 12800 per layer, half: 6400 each, 2 layers) and one rebuilt
    # layer (26000), final norm 6400
    ("transformer_engine", "full", 2 * 6400 + 26000 + 6400),
    # the local spec's torch RMSNorm keeps 2h more per token (6h: 76800 per layer, half: 38400), and 2h at the final
    # norm (25600, half: 12800)
    ("local", None, 2 * (38400 + 400) + 12800),
])
def test_sequence_parallelism_shrinks_the_training_term_by_the_hand_computed_bytes(impl, recompute, saved):
    plain = replace(BASE, transformer_impl=impl, recompute_granularity=recompute)
    sp = replace(plain, sequence_parallel=True)
    label = "activations, " + ("full recompute" if recompute else "no recompute")
    assert row(plain, label) - row(sp, label) == saved
    # the total by the same bytes, and the margin for the activations being short (15 % of them) shrinks with them
    margin = [next(r.bytes for r in plan_memory(c).rows() if r.part.startswith("margin")) for c in (plain, sp)]
    assert plan_memory(plain).total("training") - plan_memory(sp).total("training") == saved + margin[0] - margin[1]
    assert margin[0] - margin[1] == pytest.approx(UNMEASURED_MARGIN * saved, abs=1)
    # the attention, MLP, RoPE and logits terms are the same: only what SP splits changed
    assert row(plain, "logits and log-softmax temporaries (fp32)") == row(sp, "logits and log-softmax temporaries "
                                                                               "(fp32)")
    assert "trainer TP 2 + SP x DP 1" in plan_memory(sp).table()


def test_an_moe_layers_router_terms_split_and_its_dispatch_does_not():
    moe = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=96,
                     vocab_size=100, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32)
    plain = replace(BASE, model=moe)
    sp = replace(plain, sequence_parallel=True)
    # per layer as the dense model (26000) plus the router's fp32 logits and scores and its map: (2 x 4 x 4 + 4)
    # bytes x 100 tokens = 3600, half: 1800; the routed rows (k h) and their weights stay whole; final norm 6400
    assert row(plain, "activations, no recompute") - row(sp, "activations, no recompute") == 2 * (26000 + 1800) + 6400


def test_sequence_parallelism_needs_tensor_parallelism():
    with pytest.raises(ConfigError, match="needs tensor parallelism"):
        replace(BASE, tp=1, sequence_parallel=True)


def test_a_plan_that_fits_only_with_sp_suggests_it():
    from tests.memory.test_plan import EXAMPLE, QWEN25_MATH_7B

    # the 7B example (TP 2, 4 rows of 4096 tokens) on a device between its training totals without and with SP
    example = MemoryPlanConfig(model=ModelShape.from_hf_config(QWEN25_MATH_7B), **EXAMPLE)
    plain = plan_memory(example).total("training")
    sp = plan_memory(replace(example, sequence_parallel=True)).total("training")
    assert sp < plain
    between = replace(example, gpu_memory_gib=(plain + sp) / 2 / GIB)
    assert ("sequence_parallel", True) in fixes(between)
    assert ("sequence_parallel", True) not in fixes(replace(between, tp=1, dp=4))  # nothing to split over
