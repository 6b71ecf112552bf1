# Qwen2.5-Coder-7B (Qwen/Qwen2.5-Coder-7B) on code_contests, 4xH200 (§5.1, App. B.2). Sourced by the run scripts beside it.
MODEL_NAME=qwen2.5-coder-7b
HF_NAME=Qwen2.5-Coder-7B  # folder under $MODEL_ROOT (download Qwen/Qwen2.5-Coder-7B there beforehand)
CONTEXT_LEN=8192  # prompt + response tokens; 8k (App. B.2)
TP=2  # TP 2 x DP 2: a 7-8B actor with its fp32 Adam state fits with room for long sequences
MICRO_BATCH_SIZE=2
# code_contests rows made by tools/convert_code_data.py ({"problem", "tests"}); PROMPT_DATA overrides.
PROMPT_DATA=${PROMPT_DATA:-${DATA_DIR:-/data}/code_contests.jsonl}
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
# The coding setting: the main experiments' flags, except B_mini = 16 prompt groups per update, and the sandboxed
# code reward (all tests pass -> 1). Contest statements are long: 2048 prompt + 6144 response tokens = the 8k context.
CODE_FLAGS=(--reward code --code-timeout 10 --prompts-per-update 16
            --max-prompt-length 2048 --rollout-max-response-len 6144)
