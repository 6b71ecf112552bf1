"""A real SGLang 0.5.23 CPU server killed (SIGKILL) mid-stage: megamu finds it dead, restarts it from the stage's folder
(and, after an in-memory push, pushes that again) and the stage completes with every group exactly once
(megamu/engines/sglang/health.py).

The CPU build cannot honour sampling seeds (--enable-deterministic-inference needs other kernels), so the dataset is
checked against what must hold whatever was sampled: each prompt's group once, with its sample indices, the manifest
complete and checksummed, and each behaviour log-prob equal to transformers' teacher-forced log_softmax of the same
tokens (an independent reference). The restart time is printed (``-s``) for the issue's note."""

import os
import signal
import threading
import time

import torch
from transformers import AutoModelForCausalLM

from megamu.data.prompts import PromptRecord
from megamu.engines.sglang.client import SGLangEngine
from megamu.engines.types import SamplingParams
from megamu.rollout.dataset import StageDataset, shard_name
from megamu.rollout.phase import run_rollout_phase
from tests.processes import pid_alive
from tests.sglang_real.cpu_build import cpu_config
from tests.tiny import build_char_tokenizer, save_tiny_model
from tests.torchrun import server_ports

ATOL = 1e-4


class LengthScorer:
    def score(self, responses, truths):
        return [float(len(r) % 3 == 0) for r in responses]


def _killed_mid_stage(tmp_path, push: str):
    """A stage through one real server killed after the first shard; ``push``: "none" (the launch folder), or
    "memory": another model's weights pushed in memory before the stage, which the restarted server must get again
    (from the engine's host copy) before it takes requests. Returns (dataset, the served model, events, prompts)."""
    torch.set_num_threads(1)
    model_dir = str(save_tiny_model(tmp_path / "base", "llama", seed=0))
    served = model_dir
    engine = SGLangEngine(model_dir, cpu_config(server_ports(), tmp_path / "logs", probe_period_s=1.0,
                                                probe_timeout_s=10.0))
    pid, out, fault = engine.pids[0], tmp_path / "stage", {}
    if push == "memory":
        served = str(save_tiny_model(tmp_path / "pushed", "llama", seed=5))
        state = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(served).state_dict().items()}
        engine.update_weights(state_dict=state, version=4)

    def kill_after_first_shard():
        while not (out / shard_name(0)).exists():
            time.sleep(0.01)
        fault["t"] = time.time()
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_after_first_shard, daemon=True).start()
    prompts = [PromptRecord(i, [5 + i % 50, 9, 14], "0", "") for i in range(60)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3)
    try:
        m = run_rollout_phase(engine, prompts, out, sampling=sp, n_samples=2, scorer=LengthScorer(),
                              tokenizer=build_char_tokenizer(), stage=0, groups_per_shard=2, max_in_flight=2)
        events, new_pid = list(engine.health_events), engine.pids[0]
    finally:
        engine.shutdown()
    assert not pid_alive(pid) and new_pid != pid and not pid_alive(new_pid)
    dead, restarted = events[0], events[1]
    assert dead["event"] == "dead" and "exited with status -9" in dead["why"] and restarted["event"] == "restarted"
    assert m.extra["servers"][0]["restarts"] == 1
    print(f"\nreal server ({push} push): kill detected after {dead['time'] - fault['t']:.2f}s, restarted in "
          f"{restarted['seconds']:.1f}s, {dead['moved']} request(s) moved")
    return StageDataset(out), served, prompts  # checksums verified against the manifest


def _check(ds: StageDataset, served: str, prompts) -> None:
    """Each group once with its sample indices; each behaviour log-prob is transformers' teacher-forced one of the
    model the server should serve (the launch folder's, or the pushed model's: ~1 nat apart)."""
    assert [[(s.prompt_id, s.sample_index) for s in g] for g in ds.groups()] == [[(p.prompt_id, 0), (p.prompt_id, 1)]
                                                                                 for p in prompts]
    model = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32).eval()
    for s in ds.samples():
        prompt = prompts[s.prompt_id].prompt_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + s.response_ids])).logits[0, len(prompt) - 1 : -1].double()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.response_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(s.behaviour_logprobs, dtype=torch.float64), expected, atol=ATOL,
                                   rtol=0)


def test_killed_real_server_is_restarted_and_the_stage_completes(tmp_path):
    _check(*_killed_mid_stage(tmp_path, "none"))


def test_a_real_server_restarted_after_an_in_memory_push_serves_the_push(tmp_path):
    """Colocated mode's default: the weights came in memory, so the launch folder is stale; the restarted server is
    given the push again (a broadcast group of its own, from the host copy) before it generates."""
    _check(*_killed_mid_stage(tmp_path, "memory"))
