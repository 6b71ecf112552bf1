"""megamu launching SGLang servers, against a stand-in ``sglang.launch_server`` (tests/engines/fake_sglang) that
serves the schema server: the named Python and environment, --dtype, torchrun's variables removed, several nodes."""

import json
import sys
from pathlib import Path

import pytest

from megamu.engines.sglang.client import SGLangEngine
from megamu.engines.sglang.launch import SGLangConfig
from megamu.engines.types import GenerateRequest, SamplingParams
from tests.processes import pid_alive
from tests.torchrun import free_port, run_torchrun, server_ports

REPO = Path(__file__).resolve().parents[2]


def _fake_env(record: Path) -> dict:
    return {"PYTHONPATH": str(REPO / "tests" / "engines" / "fake_sglang"), "FAKE_SGLANG_REPO": str(REPO),
            "FAKE_SGLANG_RECORD": str(record)}


def test_servers_run_under_the_named_python_and_environment(tiny_llama, tmp_path, monkeypatch):
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                 "TORCHELASTIC_RUN_ID": "abc"}.items():
        monkeypatch.setenv(k, v)  # as in a trainer rank started by torchrun
    port = server_ports()
    cfg = SGLangConfig(server_python=sys.executable, server_env=_fake_env(tmp_path), port_base=port, num_servers=1,
                       dtype="bfloat16", startup_timeout_s=120, log_dir=str(tmp_path / "logs"),
                       extra_server_args=["--device", "cpu"])
    engine = SGLangEngine(tiny_llama, cfg)
    try:
        out = engine.generate([GenerateRequest(0, [5, 6], SamplingParams(max_new_tokens=3, n=2))])
        assert len(out) == 2
        seen = json.loads((tmp_path / f"{port}.json").read_text())
        flags = seen["argv"]
        assert flags[flags.index("--dtype") + 1] == "bfloat16" and flags[-2:] == ["--device", "cpu"]
        assert flags[flags.index("--api-key") + 1] == engine.api_key and flags[flags.index("--host") + 1] == "127.0.0.1"
        env = seen["env"]
        assert env["FAKE_SGLANG_RECORD"] == str(tmp_path)
        assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)
    finally:
        pids = engine.pids
        engine.shutdown()
    assert pids and not any(pid_alive(p) for p in pids)


@pytest.mark.slow
def test_each_node_launches_its_servers_and_rank_0_dispatches_over_all(tiny_llama, tmp_path):
    port = server_ports(11)  # node n's server at port + 10 n
    run_torchrun(REPO / "tests" / "engines" / "workers" / "sglang_nodes.py", 2, tiny_llama, str(tmp_path), str(port),
                 timeout=240, env={"PYTHONPATH": str(REPO)})
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["urls"] == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 10}"]
    assert seen["node_urls"] == seen["urls"][:1] and seen["samples"] == 8
    servers = [json.loads((tmp_path / f"{p}.json").read_text()) for p in (port, port + 10)]
    # one key for all nodes, so the dispatcher is accepted everywhere
    assert [s["argv"][s["argv"].index("--api-key") + 1] for s in servers] == [seen["api_key"]] * 2
    assert not any(pid_alive(s["pid"]) for s in servers)


def test_engine_flags(tmp_path):
    from megamu.arguments import parse_args
    from megamu.runtime.device import Device

    base = ["--save", str(tmp_path / "run"), "--rollout-engine", "sglang"]
    cfg = parse_args(base + ["--rollout-mode", "colocated", "--sglang-python", "/v/bin/python", "--sglang-env",
                             "SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=/x/stubs"], device=Device("cpu"))
    e = cfg.engine
    assert (e.sglang.weight_sync, e.dtype, e.sglang.sync_backend, e.sglang.server_python) == (
        "memory", "float32", "gloo", "/v/bin/python")
    assert e.sglang.server_env == {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": "/x/stubs"}
    assert cfg.policy.export_dtype is None  # the training precision (Policy.export_dtype)
    staged = parse_args(base, device=Device("cuda")).engine.sglang
    assert (staged.weight_sync, staged.sync_backend) == ("disk", "nccl")
    bf16 = parse_args(base + ["--bf16"], device=Device("cuda"))
    assert bf16.engine.dtype == "bfloat16"  # servers run what is exported: the training precision
    assert "HF exports bf16, engine bfloat16" in bf16.describe()
    device_row = [row.split(None, 1) for row in bf16.describe().splitlines() if row.split()[0] == "device"]
    assert device_row[0][1].startswith("cuda, ")  # named without creating a CUDA context
    import torch

    isa = torch.backends.cpu.get_cpu_capability()  # the plan says which CPU kernels a duration was measured with
    assert cfg.describe().splitlines()[-1].endswith(f"cores, torch kernels {isa}")
    fp16 = parse_args(base + ["--bf16", "--export-dtype", "fp16"], device=Device("cuda"))
    assert fp16.policy.export_dtype == "fp16" and "HF exports fp16" in fp16.describe()
    for bad, message in ((["--weight-sync", "memory"], "--weight-sync.*colocated"),
                         (["--sglang-env", "NOEQUALS"], "--sglang-env.*NAME=VALUE")):
        with pytest.raises(SystemExit, match=message):
            parse_args(base + bad, device=Device("cpu"))


def _two_nodes(model_dir: str, record: Path, *mode: str) -> list[dict]:
    """Two torchrun launchers on this machine playing two nodes (distinct node ranks, c10d rendezvous on 127.0.0.1)
    through one staged stage (workers/sglang_stage_nodes.py); what each node saw, by node."""
    import os
    import signal
    import subprocess

    port, rdzv = server_ports(11), free_port()  # node n's server at port + 10 n
    worker = REPO / "tests" / "engines" / "workers" / "sglang_stage_nodes.py"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--node_rank", str(r), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{rdzv}",
                               "--rdzv_id", "megamu-two-nodes", str(worker), model_dir, str(record), str(port),
                               *mode],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              start_new_session=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    nodes = [json.loads((record / f"node{n}.json").read_text()) for n in range(2)]
    assert {n["rank"] for n in nodes} == {0, 1}
    return nodes


