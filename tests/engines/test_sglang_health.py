"""A rollout phase that survives a dead or hung server (megamu/engines/sglang/health.py), against schema servers:
launched ones (tests/engines/fake_sglang, so megamu restarts them) and in-process ones (given URLs).

Every fault run's dataset is compared with a fault-free run's through in-process servers: the schema server draws each
sample from its seed alone (as SGLang with deterministic inference), so the same prompts, sample indices and tokens,
each exactly once, prove that no group was lost, duplicated or drawn with other seeds. Detection times are printed
(``-s``) for the issue's note; the only wall-clock assert is the hang's probe bound."""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megamu.engines.local import LocalEngine
from megamu.engines.sglang.client import SGLangEngine
from megamu.engines.sglang.launch import SGLangConfig
from megamu.engines.sglang.schema import SGLangError
from megamu.rollout.dataset import StageDataset, shard_name
from megamu.rollout.phase import run_rollout_phase
from tests.engines.schema_server import SchemaServer
from tests.processes import pid_alive
from tests.rollout.test_phase import SAMPLING, ParityScorer, make_prompts
from tests.tiny import build_char_tokenizer
from tests.torchrun import free_port, server_ports

REPO = Path(__file__).resolve().parents[2]
N, PER_SHARD = 2, 2
# Short probes: a hung server is dead after PROBE_MISSES * (PERIOD + TIMEOUT) = 3 s.
PERIOD, TIMEOUT, PROBE_MISSES = 0.25, 0.75, 3
HEALTH = dict(probe_period_s=PERIOD, probe_timeout_s=TIMEOUT, probe_misses=PROBE_MISSES, backoff_s=0.05,
              server_concurrency=1)


def _config(tmp_path: Path, num_servers: int, **kw) -> SGLangConfig:
    """Servers megamu launches: the schema server holding each /generate 0.3 s, one request of 2 sequences at a
    time per server, so the stage lasts long enough to be hit mid-way."""
    env = {"PYTHONPATH": str(REPO / "tests" / "engines" / "fake_sglang"), "FAKE_SGLANG_REPO": str(REPO),
           "FAKE_SGLANG_RECORD": str(tmp_path), "FAKE_SGLANG_DELAY": "0.3"}
    return SGLangConfig(**{**HEALTH, **dict(server_python=sys.executable, server_env=env, num_servers=num_servers,
                                            port_base=server_ports(num_servers), startup_timeout_s=120,
                                            log_dir=str(tmp_path / "logs")), **kw})


def _phase(engine, out: Path):
    tok = build_char_tokenizer()
    return run_rollout_phase(engine, make_prompts(tok), out, sampling=SAMPLING, n_samples=N, scorer=ParityScorer(),
                             tokenizer=tok, stage=1, groups_per_shard=PER_SHARD)


def _key(stage_dir: Path) -> list[tuple]:
    """Each sample's identity and contents, in dataset order."""
    return [(s.prompt_id, s.sample_index, tuple(s.response_ids), tuple(s.behaviour_logprobs))
            for s in StageDataset(stage_dir).samples()]


