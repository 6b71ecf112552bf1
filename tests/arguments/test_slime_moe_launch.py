"""slime's Qwen3-30B-A3B launch as written (issue 49's done-when): ``scripts/run-qwen3-30B-A3B.sh`` with
``scripts/models/qwen3-30B-A3B.sh`` (THUDM/slime @624b824; the flags below as the script passes them to train.py, ray's
own flags and the paths aside: --hf-checkpoint is Qwen3-30B-A3B's real config.json, tests/fixtures/hf), told the
cluster only by its own --actor-num-nodes 1 --actor-num-gpus-per-node 8, dry-runs, fits 8 x H200 in bf16 and runs
slime's GRPO; with --algorithm mu-grpo, μ-GRPO.

The per-GPU trainer state is checked against a hand count from the config's numbers, at the script's layout:
attention at TP 4 + SP x DP 2, experts at ETP 1 x EP 8 x expert-DP 1 (megatron-core's parallel folding,
parallel_state.py:786-805)."""

from itertools import takewhile

from megamu.algo import AlgoConfig
from megamu.arguments import parse_args
from megamu.memory.memory_plan import GIB, plan_memory
from tests.arguments.test_model_and_slime_flags import HF

# scripts/models/qwen3-30B-A3B.sh: MOE_LAYER_FREQ is printf'd from 48 ones with IFS=', ' (its first character joins)
MOE_LAYER_FREQ = "[" + ",".join(["1"] * 48) + "]"
# the script's MODEL_ARGS, as written
MODEL_ARGS = [
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "32",
    "--num-query-groups", "4", "--kv-channels", "128", "--num-layers", "48", "--hidden-size", "2048",
    "--ffn-hidden-size", "6144", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6", "--rotary-percent", "1.0", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "151936", "--rotary-base", "1000000",
    "--moe-ffn-hidden-size", "768", "--moe-router-score-function", "softmax", "--moe-token-dispatcher-type",
    "alltoall", "--moe-router-topk", "8", "--moe-layer-freq", MOE_LAYER_FREQ, "--num-experts", "128",
    "--moe-grouped-gemm", "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    "--moe-aux-loss-coeff", "0",
]
# run-qwen3-30B-A3B.sh's train.py flags, array by array (CKPT_ARGS' paths kept but --hf-checkpoint and --save)
RUN_ARGS = (
    "--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate "
    "--ref-load /root/Qwen3-30B-A3B_torch_dist --load /root/Qwen3-30B-A3B_slime/ --save-interval 20 "
    "--prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label "
    "--apply-chat-template --rollout-shuffle --rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32 "
    "--n-samples-per-prompt 8 --rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 256 "
    "--balance-data "
    "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 "
    "--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer "
    "--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 "
    "--eps-clip 0.2 --eps-clip-high 0.28 "
    "--tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 1 "
    "--context-parallel-size 1 --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
    "--use-dynamic-batch-size --max-tokens-per-gpu 20480 "
    "--eval-interval 20 --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl --n-samples-per-eval-prompt 16 "
    "--eval-max-response-len 16384 --eval-top-p 1 "
    # SGLANG_ARGS: --sglang-cuda-graph-bs 1 2 4 8 then 16 to 256 by 8 (seq 16 8 256)
    "--rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.7 --sglang-cuda-graph-bs 1 2 4 8 "
    + " ".join(map(str, range(16, 257, 8))) + " "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 "
    "--attention-backend flash"
).split()

# What megamu does with each of the script's 89 flags: every one is in exactly one class, and none is refused.
TRANSLATED = {  # slime's name for another megamu setting (a start-up note or the flag's alias says which)
    "--actor-num-nodes", "--actor-num-gpus-per-node", "--colocate", "--rollout-num-gpus-per-engine",
    "--sglang-mem-fraction-static", "--num-rollout", "--rollout-batch-size", "--global-batch-size",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "--rm-type", "--advantage-estimator", "--eps-clip",
    "--eps-clip-high", "--ref-load", "--input-key", "--label-key",
    "--sglang-cuda-graph-bs"}  # SGLang's --cuda-graph-bs on the servers' command line (arguments/sglang_flags.py)
