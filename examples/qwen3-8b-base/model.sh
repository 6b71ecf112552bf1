# Qwen3-8B-Base (Qwen/Qwen3-8B-Base) on 4xH200. Sourced by the run scripts beside it.
MODEL_NAME=qwen3-8b-base
HF_NAME=Qwen3-8B-Base  # folder under $MODEL_ROOT (download Qwen/Qwen3-8B-Base there beforehand)
CONTEXT_LEN=8192  # prompt + response tokens; 8k (App. B)
TP=2  # TP 2 x DP 2: a 7-8B actor with its fp32 Adam state fits with room for long sequences
MICRO_BATCH_SIZE=2
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
