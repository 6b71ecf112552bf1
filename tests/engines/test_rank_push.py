"""Each trainer rank pushes its own copy of the weights to the server on its GPU (megamu/engines/sglang/rank_push.py).

Reference: slime's colocated update (slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py,
``_send_to_colocated_engine``): the ranks on one engine's GPUs gather their serialized buckets to the rank on the
engine's first GPU, which posts them as ``serialized_named_tensors``, entry i for the engine's TP rank i.

A 4-GPU node placement on a gloo world of 4 ranks (workers/rank_push_worker.py), with one recording HTTP server per
SGLang server. The servers open each payload (CPU tensors travel as shared-memory files named ``/torch_<pid>_...``
by torch's file_system strategy), so each entry's sender is known by its pid: server i must get rank i's own copy
(TP 1), or ranks 2j and 2j + 1's in that order (TP 2), never one rank's copy for all servers as the node-wide push
did.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from megamu.engines.sglang.rank_push import RankTarget, rank_targets
from tests.torchrun import run_torchrun

RANKS = 4
WORKER = Path(__file__).parent / "workers" / "rank_push_worker.py"


def test_rank_targets_on_a_4_gpu_node_and_on_two_nodes():
    urls = ["http://a:1", "http://a:2", "http://a:3", "http://a:4"]
    one = rank_targets([urls, None, None, None], 4, 1)
    assert one == [RankTarget(u, 0, r, (r,)) for r, u in enumerate(urls)]  # each rank: the server on its GPU
    # two nodes of 4 GPUs, servers at TP 2: node 1's local rank 0 (global 4) holds its node's URLs
    two = rank_targets([["http://a:1", "http://a:2"], None, None, None, ["http://b:1", "http://b:2"], None, None, None],
                       4, 2)
    assert [(t.url, t.tp_index, t.source, t.ranks) for t in two] == [
        ("http://a:1", 0, 0, (0, 1)), ("http://a:1", 1, 0, (0, 1)), ("http://a:2", 0, 2, (2, 3)),
        ("http://a:2", 1, 2, (2, 3)), ("http://b:1", 0, 4, (4, 5)), ("http://b:1", 1, 4, (4, 5)),
        ("http://b:2", 0, 6, (6, 7)), ("http://b:2", 1, 6, (6, 7))]
    # fewer servers than GPUs: the GPUs without one push nothing
    assert rank_targets([["http://a:1"], None, None, None], 4, 2)[2:] == [RankTarget(None, 0, 2, (2,)),
                                                                         RankTarget(None, 0, 3, (3,))]
    with pytest.raises(ValueError, match="whole nodes"):
        rank_targets([None] * 6, 4, 1)


class Recorder(BaseHTTPRequestHandler):
    calls: list  # set per server class

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        entry = {"path": self.path, "auth": self.headers.get("Authorization")}
        if self.path == "/update_weights_from_tensor":
            opened = []
            for payload in body["serialized_named_tensors"]:
                raw = base64.b64decode(payload)
                data = ForkingPickler.loads(raw)  # opens the sender's shared-memory file while it waits for us
                flat = data["flattened_tensor"]
                tensors = {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape).clone()
                           for m in data["metadata"]}
                opened.append({"pid": int(re.search(rb"/torch_(\d+)_", raw).group(1)), "tensors": tensors})
            entry.update(opened=opened, version=body["weight_version"], flush=body["flush_cache"])
        self.calls.append(entry)
        out = json.dumps({"success": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def state_dict() -> dict[str, torch.Tensor]:
    """The weights every rank pushes (the same on each, as after the TP all-gathers)."""
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(64, 32, generator=g), "b": torch.randn(300, generator=g),
            "c": torch.randn(16, 16, generator=g)}


@pytest.mark.slow
@pytest.mark.parametrize("server_tp", [1, 2])
def test_each_rank_pushes_its_own_copy_to_the_server_on_its_gpu(tmp_path, server_tp):
    n_servers = RANKS // server_tp
    servers, calls = [], []
    for _ in range(n_servers):
        log: list = []
        handler = type("R", (Recorder,), {"calls": log})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        calls.append(log)
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    try:
        run_torchrun(WORKER, RANKS, ",".join(urls), str(server_tp), str(tmp_path / "rank"))
    finally:
        for s in servers:
            s.shutdown()
    ranks = [json.loads((tmp_path / f"rank.{r}").read_text()) for r in range(RANKS)]
    want = state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in want.values())
    for j, log in enumerate(calls):
        assert [c["path"] for c in log] == ["/begin_weight_update"] + ["/update_weights_from_tensor"] * 3 + [
            "/end_weight_update"], j
        assert all(c["auth"] == "Bearer secret" for c in log)  # the key reached the ranks that post
        senders = list(range(j * server_tp, (j + 1) * server_tp))
        got: dict[str, torch.Tensor] = {}
        for c in log[1:-1]:
            # entry i of each bucket: serialized by the rank on the server's i-th GPU, from its own copy
            assert [o["pid"] for o in c["opened"]] == [ranks[r]["pid"] for r in senders], (j, c["opened"])
            for o in c["opened"]:
                assert o["tensors"].keys() == c["opened"][0]["tensors"].keys()
                for name, t in o["tensors"].items():
                    assert torch.equal(t, want[name])
            got.update(c["opened"][0]["tensors"])
        assert got.keys() == want.keys()
        assert [(c["version"], c["flush"]) for c in log[1:-1]] == [(None, False), (None, False), ("v7", True)]
        assert ranks[senders[0]]["sent"] == nbytes and all(ranks[r]["sent"] == 0 for r in senders[1:])


def test_every_push_is_probed_without_a_held_out_set():
    """examples/common.sh passes --eval-prompts 0: the probe then reads fixed training prompts (the first four, in
    the data's order), so each push is still compared with the trainer's log-probs."""
    from types import SimpleNamespace

    from megamu.loop.staged import PROBE_TOKENS, probe_tokens

    train = [SimpleNamespace(prompt_ids=list(range(100 * i, 100 * i + 20))) for i in range(6)]
    assert probe_tokens([], train) == [t for i in range(4) for t in range(100 * i, 100 * i + PROBE_TOKENS // 4)]
    held = [SimpleNamespace(prompt_ids=list(range(7, 107)))]
    assert probe_tokens(held, train) == list(range(7, 7 + PROBE_TOKENS))  # a held-out prompt, as before
    assert probe_tokens([], []) is None
