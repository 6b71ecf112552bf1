#!/usr/bin/env bash
# Qwen2.5-Coder-7B on code_contests: μ-GRPO, μ = 1024 over 4 stages. 4096 updates x 16 prompts x 8 samples, 4xH200.
# DRY_RUN=1 bash $0 prints the plan without GPUs or weights; extra arguments override flags. See ../common.sh.
source "$(dirname "${BASH_SOURCE[0]}")/model.sh"
run_mu_grpo "${CODE_FLAGS[@]}" "$@"