CHECKED = {  # model flags: checked against the HF config, which decides
    f for f in MODEL_ARGS if f.startswith("--") and f not in (
        "--moe-token-dispatcher-type", "--moe-grouped-gemm", "--moe-token-drop-policy", "--moe-router-dtype",
        "--moe-permute-fusion", "--moe-aux-loss-coeff")} | {"--attention-dropout", "--hidden-dropout"}
SAME = {  # megamu's own setting under the same name and meaning
    "--hf-checkpoint", "--load", "--save", "--save-interval", "--prompt-data", "--apply-chat-template",
    "--n-samples-per-prompt", "--rollout-max-response-len", "--rollout-temperature", "--eval-interval",
    "--eval-prompt-data", "--n-samples-per-eval-prompt", "--eval-max-response-len", "--eval-top-p", "--lr",
    "--lr-decay-style", "--weight-decay", "--adam-beta1", "--adam-beta2", "--use-kl-loss", "--kl-loss-coef",
    "--kl-loss-type", "--entropy-coef", "--tensor-model-parallel-size", "--sequence-parallel",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--recompute-granularity",
    "--moe-aux-loss-coeff", "--moe-token-dispatcher-type", "--moe-router-dtype", "--moe-token-drop-policy",
    "--moe-grouped-gemm", "--moe-permute-fusion"}
ACCEPTED = {  # at the one value megamu runs, or without effect (the note or --help says why)
    "--pipeline-model-parallel-size", "--context-parallel-size", "--recompute-method", "--recompute-num-layers",
    "--optimizer", "--rollout-shuffle", "--balance-data", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"}


def launch(tmp_path, monkeypatch, capsys, *extra):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)  # told the cluster by the script's own actor flags only
    run = parse_args([*MODEL_ARGS, "--hf-checkpoint", str(HF / "Qwen3-30B-A3B"), "--save", str(tmp_path / "run"),
                      *RUN_ARGS, "--dry-run", *extra])
    return run, capsys.readouterr().out


def test_every_flag_of_the_script_is_in_one_class():
    given = {f for f in MODEL_ARGS + RUN_ARGS if f.startswith("--")} | {"--hf-checkpoint", "--save"}
    classes = (TRANSLATED, CHECKED, SAME, ACCEPTED)
    assert sum(map(len, classes)) == len(given) == 89
    assert set().union(*classes) == given


def test_slimes_script_dry_runs_fits_8_h200_in_bf16_and_runs_slimes_grpo(tmp_path, monkeypatch, capsys):
    run, out = launch(tmp_path, monkeypatch, capsys)
    assert run.world_size == 8 and run.policy.bf16 and run.plan.rollout_mode == "colocated"
    assert (run.tensor_model_parallel_size, run.expert_model_parallel_size, run.expert_tensor_parallel_size) == \
        (4, 8, 1)
    assert run.policy.sequence_parallel and run.policy.recompute_granularity == "full"
    assert (run.plan.prompts_per_update, run.plan.n_samples_per_prompt, run.plan.mu) == (32, 8, 1)
    assert run.policy.max_tokens_per_micro_batch == 20480
    graph_bs = run.engine.sglang.extra_server_args  # slime's --sglang-cuda-graph-bs, as SGLang's own flag
    start = graph_bs.index("--cuda-graph-bs") + 1
    values = list(takewhile(lambda a: not a.startswith("--"), graph_bs[start:]))
    assert values == [str(b) for b in [1, 2, 4, 8, *range(16, 257, 8)]]
    moe = run.policy.moe
    assert (moe.token_dispatcher_type, moe.router_dtype, moe.token_drop_policy, moe.grouped_gemm,
            moe.permute_fusion) == ("alltoall", "fp32", "probs", True, True)
    # slime's GRPO: its clip [0.8, 1.28], no veto (slime/utils/arguments.py:899-900)
    algo = run.algo
    assert (algo.name, algo.clip_low, algo.clip_high, algo.veto_threshold) == ("grpo", 0.2, 0.28, None)

    c = run.memory
    assert (c.tp, c.dp, c.ep, c.expert_tp, c.expert_dp, c.params_dtype) == (4, 2, 8, 1, 1, "bf16")
    plan = plan_memory(c)
    plan.check()  # fits: raises otherwise
    # hand count from config.json: h 2048, 48 layers, 32 q heads / 4 kv heads of 128, 128 experts of 768, vocab
    # 151936 padded to a multiple of 128 x TP 4 = 152064, untied
    h, layers, vocab = 2048, 48, 152064
    split = layers * (h * (4096 + 2 * 512) + 4096 * h) + 2 * vocab * h  # attention, embedding + output layer
    whole = layers * (2 * h + 2 * 128 + 128 * h) + h  # norms, q/k norms, router; final norm
    dense = split // 4 + whole
    experts = layers * 128 * 3 * h * 768 // (1 * 8)  # whole experts (ETP 1), 16 of 128 per GPU (EP 8)
    rows = {r.part: r.bytes for r in plan.rows() if r.phase == "training"}
    assert rows["params (bf16)"] == (dense + experts) * 2
    assert rows["Adam moments (fp32 x2)"] == dense * 8 // 2 + experts * 8 // 1  # over DP 2 / expert-DP 1
    assert plan.total("training") < 141 * GIB
    state = (rows["fp32 main params"] + rows["Adam moments (fp32 x2)"]) / GIB
    assert "accepted, not applied (megamu does not run megatron-core's hybrid device optimizer)" in out
    assert f"{state:.1f} GiB per GPU here" in out
    assert "--algorithm grpo: slime's GRPO, ratio clipped to [0.8, 1.28], no negative-advantage veto" in out
    assert "trainer TP 4 + SP x DP 2, EP 8, ETP 1 x EDP 1 (16 of 128 experts per GPU)" in plan.table()
    for line in out.splitlines():
        assert not line.startswith("error")


