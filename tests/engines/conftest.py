import pytest

from tests.tiny import save_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0))


@pytest.fixture(scope="session")
def tiny_llama_2(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_llama_2"), "llama", seed=1))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1))
