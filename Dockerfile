# GPU image for megamu on H200 clusters: CUDA 12.9 + PyTorch, SGLang (+ router), megatron-core, Transformer Engine,
# optional apex, and megamu itself.
#
#   docker build -t megamu:gpu .                             # from the repository root
#   docker build -t megamu:gpu --build-arg WITH_APEX=1 .     # + apex's fused kernels (long compile)
#   docker run --gpus all --ipc=host --network=host -v /models:/models -v /data:/data -v /runs:/runs megamu:gpu \
#       bash examples/qwen3-8b-base/run_mu_grpo.sh
#
# Versions are pinned here and checked against setup.py and docs/cluster.md by tests/tools/test_dockerfile.py.
# They are the combination slime builds and runs in its CI (THUDM/slime @624b824a898ab0ec1fcb4d373004c7f3852bf515):
#   - base: slimerl/sglang:v0.5.15.post1-cu129 (docker/Dockerfile:1-2, tag from docker/justfile `release-primary`;
#     docker/README.md: "sglang v0.5.15.post1 ... megatron dev 1dcf0dafa884..."); .github/workflows/pr-test.yml runs
#     its tests in the image built from it (slimerl/slime:latest);
#   - torch 2.11.0: what the sglang 0.5.15.post1 wheel pins (Requires-Dist: torch==2.11.0), already in the base;
#   - transformer-engine 2.16.1: docker/Dockerfile:60, the CUDA 12 branch (`transformer_engine[pytorch]==2.16.1`,
#     --no-build-isolation against the base's torch);
#   - megatron-core: Megatron-LM at 1dcf0dafa884ad52ffb243625717a3471643e087 (docker/Dockerfile:7 and :68-70).
# slime also applies its own patches to SGLang and Megatron-LM (docker/patch/latest/); megamu uses neither patch.
# SGLang 0.5.15.post1 lacks /begin_weight_update and /end_weight_update, which 0.5.23 requires around in-memory
# updates: megamu opens the session only where the server has it (engines/sglang/pool.py begin_weight_update).

ARG BASE_IMAGE=slimerl/sglang:v0.5.15.post1-cu129
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.11.0
ARG SGLANG_VERSION=0.5.15.post1
ARG SGLANG_ROUTER_VERSION=0.3.2
ARG MEGATRON_COMMIT=1dcf0dafa884ad52ffb243625717a3471643e087
# What megatron/core/package_info.py says at MEGATRON_COMMIT (MAJOR 0, MINOR 16, PATCH 0, PRE_RELEASE 'rc0').
ARG MEGATRON_CORE_VERSION=0.16.0rc0
ARG TRANSFORMER_ENGINE_VERSION=2.16.1
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

# The base brings SGLang and its torch: check they are the pinned ones, then freeze them as constraints so that
# nothing below can silently move those pins.
RUN python -c "import torch, sglang; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__; \
assert sglang.__version__ == '${SGLANG_VERSION}', sglang.__version__" \
    && pip install "sglang-router==${SGLANG_ROUTER_VERSION}" \
    && pip list --format=freeze | grep -v "^-e\|@ file" > /opt/constraints.txt

# Transformer Engine as slime installs it on CUDA 12: the PyTorch extension compiled against the base's torch.
RUN pip install -c /opt/constraints.txt --no-build-isolation \
        "transformer-engine[pytorch]==${TRANSFORMER_ENGINE_VERSION}" \
    && python -c "import transformer_engine.pytorch"

# megatron-core from Megatron-LM at slime's commit (no slime patch), then pinned in the constraints: setup.py's
# `megatron-core>=0.16.0rc0` admits the checkout's prerelease, and the constraint keeps any later install from
# swapping it for a release. tools/check_megatron_pin.py fails the build if megatron.core is not the checkout.
COPY tools/check_megatron_pin.py /opt/check_megatron_pin.py
RUN git clone https://github.com/NVIDIA/Megatron-LM.git /opt/Megatron-LM \
    && cd /opt/Megatron-LM && git checkout ${MEGATRON_COMMIT} \
    && pip install -c /opt/constraints.txt --no-deps -e . \
    && echo "megatron-core==${MEGATRON_CORE_VERSION}" >> /opt/constraints.txt \
    && python /opt/check_megatron_pin.py --source /opt/Megatron-LM --commit ${MEGATRON_COMMIT} \
        --version ${MEGATRON_CORE_VERSION}

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
    && python /opt/check_megatron_pin.py --source /opt/Megatron-LM --commit ${MEGATRON_COMMIT} \
        --version ${MEGATRON_CORE_VERSION} \
    && python -c "import megamu, megatron.core, sglang, sglang_router, transformer_engine; print('megamu image ok')"

CMD ["bash"]
