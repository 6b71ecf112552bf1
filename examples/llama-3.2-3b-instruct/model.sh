# Llama-3.2-3B-Instruct (meta-llama/Llama-3.2-3B-Instruct) on 4xH200. Sourced by the run scripts beside it.
MODEL_NAME=llama-3.2-3b-instruct
HF_NAME=Llama-3.2-3B-Instruct  # folder under $MODEL_ROOT (download meta-llama/Llama-3.2-3B-Instruct there beforehand)
CONTEXT_LEN=8192  # prompt + response tokens; 8k (App. B)
TP=1  # TP 1 x DP 4: a <=3B actor fits one H200 whole
MICRO_BATCH_SIZE=4
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
