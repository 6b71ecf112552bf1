import pytest

from tests.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()
