import pytest


@pytest.fixture
def server(tiny_llama):
    """A schema-checking stand-in for an SGLang server that generates with the local engine."""
    from megamu.engines.local import LocalEngine
    from tests.engines.schema_server import SchemaServer

    srv = SchemaServer(LocalEngine(tiny_llama))
    yield srv
    srv.close()
