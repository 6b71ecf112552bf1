"""The remote sandbox client against a real local HTTP service (which runs programs in the local sandbox)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megamu.reward.code import code_score
from megamu.reward.remote import remote_run
from megamu.reward.sandbox import SandboxLimits, run_python

pytestmark = pytest.mark.sandbox  # one such test at a time over the workers (tests/reward/sandbox_checks.py)


class _Service(BaseHTTPRequestHandler):
    fail_first = 0  # answer this many requests with 503 before serving
    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if type(self).fail_first > 0:
            type(self).fail_first -= 1
            self.send_error(503)
            return
        if body.get("source") == "reject":
            self.send_error(400)
            return
        limits = SandboxLimits(wall_s=body["timeout_s"], cpu_s=max(1, int(body["timeout_s"])),
                               memory_bytes=body["memory_mb"] << 20, output_bytes=body["output_bytes"])
        r = run_python(body["source"], stdin=body["stdin"], limits=limits)
        reply = json.dumps({"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr,
                            "timed_out": r.timed_out}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def service():
    _Service.fail_first, _Service.requests = 0, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/run"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_remote_run_retries_server_errors(service, monkeypatch):
    monkeypatch.setattr("megamu.reward.remote.BACKOFF_S", 0.01)
    _Service.fail_first = 2
    r = remote_run(service, "import sys\nprint(sys.stdin.read().upper())", stdin="abc",
                   limits=SandboxLimits(wall_s=5.0))
    assert (r.returncode, r.stdout, r.timed_out) == (0, "ABC\n", False)
    assert len(_Service.requests) == 3 and _Service.requests[-1]["timeout_s"] == 5.0


def test_remote_run_gives_up(service, monkeypatch):
    monkeypatch.setattr("megamu.reward.remote.BACKOFF_S", 0.01)
    _Service.fail_first = 5
    with pytest.raises(RuntimeError, match="after 3 attempts"):
        remote_run(service, "print(1)")
    with pytest.raises(RuntimeError, match="HTTP 400"):
        _Service.fail_first = 0
        remote_run(service, "reject")
    with pytest.raises(RuntimeError, match="no answer"):
        remote_run("http://127.0.0.1:9/run", "print(1)", retries=1)  # discard port: connection refused


def test_code_score_through_the_remote_service(service):
    tests = {"inputs": ["2\n", "5\n"], "outputs": ["4\n", "25\n"]}
    assert code_score("```python\nn = int(input())\nprint(n * n)\n```", tests, sandbox_url=service, timeout_s=30) == 1
    assert code_score("```python\nprint(4)\n```", tests, sandbox_url=service, timeout_s=30) == 0
    # print(4) passes case 1 and fails case 2; only each case's input is sent, never an expected output
    assert [r["stdin"] for r in _Service.requests] == ["2\n", "5\n", "2\n", "5\n"]
    assert not any("25" in json.dumps(r) for r in _Service.requests)
