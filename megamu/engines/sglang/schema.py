"""The /generate schema as megamu speaks it: one sample's ``sampling_params`` and one result read back as a sample
(field meanings: notes/sglang.md), and the error every SGLang failure becomes."""

from __future__ import annotations

from megamu.engines.types import GeneratedSample, SamplingParams


class SGLangError(RuntimeError):
    """A server that failed to start, or a request that failed after its retries; the message says which."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status of a refused request, if that is what failed


def sampling_payload(sp: SamplingParams, seed: int | None = None) -> dict:
    """SGLang ``sampling_params`` of one sample. The seed is cut to 31 bits: some SGLang releases hold it in int32."""
    payload = {
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else -1,
        "max_new_tokens": sp.max_new_tokens,
        "stop_token_ids": list(sp.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token: the policy must learn to emit it
    }
    if seed is not None:
        payload["sampling_seed"] = seed & 0x7FFFFFFF
    return payload


def parse_sample(result: dict, prompt_id: int, sample_index: int, stop_ids=()) -> GeneratedSample:
    """One SGLang result (``meta_info.output_token_logprobs`` = [[logprob, token_id, text], ...]) as a sample.

    Ids and log-probs both come from ``output_token_logprobs``, so there is exactly one log-prob per id whatever
    SGLang trims from ``output_ids``. Some SGLang releases check the length limit before the stop tokens, so a reply
    whose last allowed token is a stop token comes back as "length"; it is complete, and LocalEngine calls it "stop":
    so do we.
    """
    meta = result.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise SGLangError(f"response for prompt {prompt_id} has no meta_info.output_token_logprobs "
                          "(was return_logprob dropped by a proxy?)")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    ids = [int(p[1]) for p in pairs]
    if kind == "length" and ids and ids[-1] in stop_ids:
        kind = "stop"
    version = meta.get("weight_version")
    return GeneratedSample(
        prompt_id=prompt_id,
        sample_index=sample_index,
        output_ids=ids,
        output_logprobs=[float(p[0]) for p in pairs],
        finish_reason=kind if kind in ("stop", "length") else "abort",
        weight_version=None if version is None else str(version),
    )
