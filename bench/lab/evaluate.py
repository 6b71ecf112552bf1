"""Accuracy of an HF folder on lab-task rows: greedy (held-out accuracy) or sampled at T = 1 (the build's stop rule).

Used by the lab model's build and by bench/fidelity.py on a run's HF exports (bench/fidelity.py is the lab's one
command line). The trainer is not involved: this reads only the exported folder, so it measures what a run wrote,
whatever the trainer's internals look like. It decodes with transformers rather than megamu's local engine on purpose:
the committed summaries' sampled pass@1 was drawn from this decoder's random stream (one generator, batches by prompt
length), which the engine's sampler does not reproduce.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.lab.task import correct


@dataclass
class Accuracy:
    accuracy: float
    n: int
    mean_length: float  # response tokens, EOS excluded
    truncated: float  # fraction of replies that hit max_new_tokens without EOS

    def to_json(self) -> dict:
        return asdict(self)


def _prompt_ids(tokenizer, text: str) -> list[int]:
    # the trainer's rendering of a verl-layout row (megamu.data.prompts.render_prompt): chat template, no extra text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(chat, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def accuracy(model, tokenizer, rows: list[tuple[str, str]], *, greedy: bool, max_new_tokens: int = 64,
             batch_size: int = 128, seed: int = 0) -> Accuracy:
    """Score one reply per row. Rows are batched by prompt length, so no padding enters the attention."""
    model.eval()
    eos = tokenizer.eos_token_id
    gen = torch.Generator().manual_seed(seed)
    by_len: dict[int, list[int]] = {}
    ids = [_prompt_ids(tokenizer, p) for p, _ in rows]
    for i, x in enumerate(ids):
        by_len.setdefault(len(x), []).append(i)
    hits, lengths, truncated = 0, 0, 0
    for idx_all in by_len.values():
        for start in range(0, len(idx_all), batch_size):
            idx = idx_all[start:start + batch_size]
            out = _decode(model, torch.tensor([ids[i] for i in idx]), eos, greedy, max_new_tokens, gen)
            for i, toks in zip(idx, out):
                stopped = eos in toks
                toks = toks[:toks.index(eos)] if stopped else toks
                hits += correct(tokenizer.decode(toks), rows[i][1])
                lengths += len(toks)
                truncated += not stopped
    n = len(rows)
    return Accuracy(hits / n, n, lengths / n, truncated / n)


def sampled_pass_at_1(model, tokenizer, rows: list[tuple[str, str]], k: int, *, seed: int = 0,
                      max_new_tokens: int = 64) -> Accuracy:
    """Sampled pass@1 (the paper's metric): ``k`` replies per row at T = 1, scored one by one; ``n`` counts replies.
    The same ``seed`` for every checkpoint, so two checkpoints are compared on the same random stream."""
    return accuracy(model, tokenizer, [r for r in rows for _ in range(k)], greedy=False, seed=seed,
                    max_new_tokens=max_new_tokens)


def _decode(model, prompt: torch.Tensor, eos: int, greedy: bool, max_new: int, gen: torch.Generator) -> list[list[int]]:
    """Plain KV-cache decoding at T = 1 (no top-k/top-p, as in the trainer's rollouts) or greedy."""
    out = model(input_ids=prompt, use_cache=True)
    past, logits = out.cache, out.logits[:, -1].float()
    tokens = torch.empty(prompt.shape[0], 0, dtype=torch.long)
    done = torch.zeros(prompt.shape[0], dtype=torch.bool)
    for _ in range(max_new):
        if greedy:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        done |= nxt == eos
        if bool(done.all()):
            break
        out = model(input_ids=nxt[:, None], cache=past, use_cache=True)
        past, logits = out.cache, out.logits[:, -1].float()
    return tokens.tolist()


def load(hf_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(hf_dir)