def test_the_same_launch_with_algorithm_mu_grpo_runs_mu_grpo(tmp_path, monkeypatch, capsys):
    run, out = launch(tmp_path, monkeypatch, capsys, "--algorithm", "mu-grpo")
    paper = AlgoConfig.preset("mu-grpo")
    assert (run.algo.name, run.algo.clip_low, run.algo.clip_high, run.algo.veto_threshold) == (
        "mu-grpo", paper.clip_low, paper.clip_high, paper.veto_threshold)
    assert "warning: --eps-clip 0.2 --eps-clip-high 0.28 (slime's GRPO clip) not applied" in out
    plan_memory(run.memory).check()


def test_a_cpu_run_notes_each_gpu_only_setting_and_builds_the_cpu_layers(tmp_path, monkeypatch, capsys):
    """On CPU the MoE layers run megatron's allgather dispatcher and SequentialMLP experts, without fused
    permutation (megamu.model.config.moe_impl); the GPU-only flags are accepted and each named in a note, and the
    optimiser-offload flags say the CPU optimiser is on the host already."""
    from megamu.model.config import moe_config_fields
    from megamu.runtime.device import Device
    from tests.tiny import save_tiny_model

    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    hf = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=1, vocab_size=300)
    run = parse_args(["--hf-checkpoint", str(hf), "--save", str(tmp_path / "run"), "--num-stages", "2",
                      "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--moe-permute-fusion",
                      "--moe-router-dtype", "fp64", "--moe-layer-freq", "1", "--moe-router-score-function", "softmax",
                      "--optimizer-cpu-offload"], device=Device("cpu"))
    out = capsys.readouterr().out
    for flag in ("--moe-token-dispatcher-type alltoall: a CPU run dispatches with allgather",
                 "--moe-grouped-gemm: a CPU run computes one MLP per expert",
                 "--moe-permute-fusion: Transformer Engine's fused permutation, GPU runs only",
                 "--optimizer-cpu-offload: accepted, not applied", "a CPU run keeps its optimiser on the host"):
        assert flag in out, out
    from megamu.model import ModelArch

    arch = ModelArch.from_hf(hf)
    cpu = moe_config_fields(arch, "local", settings=run.policy.moe)
    assert (cpu["moe_token_dispatcher_type"], cpu["moe_grouped_gemm"], cpu["moe_permute_fusion"],
            cpu["moe_router_dtype"]) == ("allgather", False, False, "fp64")
    gpu = moe_config_fields(arch, "transformer_engine", settings=run.policy.moe)
    assert (gpu["moe_token_dispatcher_type"], gpu["moe_grouped_gemm"], gpu["moe_permute_fusion"]) == \
        ("alltoall", True, True)
