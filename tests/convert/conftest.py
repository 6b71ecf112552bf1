import pytest

from tests.tiny import save_tiny_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
# name -> (family, overrides). vocab 300: at TP=2 both vocab shards hold real rows and the last one padding.
CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": False}),
}


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """name -> HF folder of a tiny random model (GQA 4/2 heads, odd vocab)."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {name: save_tiny_model(root / name, fam, seed=i, vocab_size=300, **kw)
            for i, (name, (fam, kw)) in enumerate(CASES.items())}