def _assert_same_samples(got: list[tuple], want: list[tuple]) -> None:
    """The same samples in the same order: identities and tokens exactly, log-probs to 1e-4. The reference came from
    in-process servers and the run under test from launched ones with their own thread counts: fp32 forwards whose
    sums run in another order differ by ~1e-6 here, so an exact or rounded comparison flips at a rounding boundary."""
    assert [k[:3] for k in got] == [k[:3] for k in want]
    torch.testing.assert_close(torch.tensor([x for k in got for x in k[3]], dtype=torch.float64),
                               torch.tensor([x for k in want for x in k[3]], dtype=torch.float64), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def reference(tiny_llama, tmp_path_factory):
    """The fault-free dataset, through two in-process schema servers."""
    out = tmp_path_factory.mktemp("reference") / "stage"
    servers = [SchemaServer(LocalEngine(tiny_llama)) for _ in range(2)]
    engine = SGLangEngine(None, urls=[s.url for s in servers], api_key="secret")
    try:
        manifest = _phase(engine, out)
    finally:
        engine.shutdown()
        for s in servers:
            s.close()
    # both servers generated, and the record counts what each answered
    counts = [s["requests"] for s in manifest.extra["servers"]]
    assert sum(counts) == manifest.num_groups and all(counts)
    keys = _key(out)
    assert sorted((p, j) for p, j, *_ in keys) == [(g, j) for g in sorted({k[0] for k in keys}) for j in range(N)]
    return keys


def _on_first_shard(out: Path, act) -> threading.Thread:
    """Run ``act()`` once the stage's first shard is written (mid-stage), recording when."""
    def watch():
        while not (out / shard_name(0)).exists():
            time.sleep(0.01)
        act()
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _detection(engine, url: str, t_fault: float) -> float:
    dead = [e for e in engine.health_events if e["event"] == "dead" and e["url"] == url]
    assert dead, engine.health_events
    return dead[0]["time"] - t_fault


def test_killed_server_is_restarted_and_the_dataset_is_complete(tiny_llama, tmp_path, reference):
    engine = SGLangEngine(tiny_llama, _config(tmp_path, 1))
    out, fault = tmp_path / "stage", {}
    pid = engine.pids[0]
    _on_first_shard(out, lambda: (fault.setdefault("t", time.time()), os.kill(pid, signal.SIGKILL)))
    try:
        manifest = _phase(engine, out)
        events = list(engine.health_events)
        new_pid = engine.pids[0]
    finally:
        engine.shutdown()
    _assert_same_samples(_key(out), reference)  # every group exactly once, the samples a fault-free run drew
    assert manifest.extra["servers"][0]["restarts"] == 1 and new_pid != pid and not pid_alive(new_pid)
    assert "exited with status -9" in events[0]["why"] and events[1]["event"] == "restarted"
    print(f"\nkill: detected after {events[0]['time'] - fault['t']:.2f}s, restarted in {events[1]['seconds']:.1f}s")


def test_hung_server_is_found_within_the_probe_bound(tiny_llama, tmp_path, reference):
    engine = SGLangEngine(tiny_llama, _config(tmp_path, 2))
    out, fault = tmp_path / "stage", {}
    pid, url = engine.pids[1], engine.urls[1]
    _on_first_shard(out, lambda: (fault.setdefault("t", time.time()), os.kill(pid, signal.SIGSTOP)))
    try:
        manifest = _phase(engine, out)
        detected = _detection(engine, url, fault["t"])
    finally:
        engine.shutdown()
    assert not pid_alive(pid)  # the stopped server was killed, not left behind
    _assert_same_samples(_key(out), reference)
    # found by its missed probes: at most PROBE_MISSES rounds of (period + timeout), plus slack for a loaded core
    assert detected < PROBE_MISSES * (PERIOD + TIMEOUT) + 5.0
    assert [s["url"] for s in manifest.extra["servers"]] == engine.urls
    print(f"\nhang: detected after {detected:.2f}s (bound {PROBE_MISSES * (PERIOD + TIMEOUT):.2f}s + slack)")


def test_refused_port_moves_requests_and_the_server_rejoins(tiny_llama, tmp_path, reference):
    """A given server (another node's, say) whose port refuses is dead at once; when it answers again (its own node
    restarted it) it takes requests again."""
    servers = [SchemaServer(LocalEngine(tiny_llama)) for _ in range(2)]
    for s in servers:
        s.delay_s = 0.5
    engine = SGLangEngine(None, SGLangConfig(urls=[s.url for s in servers], api_key="secret", **HEALTH))
    out, fault, port = tmp_path / "stage", {}, int(servers[1].url.rsplit(":", 1)[1])
    # Loaded here, not in the thread below: no model loads while a server of this process generates (transformers'
    # loading patches torch globally).
    returning = LocalEngine(tiny_llama)

    def refuse_then_return():
        fault["t"] = time.time()
        servers[1].close()
        while not engine.health_events:
            time.sleep(0.01)
        servers.append(SchemaServer(returning, port=port))  # back on the same port
        servers[-1].delay_s = 0.5

    _on_first_shard(out, refuse_then_return)
    try:
        manifest = _phase(engine, out)
        detected = _detection(engine, servers[1].url, fault["t"])
        events = list(engine.health_events)
    finally:
        engine.shutdown()
        for s in servers[::2]:
            s.close()
    _assert_same_samples(_key(out), reference)
    assert "refuses connections" in events[0]["why"]
    assert [e["event"] for e in events] == ["dead", "rejoined"] and servers[2].log  # the returned server generated
    assert sum(s["requests"] for s in manifest.extra["servers"]) == manifest.num_groups
    print(f"\nrefused port: detected after {detected:.2f}s")


def test_out_of_restarts_names_the_server_and_a_rerun_resumes(tiny_llama, tmp_path, reference):
    engine = SGLangEngine(tiny_llama, _config(tmp_path, 1, max_restarts=0))
    out, pid, url = tmp_path / "stage", engine.pids[0], engine.urls[0]
    _on_first_shard(out, lambda: os.kill(pid, signal.SIGKILL))
    try:
        with pytest.raises(SGLangError) as e:
            _phase(engine, out)
    finally:
        engine.shutdown()
    message = str(e.value)
    assert url in message and "exit status -9" in message and "max_restarts" in message
    assert str(tmp_path / "logs" / "server_0.log") in message
    written = sorted(p.name for p in out.glob("shard-*"))
    assert written and not (out / "manifest.json").exists()
    engine = SGLangEngine(tiny_llama, _config(tmp_path, 1))  # the rerun: the shards written stay, the rest follow
    try:
        _phase(engine, out)
    finally:
        engine.shutdown()
    _assert_same_samples(_key(out), reference)


def test_start_on_the_healthy_urls_naming_the_missing_and_fail_when_none(server, monkeypatch, capsys):
    from megamu.engines.sglang import health

    monkeypatch.setattr(health, "PROGRESS_EVERY_S", 0.2)
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there: refused
    engine = SGLangEngine(None, urls=[gone, server.url], api_key="secret", url_timeout_s=1.0)
    try:
        assert engine.urls == [server.url]
    finally:
        engine.shutdown()
    out = capsys.readouterr().out
    assert f"for 1 of 2 server(s): {gone}" in out  # the progress line names what it still waits for
    assert f"starting on 1 of 2 servers; no answer after 1s from {gone} (" in out
    t0 = time.monotonic()
    with pytest.raises(SGLangError) as e:
        SGLangEngine(None, urls=[gone, f"{gone}0"], api_key="secret", url_timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0 + 5.0  # the bound, plus one round of 5 s calls at most
    assert f"{gone} (" in str(e.value) and f"{gone}0 (" in str(e.value) and "not healthy after 1s" in str(e.value)


def test_health_flags(tmp_path):
    from megamu.arguments import parse_args
    from megamu.runtime.device import Device

    base = ["--save", str(tmp_path / "run"), "--rollout-engine", "sglang"]
    cfg = parse_args(base + ["--rollout-max-restarts", "5", "--rollout-probe-period", "2", "--sglang-url-timeout",
                             "30", "--sglang-host", "0.0.0.0", "--sglang-router", "http://r:29000"],
                     device=Device("cpu")).engine.sglang
    assert (cfg.max_restarts, cfg.probe_period_s, cfg.url_timeout_s, cfg.probe_misses) == (5, 2.0, 30.0, 3)
    assert (cfg.host, cfg.router) == ("0.0.0.0", "http://r:29000")
    with pytest.raises(SystemExit, match="--rollout-probe-misses"):
        parse_args(base + ["--rollout-probe-misses", "0"], device=Device("cpu"))
    with pytest.raises(SystemExit, match="--sglang-router"):
        parse_args(base + ["--sglang-router", "http://r:29000", "--sglang-url", "http://s:30000"], device=Device("cpu"))


def test_a_returning_server_gets_the_pushed_weights_before_it_rejoins(tiny_llama, tmp_path):
    """A server back from a restart serves its launch folder; the engine pushed a newer one since: the server gets
    that folder (and version) before it takes requests again, so no sample of stale weights is made (the client would
    refuse it)."""
    from megamu.engines.types import GenerateRequest, SamplingParams
    from tests.tiny import save_tiny_model

    newer = str(save_tiny_model(tmp_path / "newer", "llama", seed=5))
    servers = [SchemaServer(LocalEngine(tiny_llama)) for _ in range(2)]
    for s in servers:
        s.delay_s = 0.3
    engine = SGLangEngine(None, SGLangConfig(urls=[s.url for s in servers], api_key="secret", **HEALTH))
    port = int(servers[1].url.rsplit(":", 1)[1])
    returning = LocalEngine(tiny_llama)  # loaded before any thread generates (see the test above)
    try:
        engine.update_weights(hf_dir=newer, version=1)
        servers[1].close()
        reqs = [GenerateRequest(i, [5, 6, 7 + i], SamplingParams(max_new_tokens=3, n=2, seed=1)) for i in range(10)]
        out = []
        running = threading.Thread(target=lambda: out.extend(engine.generate(reqs)), daemon=True)
        running.start()
        while not engine.health_events:
            time.sleep(0.01)
        back = SchemaServer(returning, port=port)  # restarted from the launch folder: version "default"
        back.delay_s = 0.3
        servers.append(back)
        running.join(timeout=60)
        assert not running.is_alive() and len(out) == 20  # every sample, none refused as stale
        assert [e["event"] for e in engine.health_events] == ["dead", "rejoined"]
        assert "/abort_request" not in back.calls  # the refused port had nothing to abort; the returned one runs ours
        assert back.weight_version == "1" and back.calls[0] == "/update_weights_from_disk@1" and back.log
    finally:
        engine.shutdown()
        for s in servers[::2]:
            s.close()


def test_a_keeper_probes_while_watching_only(server):
    """A node's own colocated servers (keep_alive) are probed through rollouts and not between them (``watching``):
    a server busy loading a push may miss probes and must not be killed for it. An engine that does not keep its
    servers alive probes only while its own requests are out."""
    engine = SGLangEngine(None, SGLangConfig(urls=[server.url], api_key="secret", **HEALTH))

    def probes_over(seconds: float) -> int:
        time.sleep(PERIOD + TIMEOUT + 0.5)  # a probe already under way when the switch flipped may still land
        before = server.probes
        time.sleep(seconds)
        return server.probes - before

    try:
        engine.watching(True)  # not a keeper: no effect
        assert probes_over(4 * PERIOD) == 0
        engine.keep_alive()
        assert probes_over(8 * PERIOD) >= 2  # ~8 probes due: room for a loaded core's late event loop
        engine.watching(False)
        assert probes_over(4 * PERIOD) == 0
        engine.watching(True)
        assert probes_over(8 * PERIOD) >= 2
    finally:
        engine.shutdown()


def test_paused_probes_are_drained_before_the_memory_is_released(server):
    """SGLang 0.5.23's /release_memory_occupation asserts an idle server (weight_updater.py) and /health_generate
    enqueues a real one-token request (http_server.py): ``pause_probes`` returns only once no probe is in flight,
    and none starts after it (``watching(False)`` alone leaves the one under way)."""
    engine = SGLangEngine(None, SGLangConfig(urls=[server.url], api_key="secret", **HEALTH))
    server.probe_delay_s = 2 * PERIOD  # under the probe timeout: an answer, not a miss
    try:
        engine.keep_alive()
        deadline = time.time() + 30
        while server.probing == 0 and time.time() < deadline:  # a probe under way
            time.sleep(0.01)
        assert server.probing == 1
        engine.pause_probes()
        assert server.probing == 0  # drained: the release may go now
        before = server.probes
        time.sleep(4 * PERIOD)
        assert server.probes == before and server.probing == 0
        engine.resume_probes()
        time.sleep(4 * PERIOD + server.probe_delay_s)
        assert server.probes > before  # the next rollout is watched again
    finally:
        server.probe_delay_s = 0.0
        engine.shutdown()
