# DeepSeek-R1-Distill-Qwen-7B (deepseek-ai/DeepSeek-R1-Distill-Qwen-7B) on 4xH200. Sourced by the run scripts beside it.
MODEL_NAME=deepseek-r1-distill-qwen-7b
HF_NAME=DeepSeek-R1-Distill-Qwen-7B  # folder under $MODEL_ROOT (download deepseek-ai/DeepSeek-R1-Distill-Qwen-7B there beforehand)
CONTEXT_LEN=8192  # prompt + response tokens; 8k (App. B)
TP=2  # TP 2 x DP 2: a 7-8B actor with its fp32 Adam state fits with room for long sequences
MICRO_BATCH_SIZE=2
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