@pytest.mark.slow
def test_two_nodes_each_serve_a_staged_stage_and_survive_a_killed_server(tiny_llama, tmp_path):
    """Each node's servers generate part of the stage and the record counts each; each node's stop leaves nothing.
    Then node 1's server is killed mid-stage: node 1 finds it dead (and restarts it: the stage may end first), rank 0
    moves its requests to node 0's server, and the dataset equals the fault-free run's (the schema servers draw from
    the seeds alone). A remote server's rejoining: test_sglang_health.py."""
    from megamu.rollout.dataset import StageDataset

    nodes = _two_nodes(tiny_llama, tmp_path / "clean")
    assert all(n["pids"] and not n["alive_after_release"] for n in nodes)  # each node stopped its own servers
    stage = StageDataset(tmp_path / "clean" / "run" / "rollouts" / "stage_0")
    servers = stage.manifest.extra["servers"]
    assert [s["url"] for s in servers] == [u for n in sorted(nodes, key=lambda n: n["rank"]) for u in n["urls"]]
    assert all(s["requests"] > 0 and s["samples_per_s"] > 0 for s in servers)  # both nodes generated
    assert sum(s["requests"] for s in servers) == stage.num_groups

    nodes = _two_nodes(tiny_llama, tmp_path / "kill", "kill")
    assert all(n["pids"] and not n["alive_after_release"] for n in nodes)
    rank0 = next(n for n in nodes if n["rank"] == 0)
    killed_url = nodes[1]["urls"][0]
    assert "exited with status -9" in nodes[1]["node_events"][0]["why"]  # its own node saw it die
    assert [e["url"] for e in rank0["dispatcher_events"] if e["event"] == "dead"] == [killed_url]
    from tests.engines.test_sglang_health import _assert_same_samples, _key

    _assert_same_samples(*(_key(d / "run" / "rollouts" / "stage_0") for d in (tmp_path / "kill", tmp_path / "clean")))


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["distributed", "tensor"])  # a folder push (disk) takes rank 0's path of "distributed"
def test_colocated_servers_on_two_nodes_stay_up_and_take_every_push(tiny_llama, tmp_path, sync):
    """Colocated: each node's servers start once, serve both stages, and are gone after the run's close. The second
    stage comes after a push that reaches every node's servers (the client refuses samples of another weight version,
    and both nodes' servers generate it): a broadcast from rank 0 to every node's servers (in memory, servers on GPUs
    of their own), or each node's own push of CUDA IPC-style handles to its own servers (in memory, servers on the
    trainer's GPUs: a node's handles open only on its host)."""
    from megamu.rollout.dataset import StageDataset
    from tests.tiny import save_tiny_model

    other = str(save_tiny_model(tmp_path / "other", "llama", seed=5))
    nodes = _two_nodes(tiny_llama, tmp_path / "run0", "colocated", other, sync)
    assert all(n["kept"] and n["gone"] for n in nodes)
    for stage in (0, 1):
        dataset = StageDataset(tmp_path / "run0" / "run" / "rollouts" / f"stage_{stage}")
        servers = dataset.manifest.extra["servers"]
        assert len(servers) == 2 and all(s["requests"] > 0 for s in servers)
    assert {s.policy_version for s in dataset.samples()} == {1}
    # who pushed: each node's own engine (per-node pushes), or rank 0's dispatcher over all (the nodes' engines still
    # know their servers' launch version, "default" on the schema server)
    assert [n["node_version"] for n in nodes] == (["1", "1"] if sync == "tensor" else ["default", "default"])


