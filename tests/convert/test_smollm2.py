import pytest
import torch

from megamu.convert import load_hf_into_model
from megamu.model import ModelArch, build_model
from megamu.model.demo_model import DemoModelUnavailable, smollm2_hf_dir
from megamu.runtime.parallel import init_distributed


@pytest.fixture(scope="module")
def smollm2():
    try:
        return smollm2_hf_dir()
    except DemoModelUnavailable as e:
        pytest.skip(f"SmolLM2 demo model unavailable: {e}")


def test_smollm2_logits_and_greedy_continuation_match_transformers(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    with torch.no_grad():  # transformers' greedy decoding with its KV cache
        out = hf(ids, use_cache=True)
        ref_logits, want = out.logits, [out.logits[0, -1].argmax().item()]
        for _ in range(15):
            out = hf(torch.tensor([want[-1:]]), cache=out.cache, use_cache=True)
            want.append(out.logits[0, -1].argmax().item())
    del hf, out

    init_distributed(1)
    arch = ModelArch.from_hf(smollm2)
    model = build_model(arch, perform_initialization=False)
    load_hf_into_model(model, arch, smollm2)
    model.eval()
    seq = torch.cat((ids, torch.tensor([want])), dim=1)
    with torch.no_grad():
        logits = model(seq, torch.arange(seq.shape[1])[None], None)[..., : arch.vocab_size]
    n = ids.shape[1]
    assert (logits[:, :n] - ref_logits).abs().max() <= 1e-4
    # Greedy decoding is deterministic, so our continuation equals transformers' iff, on the same prefixes,
    # our argmax picks every one of its 16 tokens: one forward pass checks all steps.
    got = logits[0, n - 1 : -1].argmax(-1)
    assert got.tolist() == want, (tok.decode(got), tok.decode(want))
