"""Colocated GRPO with servers that share the trainer's GPUs (--sglang-memory-saver): the servers give their memory
back while the trainer trains and take it again around each push, in the order slime's --offload-rollout uses.
Checked on the calls a schema server records, which also refuses a push while its weights are released and a
generation while anything is."""

import pytest

from tests.e2e.runs import MU, STAGES, flags, launch, records
from tests.engines.schema_server import SchemaServer

RELEASE = "/release_memory_occupation:kv_cache,weights,cuda_graph"


@pytest.mark.slow
def test_colocated_servers_release_before_training_and_resume_before_generating(tiny, tmp_path):
    from megamu.engines.local import LocalEngine

    server = SchemaServer(LocalEngine(str(tiny)), api_key="secret")
    server.memory_saver = True
    try:
        save = tmp_path / "run"
        launch(flags(tiny, save, "--rollout-engine", "sglang", "--sglang-url", server.url, "--rollout-mode",
                     "colocated", "--weight-sync", "disk", "--sglang-memory-saver"), env={"SGLANG_API_KEY": "secret"})
    finally:
        server.close()
    calls = [c for i, c in enumerate(server.calls) if c != "/generate" or server.calls[i - 1] != "/generate"]
    push = "/update_weights_from_disk"
    assert calls == [
        push + "@1",  # a server megamu did not start is given stage 0's export first
        "/generate", RELEASE,  # stage 0's rollout (and the base evaluation), then the trainer's μ updates
        *[c for k in range(1, STAGES) for c in (
            "/resume_memory_occupation:weights", f"{push}@{k * MU}",  # θ_k into the servers' own weight memory
            "/resume_memory_occupation:kv_cache,cuda_graph", "/generate", RELEASE)],  # D_k, then the updates
        "/resume_memory_occupation:weights", f"{push}@{STAGES * MU}",  # the final policy, for its evaluation
        "/resume_memory_occupation:kv_cache,cuda_graph", "/generate"]
    assert len(records(save, "update")) == STAGES * MU
    # each push was probed once the KV cache was back: the servers serve the trainer's weights (fp32 on both sides)
    syncs = records(save, "sync")
    assert [s["stage"] for s in syncs] == list(range(1, STAGES))
    assert all(s["probe_mean_abs_diff"] <= 1e-3 for s in syncs)
