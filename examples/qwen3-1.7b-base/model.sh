# Qwen3-1.7B-Base (Qwen/Qwen3-1.7B-Base) on 4xH200. Sourced by the run scripts beside it.
MODEL_NAME=qwen3-1.7b-base
HF_NAME=Qwen3-1.7B-Base  # folder under $MODEL_ROOT (download Qwen/Qwen3-1.7B-Base there beforehand)
CONTEXT_LEN=8192  # prompt + response tokens; 8k (App. B)
TP=1  # TP 1 x DP 4: a <=3B actor fits one H200 whole
MICRO_BATCH_SIZE=4
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
