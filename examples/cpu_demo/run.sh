#!/usr/bin/env bash
# The CPU demo (what `make demo` runs): pretrain_mu_grpo.py with no flags runs its embedded default, μ-GRPO on
# SmolLM2-135M-Instruct with two-digit additions (flags and numbers: megamu/arguments.py). 2 CPU cores, no GPU.
# DRY_RUN=1 prints the plan only; extra arguments are passed through (e.g. --save runs/my-demo).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    exec "${PYTHON:-python}" pretrain_mu_grpo.py "$@" --dry-run
fi
exec "${PYTHON:-python}" pretrain_mu_grpo.py "$@"
