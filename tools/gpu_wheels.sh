#!/usr/bin/env bash
# Wheels that tools/gpu_check.py needs beyond the lent GPU machine's stock image (Python 3.12, torch 2.11 + CUDA 13,
# transformers 5.17, no network there), downloaded here for Python 3.12 x86-64 into .whl/ (git-ignored), which
# travels with the tree (at most 64 MiB). transformer-engine and SGLang are too big: the check uses megamu's local
# spec + torch SDPA and the in-process engine instead.
#
#   bash tools/gpu_wheels.sh            (or: make gpu-wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${WHEEL_DIR:-.whl}
LIMIT_MIB=64
PIP=${PIP:-.venv/bin/python -m pip}
# --no-deps: only what the image lacks; each line's dependencies are listed explicitly.
WHEELS=(
    megatron-core==0.16.1              # its own deps (numpy, packaging) are on the image
    math-verify==0.9.0                 # reward
    latex2sympy2_extended==1.11.0      # math-verify's parser (sympy comes with torch)
    antlr4-python3-runtime==4.13.2     # latex2sympy2_extended's runtime
    pyarrow==21.0.0                    # rollout shards (parquet)
)
rm -rf "$OUT" && mkdir -p "$OUT"
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d "$OUT" "${WHEELS[@]%%#*}"
size=$(du -sm "$OUT" | cut -f1)
ls -la "$OUT"
echo "$OUT: ${size} MiB of wheels (limit ${LIMIT_MIB} MiB)"
if ((size > LIMIT_MIB)); then
    echo "error: $OUT is over ${LIMIT_MIB} MiB and cannot travel with the tree" >&2
    exit 1
fi
