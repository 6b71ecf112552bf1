"""Accuracy of an HF folder on lab-task rows: greedy (held-out accuracy) or sampled at T = 1 (the build's stop rule).

Used by the lab model's build and by bench/fidelity.py on a run's HF exports. The trainer is not involved: this reads
only the exported folder, so it measures what a run wrote, whatever the trainer's internals look like.

    python -m megamu.lab.evaluate --hf-dir RUN/hf/iter_0000128 --data held_out.jsonl
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megamu.lab.task import correct, read_rows


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


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", type=Path, nargs="+", required=True)
    p.add_argument("--data", type=Path, required=True, help="rows written by megamu.lab.task.write_split")
    p.add_argument("--sample", action="store_true", help="one sample at T = 1 per row instead of greedy")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="write {hf_dir: result} as JSON here")
    a = p.parse_args(argv)
    rows = read_rows(a.data)
    results = {}
    for d in a.hf_dir:
        model, tok = load(d)
        results[str(d)] = accuracy(model, tok, rows, greedy=not a.sample, max_new_tokens=a.max_new_tokens).to_json()
        print(json.dumps({str(d): results[str(d)]}), flush=True)
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
