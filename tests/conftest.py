"""tests/ mirrors megamu/: one folder per megamu package (tests/<package>/), each test file in the folder of the
package whose code it tests. A loose module's tests sit with the package that holds it for the run: megamu/mode.py's
in tests/config (the plan, megamu/config/plan.py, carries the Mode and answers its cadences; issue 52 item 1).
Cross-cutting, of no one package (tests/test_structure.py reads this list and checks the tree against it):

    e2e/                 whole runs of pretrain_mu_grpo.py
    lab/                 the fidelity lab (bench/lab/, bench/fidelity.py)
    gpu/                 GPU twins of CPU tests (skipped without CUDA)
    sglang_real/         the real SGLang server tier (`make test-sglang` runs this path)
    tools/               the scripts of tools/ and bench/learning.py
    fixtures/            the models' public configs the tests read
    test_structure.py    the whole tree's shape
    test_warm_launch.py  tests/warm_launch.py, a helper of the tests themselves

The helpers every folder shares sit here too: tiny.py, numerics.py, ports.py, processes.py, torchrun.py,
warm_launch.py, wandb_records.py, cpu_cuda_shim.py, config_flags.py (a RunConfig written back as flags)."""

import pytest

from tests.tiny import save_tiny_model


@pytest.fixture(scope="session")
def distributed():
    """A world of one (gloo) with megatron's TP=1 groups, shared by every in-process test that needs one."""
    import torch

    from megamu.runtime import parallel
    from megamu.runtime.device import Device

    torch.set_num_threads(1)
    parallel.init_distributed(tensor_model_parallel_size=1, seed=0, device=Device.detect())
    yield
    parallel.destroy_distributed()


# Tiny HF models on disk, made once per session (per xdist worker) for the engine and rollout tests.
@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0))


@pytest.fixture(scope="session")
def tiny_llama_2(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_llama_2"), "llama", seed=1))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1))


@pytest.fixture(autouse=True)
def _one_sandbox_test_at_a_time(request):
    """Tests marked ``sandbox`` run while no other pytest worker runs one (tests/reward/sandbox_checks.py)."""
    if request.node.get_closest_marker("sandbox") is None:
        yield
        return
    from tests.reward.sandbox_checks import sandbox_exclusive

    with sandbox_exclusive():
        yield
