import pytest

from tests.tiny import save_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1))


@pytest.fixture
def server(tiny_llama):
    """A schema-checking stand-in for an SGLang server that generates with the local engine."""
    from megamu.engines.local import LocalEngine
    from tests.rollout.schema_server import SchemaServer

    srv = SchemaServer(LocalEngine(tiny_llama))
    yield srv
    srv.close()
