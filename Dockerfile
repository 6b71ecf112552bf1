# GPU image for megamu on H200 clusters: CUDA 13 + PyTorch, SGLang (+ router), megatron-core, Transformer Engine,
# optional apex, and megamu itself.
#
#   docker build -t megamu:gpu .                             # from the repository root
#   docker build -t megamu:gpu --build-arg WITH_APEX=1 .     # + apex's fused kernels (long compile)
#   docker run --gpus all --ipc=host --network=host -v /models:/models -v /data:/data -v /runs:/runs megamu:gpu \
#       bash examples/qwen3-8b-base/run_mu_grpo.sh
#
# Versions are pinned here and checked against setup.py's extras by tests/tools/test_dockerfile.py. sglang 0.5.23
# pins torch==2.14.1 built for CUDA 13, so the base image carries exactly that torch; the weight-update API of SGLang
# changes between releases, so its version moves only together with megamu/rollout.

ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-devel
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.14.1
ARG SGLANG_VERSION=0.5.23
ARG SGLANG_ROUTER_VERSION=0.3.2
ARG MEGATRON_CORE_VERSION=0.16.1
# megatron-core 0.16.1 is tested with transformer-engine >=2.9.0a0,<2.12.0 (its "dev" extra); keep the two together.
ARG TRANSFORMER_ENGINE_VERSION=2.11.0
ARG WITH_APEX=0
ARG APEX_REF=10417aceddd7d5d05d7cbf7b0fc2daad1105f8b4
# H200 (and H100) are sm_90; add "10.0" for B200 nodes.
ARG TORCH_CUDA_ARCH_LIST="9.0"
ARG MAX_JOBS=16

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS} \
    NVTE_FRAMEWORK=pytorch

RUN apt-get update \
    && apt-get install -y --no-install-recommends git build-essential ninja-build numactl \
    && rm -rf /var/lib/apt/lists/*

# SGLang first: it pins torch, transformers, flashinfer and its kernels. Later steps install against a constraints
# file frozen right after it, so nothing below can silently move those pins.
RUN pip install "torch==${TORCH_VERSION}" "sglang==${SGLANG_VERSION}" "sglang-router==${SGLANG_ROUTER_VERSION}" \
    && pip list --format=freeze > /opt/constraints.txt

RUN pip install -c /opt/constraints.txt "megatron-core==${MEGATRON_CORE_VERSION}"

# Transformer Engine: the CUDA 13 core wheel plus the PyTorch extension, compiled against the torch installed above.
RUN pip install -c /opt/constraints.txt --no-build-isolation \
        "transformer-engine[pytorch,core-cu13]==${TRANSFORMER_ENGINE_VERSION}" \
    && python -c "import transformer_engine.pytorch"

# apex is optional: megamu runs without it (TE and torch provide the fused ops it needs).
RUN if [ "${WITH_APEX}" = "1" ]; then \
        APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -v --no-build-isolation \
            --config-settings "--build-option=--cpp_ext --cuda_ext --parallel ${MAX_JOBS}" \
            "git+https://github.com/NVIDIA/apex.git@${APEX_REF}"; \
    fi

# megamu last (the layer that changes most). Only what the package needs: no .venv, runs or caches.
WORKDIR /opt/megamu
COPY setup.py pyproject.toml pretrain_mu_grpo.py ./
COPY megamu ./megamu
COPY tools ./tools
COPY examples ./examples
RUN pip install -c /opt/constraints.txt -e ".[gpu]" \
    && python -c "import megamu, megatron.core, sglang, sglang_router, transformer_engine; print('megamu image ok')"

CMD ["bash"]
