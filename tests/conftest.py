import pytest


@pytest.fixture(scope="session")
def distributed():
    """A world of one (gloo) with megatron's TP=1 groups, shared by every in-process test that needs one."""
    import torch

    from megamu import parallel
    from megamu.device import Device

    torch.set_num_threads(1)
    parallel.init_distributed(tensor_model_parallel_size=1, seed=0, device=Device.detect())
    yield
    parallel.destroy_distributed()
