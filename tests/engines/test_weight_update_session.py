"""The in-memory weight push on both SGLang versions megamu meets: 0.5.23 (its wheel's http_server.py has
``/begin_weight_update`` and ``/end_weight_update`` and answers 400 to an update outside them) and 0.5.15.post1, the
SGLang of slime's image the Dockerfile pins (neither route: 404). A local HTTP server plays each route table; the
requests are megamu's real ones (tensor_sync.send_tensors, CPU tensors serialized as for a server)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megamu.engines.sglang.launch import SGLangConfig
from megamu.engines.sglang.pool import ServerPool
from megamu.engines.sglang.tensor_sync import send_tensors

BRACKET = {"/begin_weight_update", "/end_weight_update"}


def _server(with_bracket: bool) -> tuple[ThreadingHTTPServer, list[str]]:
    calls: list[str] = []
    state = {"open": False}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            calls.append(self.path)
            status, body = 200, {"success": True, "message": ""}
            if self.path in BRACKET:
                if not with_bracket:
                    status, body = 404, {"detail": "Not Found"}
                else:
                    state["open"] = self.path == "/begin_weight_update"
            elif with_bracket and not state["open"]:  # 0.5.23 refuses an update outside a session
                status, body = 400, {"success": False, "message": "call /begin_weight_update first"}
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, calls


@pytest.mark.parametrize("with_bracket", [True, False], ids=["sglang-0.5.23", "sglang-0.5.15.post1"])
def test_tensor_push_brackets_only_where_the_server_has_the_session(with_bracket):
    server, calls = _server(with_bracket)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    pool = ServerPool(SGLangConfig(urls=(url,), weight_bucket_mb=1), api_key=None)
    pool.urls = pool.control_urls = [url]
    pool.open_control()
    try:
        state = {"a": torch.ones(300_000), "b": torch.zeros(10)}  # 1.2 MB: two buckets of at most 1 MiB
        sent = send_tensors(pool, state, "7")
    finally:
        pool.close()
        server.shutdown()
    assert sent == 300_010 * 4
    updates = ["/update_weights_from_tensor"] * 2
    assert calls == (["/begin_weight_update", *updates, "/end_weight_update"] if with_bracket
                     else ["/begin_weight_update", *updates])  # asked once, then unbracketed
