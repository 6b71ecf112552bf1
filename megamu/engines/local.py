"""In-process rollout engine: a transformers model and a hand-written batched sampling loop with a KV cache.

Why not ``model.generate``: we need per-sample seeds that make a sample a pure function of (seed, prompt_id,
sample_index) whatever else shares its batch, exact behaviour log-probs of the temperature-scaled full distribution
(what SGLang returns), and finished rows dropped from the batch so the batch shrinks as replies end. Like SGLang's
radix cache, the prompts' common prefix is prefilled once per batch (on the demo ~90 of ~97 tokens, shared by every
prompt), and a group's samples share its prompt's cache.

Sampling is inverse-CDF with one uniform per step drawn from the sample's own generator, so a sample does not depend
on its batch's other rows except through float rounding: batch shapes and prefill splits change logits in the last
bits, and a token flips when its uniform lands within that distance of a CDF boundary (on the demo's shard, 123-124 of
128 samples are identical between batches of 64 and 128). A resumed rollout regenerates whole shards in the same
batches, so it reproduces the uninterrupted run exactly.
"""

from __future__ import annotations

import functools
import random
import threading
from dataclasses import dataclass, field

import torch

from megamu.engines.types import (
    EngineBase,
    GeneratedSample,
    GenerateRequest,
    SamplingParams,
    check_prompts,
    sample_seed,
)

# transformers' from_pretrained swaps process-wide state while it builds a model (torch.nn.init's functions replaced by
# no-ops in no_init_weights, torch's default dtype) and puts back what it found: two loads in two threads can put the
# no-ops back for good (measured: within 4 pairs of concurrent loads of the tiny model), after which every randomly
# initialised tensor in the process is uninitialised memory. Engines in one process (the schema servers of the tests,
# folder pushes answered in server threads) load one at a time.
_LOAD_LOCK = threading.Lock()


