#!/usr/bin/env bash
# Qwen2.5-Math-7B: GRPO at μ = 1024, staged, clip 0.2, no veto (baseline). 4096 updates x 32 prompts x 8 samples, 4xH200.
# DRY_RUN=1 bash $0 prints the plan without GPUs or weights; extra arguments override flags. See ../common.sh.
source "$(dirname "${BASH_SOURCE[0]}")/model.sh"
run_grpo_high_staleness "$@"
