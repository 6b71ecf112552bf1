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
