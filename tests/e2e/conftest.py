"""The tiny model and the uninterrupted reference run, made once per pytest worker: several modules read the same
run (the kill/resume, two-rank, offload, preset and reward tests compare against it) instead of launching their own."""

from pathlib import Path

import pytest

from tests.e2e.runs import flags, launch
from tests.tiny import save_tiny_model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama", "llama", seed=3)


@pytest.fixture(scope="session")
def reference(tiny, tmp_path_factory) -> Path:
    """`flags(tiny, save)` run to its end: μ-GRPO (the default algorithm), 2 stages of μ = 4, staged, one rank."""
    save = tmp_path_factory.mktemp("runs") / "reference"
    proc = launch(flags(tiny, save))
    (save.parent / "stdout.txt").write_text(proc.stdout)
    return save
