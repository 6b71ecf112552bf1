"""Is the SGLang client the bottleneck? Simulated SGLang servers on localhost, the real rollout stream in front.

    taskset -c 0 python bench/rollout_client.py                 # the table: 1, 4, 8 servers x 64..2048 in flight
    python bench/rollout_client.py --servers 4 --in-flight 1024  # one setting

Each simulated server (one asyncio process holds them all, apart from the client's) speaks SGLang's /generate and
/server_info and decodes like a GPU with continuous batching: every step advances each running sequence by one token
and lasts t_step = a + b * batch, with at most ``max_running_requests`` sequences running (reported in /server_info's
``internal_states``); waiting sequences join at the next step. A sample of length L is answered L steps after it
joined. Capacity, the physical limit, is Little's law on a full batch: C / (E[L] * t_step(C)) samples/s per server.

a and b, for a 7-8B model on one H200 (uncertain to perhaps +-50%; they set the time scale, not the ratio's meaning):
- b = 38 us per running sequence: NVIDIA's TensorRT-LLM performance overview (docs/source/performance/perf-overview.md,
  "Llama 3.1 8B", H200 TP1 FP8, ISL/OSL 128/2048, max-throughput) measured 26,221 output tokens/s; at a large batch
  t_step ~ b * batch, so b ~ 1 / 26,221 s. SGLang in bf16 is somewhat slower per token, which would make b larger
  and the client's job easier.
- a = 7 ms: one decode step at batch 1 reads all weights once; 15 GB of bf16 weights at the H200's 4.8 TB/s is
  3.2 ms, and the measured single-stream speed of such models is about 150 tokens/s (~7 ms a token).
So t_step(1024) ~ 46 ms and a full server makes ~22k tokens/s.

The client runs the rollout phase's own streaming loop (``megamu.rollout.phase._streamed_shards``, without scoring
and writing) with groups of n = 8 samples, and is measured three ways side by side:
- before: the client as of commit 04c54bd (loaded from git): urllib in a thread pool of 256 (``max_concurrency``),
  round robin, 512 requests submitted;
- threads: that same code with as many threads (requests in flight) as the new client keeps (2 N C / n);
- after: this tree's client (asyncio + aiohttp, capacity from /server_info, least-outstanding dispatch).
Achieved samples/s is measured while at least two full batches of work are still queued (from 30% to 60% of the
samples done), so ramp-up and the final drain do not count; so is the batch fill, the mean running batch over the
servers' steps in that window as a fraction of their capacity. On a busy machine the servers' steps can run late and
catch up (samples/s then strays a few % either way); the fill does not depend on that timing, and says directly
whether the client kept every server's batch full. Client CPU per request is this process's CPU time
(servers excluded) over the run, per request of n samples. Mean response length is short (--mean-len, default 32
tokens, uniform in [L/2, 3L/2]) to make the request rate, and so the client's load, ~30x a real RL rollout's.

Measured 2026-12-03 on a 2-core AMD EPYC shared with other jobs, everything pinned to one core, one run
(``--clients before after --mean-len 64 --waves 3``):

    t_step = 7 ms + 38 us x batch; n = 8; mean length 64; 3 full batches per setting
    servers in flight   client  samples/s    limit  ratio batch fill CPU ms/req
          1        64   before        107      106   1.01      1.000       2.04
          1        64    after        107      106   1.01      1.000       2.22
          1       256   before        237      239   0.99      1.000       2.36
          1       256    after        237      239   0.99      1.000       3.13
          1      1024   before        293      347   0.84      0.984       2.33
          1      1024    after        278      347   0.80      0.985       1.89
          1      2048   before        326      376   0.87      0.700       2.51
          1      2048    after        301      376   0.80      0.987       2.10
          4        64   before        412      424   0.97      1.000       2.03
          4        64    after        411      424   0.97      1.000       2.32
          4       256   before        899      954   0.94      0.976       2.42
          4       256    after       1036      954   1.09      0.977       1.94
          4      1024   before        733     1390   0.53      0.351       2.53
          4      1024    after       1438     1390   1.03      0.982       1.95
          4      2048   before       1002     1504   0.67      0.174       2.48
          4      2048    after       1228     1504   0.82      0.984       1.83
          8        64   before        903      847   1.07      1.000       2.33
          8        64    after        900      847   1.06      1.000       1.77
          8       256   before        882     1909   0.46      0.674       1.85
          8       256    after       2140     1909   1.12      0.787       2.02
          8      1024   before        807     2779   0.29      0.144       2.87
          8      1024    after       3224     2779   1.16      0.977       1.77
          8      2048   before        902     3008   0.30      0.062       2.08
          8      2048    after       3365     3008   1.12      0.971       2.13

The batch fill is the client's part: before, one server of 2048 ran 0.70 of its batch and 4-8 servers of 1024 or
2048 ran 0.06-0.35 (256 requests over all servers, and no surplus for the groups' finished samples); after, every
server ran >= 0.97 of its capacity except at 8 x 256, where the one core holding the client and the 8 simulated
servers was saturated (~2 ms CPU per request of 8 x 64 tokens each side, ~270 requests/s). samples/s strays up to
~15% either way from the limit because the busy core made the simulated steps run late and catch up.
Threads at the new client's depth (``--clients threads``, mean length 128, same day): at 4 x 1024 (1024 threads) the
fill was 0.982 against asyncio's 0.984, but at 101.9 ms CPU per request against 3.5; at 4 x 2048 and 8 x 1024 (2048
threads) they reached 0.05-0.20 of the limit and drove the load average past 200. Hence asyncio + aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

A_S, B_S = 7e-3, 1 / 26221  # see the module docstring
# The thread-per-request client with 2048 threads took 50 ms of CPU per request and drove the load average of a
# 2-core machine past 200: more are not run.
MAX_THREADS = 1024
BEFORE_COMMIT = "04c54bd"


# ---- simulated servers (run in their own process: --serve) ----------------------------------------------------------
class SimServer:
    def __init__(self, capacity: int, a: float, b: float, mean_len: int):
        self.capacity, self.a, self.b, self.mean_len = capacity, a, b, mean_len
        self.waiting: list = []  # [remaining steps, request] per sequence not yet running
        self.running: list = []
        self.wake = asyncio.Event()
        self.pieces: dict[int, str] = {}  # response JSON of one sample, by length
        self.trace: list[tuple[float, int]] = []  # (end of step, sequences it ran), for the batch fill

    def piece(self, length: int) -> str:
        if length not in self.pieces:
            pairs = ",".join(f"[-0.{(7 * i) % 1000:03d}1234,{1000 + i},null]" for i in range(length))
            self.pieces[length] = ('{"text":"","meta_info":{"finish_reason":{"type":"length","length":'
                                   + str(length) + '},"output_token_logprobs":[' + pairs + "]}}")
        return self.pieces[length]

    async def decode_loop(self) -> None:
        clock = time.monotonic()  # when the current step ends, on the model's schedule
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
                clock = time.monotonic()  # idle time is not made up for
            room = self.capacity - len(self.running)
            self.running += self.waiting[:room]
            del self.waiting[:room]
            # steps end on an absolute schedule, so a late timer (asyncio's sleep overshoots by ~1 ms) shortens the
            # next step instead of slowing the modelled GPU
            clock = max(clock, time.monotonic() - 0.05) + self.a + self.b * len(self.running)
            self.trace.append((clock, len(self.running)))
            still = []
            for seq in self.running:
                seq[0] -= 1
                if seq[0] > 0:
                    still.append(seq)
                else:
                    req = seq[1]
                    req["left"] -= 1
                    if req["left"] == 0:
                        req["done"].set_result(None)
            self.running = still
            await asyncio.sleep(max(0.0, clock - time.monotonic()))

    async def generate(self, body: dict) -> bytes:
        # each sample's length, uniform in [L/2, 3L/2], is drawn from its sampling_seed (both clients send one)
        lengths = [self.mean_len // 2 + p["sampling_seed"] % (self.mean_len + 1) for p in body["sampling_params"]]
        req = {"left": len(lengths), "done": asyncio.get_running_loop().create_future()}
        self.waiting += [[n, req] for n in lengths]
        self.wake.set()
        await req["done"]
        return ("[" + ",".join(self.piece(n) for n in lengths) + "]").encode()


async def _serve_connection(sim: SimServer, reader, writer) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            if method == "POST" and path == "/generate":
                out = await sim.generate(json.loads(body))
            elif path == "/bench_trace":  # the steps run so far, then forgotten
                out, sim.trace = json.dumps(sim.trace).encode(), []
            elif path == "/server_info":
                out = json.dumps({"max_running_requests": None, "enable_deterministic_inference": False,
                                  "internal_states": [{"max_running_requests": sim.capacity}]}).encode()
            else:
                out = b"{}"
            close = headers.get("connection", "").lower() == "close"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
                         % (len(out), b"Connection: close\r\n" if close else b"") + out)
            await writer.drain()
            if close:
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _serve(count: int, capacity: int, a: float, b: float, mean_len: int) -> None:
    ports = []
    for _ in range(count):  # port 0: a fixed range could collide with the clients' own ephemeral ports
        sim = SimServer(capacity, a, b, mean_len)
        asyncio.get_running_loop().create_task(sim.decode_loop())
        server = await asyncio.start_server(lambda r, w, sim=sim: _serve_connection(sim, r, w), "127.0.0.1", 0,
                                            backlog=4096)
        ports.append(server.sockets[0].getsockname()[1])
    print("ready", *ports, flush=True)
    await asyncio.Event().wait()


# ---- clients ------------------------------------------------------------------------------------------------------
def _before_client():
    """SGLangEngine as of BEFORE_COMMIT, with the launch module of that commit (its config had max_concurrency)."""
    mods = {}
    for name, path in (("megamu_before_launch", "megamu/engines/sglang/launch.py"),
                       ("megamu_before_client", "megamu/engines/sglang/client.py")):
        src = subprocess.run(["git", "-C", str(REPO), "show", f"{BEFORE_COMMIT}:{path}"], check=True,
                             capture_output=True, text=True).stdout
        src = src.replace("megamu.engines.sglang.launch", "megamu_before_launch")
        spec = importlib.util.spec_from_loader(name, loader=None)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        exec(compile(src, f"{BEFORE_COMMIT}:{path}", "exec"), mod.__dict__)
        mods[name] = mod
    return mods["megamu_before_client"].SGLangEngine


def _requests(count: int, n: int, seed: int):
    from megamu.engines.types import GenerateRequest, SamplingParams

    return [GenerateRequest(i, [1 + (i * 7 + j) % 900 for j in range(64)], SamplingParams(n=n, seed=seed))
            for i in range(count)]


def run_one(kind: str, urls: list[str], capacity: int, n: int, mean_len: int, waves: int) -> dict:
    from megamu.engines.sglang.dispatch import OVERSUBSCRIPTION
    from megamu.rollout.phase import _streamed_shards

    if kind == "after":
        from megamu.engines.sglang.client import SGLangEngine

        engine = SGLangEngine(None, urls=urls, api_key="k")
    else:
        Before = _before_client()
        # "threads": as many requests in flight as the new client sends (OVERSUBSCRIPTION x capacity per server)
        threads = 256 if kind == "before" else max(1, OVERSUBSCRIPTION * len(urls) * capacity // n)
        engine = Before(None, urls=urls, api_key="k", max_concurrency=threads)
    total = max(waves * len(urls) * capacity // n, 240)  # enough requests for a steady window at small settings
    reqs = _requests(total, n, seed=len(urls) * 100003 + capacity)
    done_at: list[float] = []
    submit = engine.submit

    def timed_submit(index, req):
        f = submit(index, req)
        f.add_done_callback(lambda _f: done_at.append(time.monotonic()))
        return f

    engine.submit = timed_submit
    shards = {k: reqs[k * 16 : (k + 1) * 16] for k in range((total + 15) // 16)}
    cpu0, t0 = time.process_time(), time.monotonic()
    for _ in _streamed_shards(engine, shards, engine.max_in_flight):
        pass
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    engine.shutdown()
    done_at.sort()
    lo, hi = int(0.3 * total), int(0.6 * total)
    t_lo, t_hi = done_at[lo], done_at[hi]
    achieved = (hi - lo) * n / (t_hi - t_lo)
    per_server = capacity / (mean_len * (A_S + B_S * capacity))
    fills = []
    for url in urls:  # the batch each server ran, step by step, over the same window
        with urllib.request.urlopen(url + "/bench_trace") as resp:
            steps = [b for t, b in json.loads(resp.read()) if t_lo <= t <= t_hi]
        fills.append(sum(steps) / (len(steps) * capacity) if steps else float("nan"))
    return dict(achieved=achieved, limit=per_server * len(urls), ratio=achieved / (per_server * len(urls)),
                fill=sum(fills) / len(fills), cpu_ms=1e3 * cpu / total, wall=wall)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--servers", type=int, nargs="*", default=[1, 4, 8])
    p.add_argument("--in-flight", type=int, nargs="*", default=[64, 256, 1024, 2048],
                   help="sequences per server (its max_running_requests)")
    p.add_argument("--clients", nargs="*", default=["before", "threads", "after"])
    p.add_argument("--n", type=int, default=8, help="samples per request (the group size)")
    p.add_argument("--mean-len", type=int, default=32)
    p.add_argument("--waves", type=int, default=5, help="samples to generate, in full batches of all servers")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    p.add_argument("--capacity", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve, args.capacity, A_S, B_S, args.mean_len))
        return
    import aiohttp  # noqa: F401  (imported once here, so no run's CPU time counts the import)

    from megamu.engines.sglang.dispatch import OVERSUBSCRIPTION
    print(f"t_step = {A_S * 1e3:.0f} ms + {B_S * 1e6:.0f} us x batch; n = {args.n}; mean length {args.mean_len}; "
          f"{args.waves} full batches per setting")
    print(f"{'servers':>7} {'in flight':>9} {'client':>8} {'samples/s':>10} {'limit':>8} {'ratio':>6} "
          f"{'batch fill':>10} {'CPU ms/req':>10}")
    for n_servers in args.servers:
        for cap in args.in_flight:
            cmd = [sys.executable, __file__, "--capacity", str(cap), "--mean-len", str(args.mean_len),
                   "--serve", str(n_servers)]
            server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            try:
                ready, *ports = server.stdout.readline().split()
                assert ready == "ready", ready
                urls = [f"http://127.0.0.1:{q}" for q in ports]
                for kind in args.clients:
                    threads = OVERSUBSCRIPTION * n_servers * cap // args.n
                    if kind == "threads" and threads > MAX_THREADS:
                        print(f"{n_servers:>7} {cap:>9} {kind:>8}  skipped: {threads} threads (> {MAX_THREADS})")
                        continue
                    r = run_one(kind, urls, cap, args.n, args.mean_len, args.waves)
                    print(f"{n_servers:>7} {cap:>9} {kind:>8} {r['achieved']:>10.0f} {r['limit']:>8.0f} "
                          f"{r['ratio']:>6.2f} {r['fill']:>10.3f} {r['cpu_ms']:>10.2f}", flush=True)
            finally:
                server.terminate()
                server.wait()


if __name__ == "__main__":
    main()
