# Qwen2.5-Math-7B (Qwen/Qwen2.5-Math-7B) on 4xH200. Sourced by the run scripts beside it.
MODEL_NAME=qwen2.5-math-7b
HF_NAME=Qwen2.5-Math-7B  # folder under $MODEL_ROOT (download Qwen/Qwen2.5-Math-7B there beforehand)
CONTEXT_LEN=4096  # prompt + response tokens; 4k: the model's maximum context (App. B)
TP=2  # TP 2 x DP 2: a 7-8B actor with its fp32 Adam state fits with room for long sequences
MICRO_BATCH_SIZE=4
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
