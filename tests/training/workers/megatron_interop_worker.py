"""torchrun --nproc_per_node 2 worker (TP=2): megamu's checkpoints and ones written by plain megatron-core code (a
GPTModel built from megatron-core's own classes, saved and loaded with ``dist_checkpointing``, nothing of megamu's)
load into each other bitwise. Args: hf_dir (a tiny Qwen3 written by the test), out_dir.

Plain megatron-core's save refuses a CPU-only torch; this worker first checks where, then stands in for a GPU by
stubbing the two CUDA calls on that path (``torch.cuda.synchronize``, ``torch.cuda.current_device``), so the files
are written by megatron-core's stock code exactly as Megatron-LM writes them on a GPU.
"""

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: megamu and tests

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def plain_gpt(hf_dir: str, seed: int):
    """Megatron-LM's model for this HF config, from megatron-core classes and the HF config.json alone."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf["head_dim"], ffn_hidden_size=hf["intermediate_size"], normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"], gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        qk_layernorm=True, tensor_model_parallel_size=2, use_cpu_initialization=True,
    )
    vocab = -(-hf["vocab_size"] // 256) * 256  # Megatron-LM's padding: a multiple of 128 * TP
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True,
                                                                                  normalization="RMSNorm"),
                    vocab_size=vocab, max_sequence_length=hf["max_position_embeddings"],
                    share_embeddings_and_output_weights=hf["tie_word_embeddings"], position_embedding_type="rope")


def tensors(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra_state" not in k}


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys()))
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def stock_save_refuses_cpu(sharded: dict, folder: Path) -> None:
    from megatron.core import dist_checkpointing

    try:
        dist_checkpointing.save(sharded, str(folder))
    except AssertionError as e:
        frames = [(Path(f.filename).name, f.name) for f in traceback.extract_tb(e.__traceback__)]
        assert "Torch not compiled with CUDA enabled" in str(e), e
        assert ("filesystem_async.py", "preload_tensors") in frames, frames
        log("stock dist_checkpointing.save on CPU: AssertionError in filesystem_async.py preload_tensors "
            "(torch.cuda.synchronize)")
        return
    raise AssertionError("megatron-core's stock save ran on a CPU-only torch: megamu's CPU save path is obsolete")


def main(hf_dir: str, out: str) -> None:
    from megatron.core import dist_checkpointing

    from megamu.algo import ALGORITHM_PRESETS
    from megamu.model import ModelArch, build_model
    from megamu.runtime import parallel
    from megamu.training import OptimizerConfig, build_optimizer, load_checkpoint, save_checkpoint, train_step
    from tests.training.helpers import make_samples, tiny_model

    torch.set_num_threads(1)
    parallel.init_distributed(tensor_model_parallel_size=2)
    out = Path(out)
    arch = ModelArch.from_hf(hf_dir)
    mu = ALGORITHM_PRESETS["mu-grpo"]

    # 1. plain megatron-core writes a checkpoint as Megatron-LM does (its top-level names, its layout)
    plain = plain_gpt(hf_dir, seed=11)
    sharded = {"model": plain.sharded_state_dict(), "iteration": 7, "checkpoint_version": 3.0}
    if dist.get_rank() == 0:
        (out / "refused").mkdir(parents=True)
    dist.barrier()
    stock_save_refuses_cpu(sharded, out / "refused")
    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a: None), (lambda: "cpu")
    folder = out / "megatron" / "iter_0000007"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"model": plain.sharded_state_dict(), "iteration": 7, "checkpoint_version": 3.0},
                            str(folder))
    if dist.get_rank() == 0:
        (out / "megatron" / "latest_checkpointed_iteration.txt").write_text("7")
    dist.barrier()

    # ... megamu loads it: the weights, no run state
    torch.manual_seed(99)
    model = build_model(arch)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3))
    assert load_checkpoint(out / "megatron", model, arch, opt) == {"iteration": 7, "run_state": False}
    assert_same(tensors(model), tensors(plain), "plain megatron-core -> megamu")
    log("plain megatron-core checkpoint loaded into megamu: bitwise")

    # 2. megamu writes one after an update (weights and Adam moments) ...
    model, arch = tiny_model(hf_dir)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3))
    train_step(model, opt, make_samples(2, 4, arch.vocab_size, seed=1), mu, micro_batch_size=4)
    save_checkpoint(out / "megamu", 1, model, arch, opt, extra={"stage": 0})

    # ... plain megatron-core loads the model, and Megatron's optimiser keys hold megamu's moments
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    plain = plain_gpt(hf_dir, seed=12)
    folder = out / "megamu" / "iter_0000001"
    model_sd = plain.sharded_state_dict()
    qkv = model_sd["decoder.layers.0.self_attention.linear_qkv.weight"]
    moment = make_sharded_optimizer_tensor(qkv, torch.empty_like(qkv.data), "optimizer.state.exp_avg")
    # one layer's fragment of a stacked tensor: not a complete access pattern, so not validated as one
    loaded = dist_checkpointing.load({"model": model_sd, "moment": moment}, str(folder),
                                     validate_access_integrity=False)
    plain.load_state_dict(loaded["model"])
    assert_same(tensors(plain), tensors(model), "megamu -> plain megatron-core")
    want = opt.param_state(model.decoder.layers[0].self_attention.linear_qkv.weight)["exp_avg"]
    assert torch.equal(loaded["moment"], want), "exp_avg of layer 0's linear_qkv"
    assert dist_checkpointing.load_common_state_dict(str(folder))["iteration"] == 1
    log("megamu checkpoint loaded by plain megatron-core: bitwise (weights and exp_avg)")
    log("OK")
    parallel.destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:3])
