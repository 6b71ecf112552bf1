#!/usr/bin/env bash
# Qwen2.5-Math-7B: async GRPO (Table 2 baseline): 4096 updates x 32 prompts x 8 samples, trainer on 2 GPUs while SGLang
# generates on the other 2; weights pushed every 4 updates, policy lag capped at 4 updates, clip 0.2.
# DRY_RUN=1 bash $0 prints the plan without GPUs or weights; extra arguments override flags. See ../common.sh.
source "$(dirname "${BASH_SOURCE[0]}")/model.sh"
run_grpo_async "$@"
