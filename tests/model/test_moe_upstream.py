"""The megatron-core facts behind megamu's MoE flags, experts at their own TP and the optimiser-offload note (issue 49
items 1-3), pinned to the installed source (0.16.1): if a newer version moves one, this fails and the code citing it
(megamu.model.moe_settings, megamu.runtime.parallel, megamu.convert.tp, megamu.arguments.megatron) is to be revisited.

- ``parallel_state.py:786-787``: the expert TP size is the TP size unless given; ``:798-806``: the expert groups come
  from their own rank generator (tp = ETP, ep, dp = the world / (ETP x EP)), apart from the dense one;
  ``:1205``: the expert-TP group is that generator's "tp".
- ``transformer/transformer_config.py``: the MoE fields megamu sets, their names and values (:626, :629, :649, :675,
  :699, :708).
- ``transformer/moe/token_dispatcher.py:74``: the dispatchers' collectives run on ``pg_collection.tp_ep`` (ETP x EP),
  which ``parallel.ep_agreed_count`` agrees micro-batch counts over.
- ``optimizer/__init__.py:306`` and ``:336``: ``optimizer_cpu_offload`` builds the ``HybridDeviceOptimizer``;
  ``optimizer/optimizer_config.py:197-206``: the precision-aware optimiser's dtypes default to fp32.
"""

import importlib
from pathlib import Path


def _line(module: str, lineno: int) -> str:
    return Path(importlib.import_module(module).__file__).read_text().splitlines()[lineno - 1].strip()


def test_expert_groups_are_formed_apart_from_the_dense_ones():
    mod = "megatron.core.parallel_state"
    assert _line(mod, 786) == "if expert_tensor_parallel_size is None:"
    assert _line(mod, 787) == "expert_tensor_parallel_size = tensor_model_parallel_size"
    assert _line(mod, 798) == "expert_decoder_rank_generator = RankGenerator("
    assert [_line(mod, n) for n in (799, 800, 801)] == [
        "tp=expert_tensor_parallel_size,", "ep=expert_model_parallel_size,", "dp=expert_data_parallel_size,"]
    assert _line(mod, 1205) == "for ranks in expert_decoder_rank_generator.get_ranks('tp'):"


def test_the_moe_fields_megamu_sets():
    mod = "megatron.core.transformer.transformer_config"
    assert _line(mod, 626) == "moe_router_score_function: Literal['softmax', 'sigmoid'] = \"softmax\""
    assert _line(mod, 629) == "moe_router_dtype: Optional[Literal['fp32', 'fp64']] = None"
    assert _line(mod, 649) == "moe_grouped_gemm: bool = False"
    assert _line(mod, 675) == "moe_token_dispatcher_type: Literal['allgather', 'alltoall', 'flex'] = \"allgather\""
    assert _line(mod, 699) == "moe_token_drop_policy: Literal['probs', 'position'] = \"probs\""
    assert _line(mod, 708) == "moe_permute_fusion: bool = False"


def test_the_dispatchers_collectives_run_over_etp_x_ep():
    assert _line("megatron.core.transformer.moe.token_dispatcher", 74) == "self.tp_ep_group = pg_collection.tp_ep"


def test_cpu_offload_is_the_hybrid_device_optimizer_and_precision_aware_dtypes_default_to_fp32():
    mod = "megatron.core.optimizer"
    assert _line(mod, 306) == "if config.optimizer_cpu_offload:"
    assert _line(mod, 336) == "optimizer = HybridDeviceOptimizer("
    cfg = "megatron.core.optimizer.optimizer_config"
    assert [_line(cfg, n) for n in (197, 200, 203, 206)] == [
        f"{name}: torch.dtype = torch.float32"
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")]
