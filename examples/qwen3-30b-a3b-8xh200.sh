#!/usr/bin/env bash
# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B, mixture of experts: 48 layers, 128 experts, top-8, 3.3B of 30.5B parameters
# active per token) on 8xH200: μ-GRPO, μ = 1024 over 4 stages, 8k context, the paper's App. B settings (../common.sh).
#
# Trainer: TP 1 x EP 8 x DP 8. The 128 experts are split over the 8 GPUs (16 each, Megatron's
# --expert-model-parallel-size) and their Adam state over the expert-data-parallel ranks (DP / EP = 1); attention,
# embeddings and router are replicated over DP 8 and their optimiser state sharded 8 ways. TP stays 1: megatron-core
# trains MoE layers at TP > 1 only with sequence parallelism, which megamu does not run. The experts' count, top-k and
# width come from the HF config; on GPU megamu runs them as Transformer Engine grouped GEMMs with the alltoall token
# dispatcher (megamu.model.config.moe_impl). Full recompute keeps the activations of an 8k row within the H200.
# Rollouts: one SGLang server per GPU at TP 1 (the whole 30.5B model in bf16 is ~57 GiB, leaving the rest for the KV
# cache), while the trainer's state is offloaded (staged mode).
#
#   bash examples/qwen3-30b-a3b-8xh200.sh --dry-run   # validate, print the plan and the memory plan; no GPU, no weights
#   bash examples/qwen3-30b-a3b-8xh200.sh             # torchrun --nproc_per_node 8 pretrain_mu_grpo.py ...
# Environment as in ../common.sh (HF_CHECKPOINT, MODEL_ROOT, DATA_DIR, PROMPT_DATA, RUN_ROOT, SAVE_DIR, SGLANG_URL, ...).
MODEL_NAME=qwen3-30b-a3b
HF_NAME=Qwen3-30B-A3B
CONTEXT_LEN=8192
TP=1
EP=8
MICRO_BATCH_SIZE=1
GPUS=${GPUS:-8}
args=()
for a in "$@"; do
    if [[ "$a" == --dry-run ]]; then DRY_RUN=1; else args+=("$a"); fi
done
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
run_mu_grpo --expert-model-parallel-size "$EP" --recompute-granularity full ${args[@]+"${args[@]}"}