def test_launched_servers_join_the_given_router_for_the_stage(tiny_llama, tmp_path):
    """--sglang-router: the launched server joins the running router (POST /workers), requests go through the router
    one sample each (sglang-router refuses batches), weight syncs go to the server itself, and the server leaves the
    router (DELETE /workers/<id>) before it stops. The stand-in router answers itself and lists its workers; the real
    one: tests/engines/test_sglang_router.py."""
    from megamu.engines.local import LocalEngine
    from megamu.engines.sglang.nodes import start_sglang
    from tests.engines.schema_server import SchemaServer

    router = SchemaServer(LocalEngine(tiny_llama), api_key="k")
    router.workers = []
    cfg = SGLangConfig(server_python=sys.executable, server_env=_fake_env(tmp_path), port_base=server_ports(),
                       startup_timeout_s=120, log_dir=str(tmp_path / "logs"), api_key="k", router=router.url,
                       server_concurrency=3)
    try:
        dispatcher, node = start_sglang(tiny_llama, cfg)
        try:
            assert dispatcher.urls == [router.url] and router.workers == node.urls
            assert dispatcher.routers == [router.url] and dispatcher.capacities == [3]  # the sum over its workers
            out = dispatcher.generate([GenerateRequest(0, [5, 6], SamplingParams(max_new_tokens=3, n=2, seed=1))])
            assert len(out) == 2 and [type(e["body"]["rid"]) for e in router.log] == [str, str]
            report = dispatcher.update_weights(hf_dir=tiny_llama, version=5)  # to the worker, checked there
            assert report.version == "5" and not [c for c in router.calls if "weights" in c]
        finally:
            dispatcher.shutdown()
            assert router.workers == []  # left the router before its server stops
            node.shutdown()
    finally:
        router.close()


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_memory_saver_servers_do_not_inherit_expandable_segments(var):
    """torch_memory_saver refuses to run when the allocator setting holds "expandable_segments:True"
    (fzyzcjy/torch_memory_saver, torch_memory_saver/entrypoint.py:397-401, ``_sanity_checks``, called from the region
    context at :192): a server launched with --enable-memory-saver must not inherit it; other options stay."""
    from megamu.engines.sglang.launch import server_env

    base = {var: "expandable_segments:True,max_split_size_mb:256", "PATH": "/bin"}
    saver = server_env(SGLangConfig(memory_saver=True), base)
    assert "expandable_segments:True" not in saver.get("PYTORCH_CUDA_ALLOC_CONF", "")  # what TMS reads
    assert "expandable_segments" not in saver[var]
    assert saver[var] == "max_split_size_mb:256" and saver["PATH"] == "/bin"
    alone = server_env(SGLangConfig(memory_saver=True), {var: "expandable_segments:True"})
    assert var not in alone
    # given in server_env too: still removed, since the server would die either way
    given = server_env(SGLangConfig(memory_saver=True, server_env={var: "expandable_segments:True"}), {})
    assert var not in given
    # without the memory saver the server may keep the setting
    assert server_env(SGLangConfig(memory_saver=False), base)[var] == base[var]


def test_torch_memory_saver_itself_accepts_a_memory_saver_servers_environment(monkeypatch):
    """Upstream's own check, not a reading of it: torch_memory_saver 0.0.10 (SGLang 0.5.23 requires >= 0.0.9.post1)
    imports on CPU, and its ``_sanity_checks`` (entrypoint.py:397-401), which ``_TorchMemorySaverImpl.__init__`` runs
    when the first region opens (:192), refuses the trainer's allocator setting and accepts what ``server_env`` gives
    a memory-saver server."""
    import inspect

    from torch_memory_saver import entrypoint

    from megamu.engines.sglang.launch import server_env

    assert "_sanity_checks()" in inspect.getsource(entrypoint._TorchMemorySaverImpl.__init__)
    trainer = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:256"}
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", trainer["PYTORCH_CUDA_ALLOC_CONF"])
    with pytest.raises(RuntimeError, match="expandable_segments"):
        entrypoint._sanity_checks()
    saver = server_env(SGLangConfig(memory_saver=True), trainer)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", saver["PYTORCH_CUDA_ALLOC_CONF"])
    entrypoint._sanity_checks()  # raises if the server would die at launch
    without = server_env(SGLangConfig(memory_saver=False), trainer)  # no saver: the setting stays, as it may
    assert without["PYTORCH_CUDA_ALLOC_CONF"] == trainer["PYTORCH_CUDA_ALLOC_CONF"]