@dataclass
class _Row:
    """One sample being generated."""

    request_index: int
    sample_index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    uniforms: torch.Tensor  # [max_new_tokens] float32, from the sample's own generator
    stop_ids: set[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"


@functools.cache
def _append_layer_class():
    """``DynamicLayer`` appending in place (defined once, on first use: transformers loads lazily in this module)."""
    from transformers.cache_utils import DynamicLayer

    class AppendLayer(DynamicLayer):
        def __init__(self, spare: int):
            super().__init__()
            self.spare = spare
            self.k_buf = self.v_buf = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            n, length = key_states.shape[-2], self.get_seq_length()
            if self.k_buf is None or length + n > self.k_buf.shape[-2]:
                shape = (*key_states.shape[:2], length + n + self.spare, key_states.shape[-1])
                k_buf, v_buf = key_states.new_empty(shape), value_states.new_empty(shape)
                if length:
                    k_buf[..., :length, :], v_buf[..., :length, :] = self.keys, self.values
                self.k_buf, self.v_buf = k_buf, v_buf
                self.device, self.is_initialized = key_states.device, True
            self.k_buf[..., length : length + n, :] = key_states
            self.v_buf[..., length : length + n, :] = value_states
            self.keys, self.values = self.k_buf[..., : length + n, :], self.v_buf[..., : length + n, :]
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.get_seq_length():
                self.k_buf, self.v_buf = self.k_buf[indices], self.v_buf[indices]
                length = self.keys.shape[-2]
                self.keys, self.values = self.k_buf[..., :length, :], self.v_buf[..., :length, :]

    return AppendLayer, DynamicLayer


def append_cache(config, spare: int):
    """A ``DynamicCache`` whose plain full-attention layers append in place into room for ``spare`` more positions.

    transformers' ``DynamicLayer`` concatenates each step's key/value onto the whole cache: on a 2-core CPU that copy
    was a quarter of a decode step (SmolLM2-135M, 64 rows, ~110 cached positions). Here the room is allocated once,
    each step writes one position and attention reads a view of the filled part. Other layer kinds (sliding) stay.
    """
    from transformers import DynamicCache

    append_layer, dynamic_layer = _append_layer_class()
    cache = DynamicCache(config=config)
    cache.layers = [append_layer(spare) if type(layer) is dynamic_layer else layer for layer in cache.layers]
    return cache


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """Tokens all ``prompts`` start with, leaving at least the last token of the shortest one out."""
    shared = min(len(p) for p in prompts) - 1
    for k, tok in enumerate(prompts[0][:shared]):
        if any(p[k] != tok for p in prompts):
            return k
    return shared


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse CDF; return (tokens [B], log-probs [B] of log_softmax(logits / T)).

    ``temperature`` <= 0 means greedy (log-prob then at T = 1). ``top_k`` <= 0 and ``top_p`` >= 1 disable filtering.
    """
    logits = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    # Every pass over [B, vocab] costs about as much as the output layer of a decode step: skip the ones that cannot
    # change anything (x / 1 is x exactly; argmax only for greedy rows).
    logp = torch.log_softmax(logits if bool((temp == 1).all()) else logits / temp[:, None], dim=-1)
    probs = logp.exp()
    vocab = probs.shape[-1]
    k_filters = (top_k > 0) & (top_k < vocab)
    if bool(k_filters.any() or (top_p < 1.0).any()):
        if bool(k_filters.all()):
            # Every row keeps at most max(top_k) tokens: the largest max(top_k) probabilities, sorted, hold every kept
            # token and the top-p prefix within them, without sorting the whole vocabulary at every step (greedy
            # evaluation is top_k = 1).
            probs, order = probs.topk(int(top_k.max()), dim=-1)
        else:
            probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1])[None, :]
        drop_k = (top_k[:, None] > 0) & (rank >= top_k[:, None])
        drop_p = (probs.cumsum(-1) - probs) >= top_p[:, None]  # keep the smallest prefix reaching top_p
        probs = probs.masked_fill(drop_k | drop_p, 0.0)
    else:
        order = None
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:].contiguous()
    pick = torch.searchsorted(cdf, uniforms[:, None] * total, right=True).squeeze(1)
    # u * total can round up to total (u itself can round to 1.0 in float32): searchsorted then runs off the end,
    # and the last index may be a token top-k / top-p removed. Fall back to the last token with probability > 0: the
    # number of CDF entries below the total (the CDF never decreases, so a binary search counts them).
    pick = torch.minimum(pick, torch.searchsorted(cdf, total, right=False).squeeze(1))
    tokens = pick if order is None else order.gather(1, pick[:, None]).squeeze(1)
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


class LocalEngine(EngineBase):
    """Generate with a transformers causal LM in this process (the CPU default; same shapes as SGLangEngine)."""

    name = "local"
    deterministic = True  # each sample is drawn with a generator seeded by sample_seed alone

    def __init__(self, hf_dir: str, *, dtype: torch.dtype = torch.float32, max_batch_size: int = 128,
                 progress: bool = False):
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.progress = progress
        self._load(hf_dir)

    def _load(self, hf_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.hf_dir = str(hf_dir)
        with _LOAD_LOCK:
            self.model = AutoModelForCausalLM.from_pretrained(self.hf_dir, dtype=self.dtype).eval()
        # Like SGLang: stop on the EOS ids of config.json and of generation_config.json (they can differ).
        self.eos_ids = set()
        for eos in (self.model.config.eos_token_id, self.model.generation_config.eos_token_id):
            self.eos_ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        pad = self.model.generation_config.pad_token_id
        self.pad_id = pad if isinstance(pad, int) else min(self.eos_ids, default=0)

    def update_weights(self, hf_dir: str | None = None, state_dict: dict | None = None, *, version=None,
                       probe=None) -> None:
        """Reload from an HF folder, or copy an in-memory state dict with HF parameter names. In-process, the model
        is exactly what it was given, so there is no version or probe to check."""
        if (hf_dir is None) == (state_dict is None):
            raise ValueError("update_weights needs exactly one of hf_dir or state_dict")
        if hf_dir is not None:
            self._load(hf_dir)
            return
        # Check names before copying anything, so a bad dict never leaves the model half-updated.
        expected = set(self.model.state_dict())
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        missing = sorted(expected - set(state_dict) - tied)
        unexpected = sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise ValueError(f"update_weights: state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.model.load_state_dict(state_dict, strict=False)

    def shutdown(self) -> None:
        self.model = None

    def check_requests(self, requests: list[GenerateRequest]) -> None:
        check_prompts(requests, vocab_size=self.model.config.vocab_size, max_input_len=None)

    def generate(self, requests: list[GenerateRequest]) -> list[GeneratedSample]:
        rows: list[_Row] = []
        for i, req in enumerate(requests):
            sp = req.sampling
            if not req.prompt_ids:
                raise ValueError(f"request {i} (prompt_id {req.prompt_id}) has an empty prompt")
            seed = sp.seed if sp.seed is not None else random.getrandbits(63)
            for j in range(sp.n):
                gen = torch.Generator().manual_seed(sample_seed(seed, req.prompt_id, j))
                uniforms = torch.rand(max(sp.max_new_tokens, 1), generator=gen, dtype=torch.float64).float()
                rows.append(_Row(i, j, list(req.prompt_ids), sp, uniforms, self.eos_ids | set(sp.stop_token_ids)))
        # Similar prompt lengths share a batch (less padding); a request's samples stay together so its prompt is
        # prefilled once and the cache copied to its samples.
        order = sorted(range(len(rows)), key=lambda r: (len(rows[r].prompt_ids), rows[r].request_index))
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(rows), desc="generate", unit="sample", leave=False)
        for start in range(0, len(order), self.max_batch_size):
            batch = [rows[r] for r in order[start : start + self.max_batch_size]]
            self._generate_batch(batch)
            if bar is not None:
                bar.update(len(batch))
        if bar is not None:
            bar.close()
        return [
            GeneratedSample(requests[r.request_index].prompt_id, r.sample_index, r.output_ids, r.output_logprobs,
                            r.finish_reason)
            for r in rows
        ]

    def _prefill(self, prompts: list[list[int]], spare: int):
        """Prefill distinct prompts; return (cache, attention mask [U, L], last positions [U], last logits [U, V]).

        Their longest common prefix (a system prompt, a few-shot turn: in the demo ~90 of ~97 tokens, in every prompt
        of a rollout or an evaluation) is computed once and its cache copied to every prompt, as SGLang's radix cache
        does; the suffixes are left-padded after it, which the mask hides. At least one token of each prompt stays in
        the suffix, so every prompt gets its own last-position logits. The cache has room for ``spare`` more positions.
        """
        shared = shared_prefix_length(prompts)
        cache = append_cache(self.model.config, spare)
        if shared:
            self.model(input_ids=torch.tensor([prompts[0][:shared]]), cache=cache, use_cache=True, logits_to_keep=1)
            cache.batch_select_indices(torch.zeros(len(prompts), dtype=torch.long))
        width = max(len(p) for p in prompts) - shared
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.ones((len(prompts), shared + width), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - (len(p) - shared) :] = torch.tensor(p[shared:])
            mask[b, shared : shared + width - (len(p) - shared)] = 0
        pos = (mask.cumsum(-1) - 1).clamp_(min=0)[:, shared:]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                         logits_to_keep=1)
        return out.cache, mask, pos[:, -1], out.logits[:, -1]

    @torch.inference_mode()
    def _generate_batch(self, rows: list[_Row]) -> None:
        # Prefill each distinct request once, then give every sample its own copy of the cache.
        firsts: dict[int, int] = {}
        for r in rows:
            firsts.setdefault(r.request_index, len(firsts))
        uniq = [next(r for r in rows if r.request_index == ri) for ri in firsts]
        spare = max(r.sampling.max_new_tokens for r in rows)
        cache, mask, last_pos, logits = self._prefill([r.prompt_ids for r in uniq], spare)
        expand = torch.tensor([firsts[r.request_index] for r in rows])
        cache.batch_select_indices(expand)
        logits, mask, next_pos = logits[expand], mask[expand], last_pos[expand] + 1

        active = list(rows)
        temp = torch.tensor([r.sampling.temperature for r in active], dtype=torch.float32)
        top_k = torch.tensor([r.sampling.top_k for r in active])
        top_p = torch.tensor([r.sampling.top_p for r in active], dtype=torch.float32)
        step = 0
        while active:
            uniforms = torch.stack([r.uniforms[min(step, len(r.uniforms) - 1)] for r in active])
            tokens, logps = sample_tokens(logits, temp, top_k, top_p, uniforms)
            keep = []
            for b, (r, t, lp) in enumerate(zip(active, tokens.tolist(), logps.tolist())):
                if r.sampling.max_new_tokens <= 0:
                    continue
                r.output_ids.append(t)
                r.output_logprobs.append(lp)
                if t in r.stop_ids:
                    r.finish_reason = "stop"
                elif len(r.output_ids) < r.sampling.max_new_tokens:
                    keep.append(b)
            step += 1
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep)
                cache.batch_select_indices(idx)
                active = [active[b] for b in keep]
                tokens, mask, next_pos = tokens[idx], mask[idx], next_pos[idx]
                temp, top_k, top_p = temp[idx], top_k[idx], top_p[idx]
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=mask.dtype)], dim=1)
            out = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                             cache=cache, use_cache=True)
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
