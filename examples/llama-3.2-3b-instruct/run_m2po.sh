#!/usr/bin/env bash
# Llama-3.2-3B-Instruct: M2PO at μ = 1024, threshold 0.04 (baseline). 4096 updates x 32 prompts x 8 samples, 4xH200.
# DRY_RUN=1 bash $0 prints the plan without GPUs or weights; extra arguments override flags. See ../common.sh.
source "$(dirname "${BASH_SOURCE[0]}")/model.sh"
run_m2po "$@"
