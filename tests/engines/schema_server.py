"""A small HTTP server that speaks SGLang 0.5.23's /generate schema, backed by LocalEngine.

Weight versions, /model_info and /server_info's limits are as in SGLang 0.5.23.
In-memory weight updates (a broadcast group, or tensor handles) are received as SGLang's TP rank 0 receives them.
Faults can be queued to test the client: "503" / "400" (one error response), "drop" (close the connection without an
answer), "sleep:S" (answer after S seconds), for /generate in ``faults``, for any other POST path in
``path_faults[path]``; there also "fail" (an in-memory or disk update received and loaded, then answered as SGLang
answers a failed one: HTTP 400, success False), "slow:S" (a disk update loaded under the server's lock, then answered S
seconds later, as SGLang's scheduler finishes a long load before what was sent after it) and "corrupt" (the update's
tensors loaded scaled by 1.5: weights that are not the trainer's, which a log-prob probe finds). As in SGLang, /health
needs no API key, and a request id the server has seen is refused with 400 (SGLang refuses one still in flight, which a
failed attempt may still be).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

from megamu.engines.types import GenerateRequest, SamplingParams

IN_MEMORY = ("/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
             "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update")


class SchemaServer:
    def __init__(self, engine, api_key: str = "secret", deterministic: bool = True, port: int = 0):
        self.engine = engine
        self.api_key = api_key
        self.deterministic = deterministic  # LocalEngine honours seeds, like SGLang with deterministic inference
        self.rids: set[str] = set()
        self.faults: list[str] = []
        self.path_faults: dict[str, list[str]] = {}  # POST path -> faults for its next requests, in order
        self.corrupt = False  # the next loaded tensors are scaled ("corrupt" fault)
        self.log: list[dict] = []  # every /generate body received, and what was answered
        self.weight_version = "default"  # as SGLang: set by a weight update, reported on every sample
        self.max_req_input_len: int | None = None  # reported in /server_info when set (SGLang always reports it)
        self.memory_saver = False  # as launched with --enable-memory-saver: it may release and resume its memory
        self.released: set[str] = set()  # what it has released: no push while "weights", no generation while any
        self.calls: list[str] = []  # every POST path in order, with its tags and weight version ("/x:kv_cache@4")
        self.max_running_requests: int | None = None  # reported in /server_info's internal_states when set
        self.running = 0  # sequences (samples) of /generate requests being answered now, and the most at once
        self.peak_running = 0
        # set: act as an sglang-router (0.3's worker API, GET/POST /workers, DELETE /workers/<id>) with these workers
        # (URLs), refusing batched /generate requests as it does (422)
        self.workers: list[str] | None = None
        self.worker_ids: dict[str, str] = {}
        self.probes = 0  # /health and /health_generate requests answered
        self.delay_s = 0.0  # every /generate is held this long (counted as running) before it is answered
        self.probe_delay_s = 0.0  # every /health_generate is held this long (a one-token generation on SGLang)
        self.probing = 0  # /health_generate requests being answered now
        self.lock = threading.Lock()
        self.groups: dict = {}  # in-memory weight-sync groups joined, by name
        self.pushed: dict = {}  # every tensor received in memory, by name (the last value)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def teacher_forced(self, ids: list[int]) -> dict:
        """SGLang's answer to a prompt-only request with logprob_start_len 0: the log-prob of each input token given
        the ones before it (none for the first), at temperature 1."""
        import torch

        with torch.no_grad():
            logits = self.engine.model(torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
        pairs = [[None, ids[0], None]] + [[v, t, None] for v, t in zip(lp, ids[1:])]
        return {"text": "", "output_ids": [], "meta_info": {"input_token_logprobs": pairs, "output_token_logprobs": [],
                                                            "weight_version": self.weight_version}}

    def generate(self, body: dict):
        ids, params, rids = body["input_ids"], body["sampling_params"], body.get("rid")
        if body.get("logprob_start_len") == 0 and params.get("max_new_tokens") == 0:
            with self.lock:
                return self.teacher_forced(ids)
        batch = isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        params = params if isinstance(params, list) else [params] * len(prompts)
        rids = rids if isinstance(rids, list) else [rids] * len(prompts)
        results = []
        for prompt, p, rid in zip(prompts, params, rids):
            top_k = p.get("top_k", -1)
            sp = SamplingParams(temperature=p.get("temperature", 1.0), top_p=p.get("top_p", 1.0),
                                top_k=0 if top_k == -1 else top_k, max_new_tokens=p.get("max_new_tokens", 128),
                                n=p.get("n", 1), stop_token_ids=p.get("stop_token_ids") or [],
                                seed=p.get("sampling_seed"))
            with self.lock:
                samples = self.engine.generate([GenerateRequest(0, prompt, sp)])
            for s in samples:  # n > 1: grouped by prompt, p0s0..p0s(n-1)
                reason = ({"type": "stop", "matched": s.output_ids[-1]} if s.finish_reason == "stop"
                          else {"type": "length", "length": len(s.output_ids)})
                results.append({
                    "text": "",
                    "output_ids": s.output_ids,
                    "meta_info": {
                        "id": rid, "finish_reason": reason, "prompt_tokens": len(prompt),
                        "completion_tokens": len(s.output_ids), "cached_tokens": 0,
                        "weight_version": self.weight_version,
                        "output_token_logprobs": [[lp, t, None] for lp, t in zip(s.output_logprobs, s.output_ids)],
                        "e2e_latency": 0.0,
                    },
                })
        single = not batch and params[0].get("n", 1) == 1
        return results[0] if single else results

    def in_memory(self, path: str, body: dict) -> dict:
        """SGLang's in-memory weight updates, as its TP rank 0 does them: joining the trainer's broadcast group
        (rank ``rank_offset``, the same rendezvous), receiving a flattened bucket by broadcast, or opening the
        tensor handles of ``serialized_named_tensors[0]``; each bucket is loaded at once, as SGLang loads it."""
        import torch

        from megamu.engines.sglang.weight_sync import open_weight_group

        if path == "/init_weights_update_group":
            self.groups[body["group_name"]] = open_weight_group(
                body["master_address"], body["master_port"], body["world_size"], body["group_name"], body["backend"],
                timeout_s=60.0, rank=body["rank_offset"])
        elif path == "/destroy_weights_update_group":
            import torch.distributed as dist

            dist.destroy_process_group(self.groups.pop(body["group_name"]))
        elif path == "/update_weights_from_distributed":
            import torch.distributed as dist

            sizes = [torch.Size(s).numel() * getattr(torch, d).itemsize for s, d in zip(body["shapes"], body["dtypes"])]
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
            dist.broadcast(flat, group=self.groups[body["group_name"]], group_src=0)
            parts = flat.split(sizes)
            self._load({n: p.view(getattr(torch, d)).view(s) for n, p, d, s in
                        zip(body["names"], parts, body["dtypes"], body["shapes"])}, body)
        elif path == "/update_weights_from_tensor":
            import base64
            import pickle

            import torch.multiprocessing  # noqa: F401  (registers the rebuild functions the payload names)

            obj = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
            flat = obj["flattened_tensor"]
            self._load({m.name: flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape).clone()
                        for m in obj["metadata"]}, body)
        return {"success": True, "message": "ok"}

    def _load(self, tensors: dict, body: dict) -> None:
        if self.corrupt:
            tensors = {n: t * 1.5 if t.is_floating_point() else t for n, t in tensors.items()}
        with self.lock:
            self.engine.model.load_state_dict(tensors, strict=False)
            self.pushed.update(tensors)
            self.weight_version = body.get("weight_version") or self.weight_version

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, payload) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if self.path.startswith("/health"):
                    return True
                if self.headers.get("Authorization") != f"Bearer {server.api_key}":
                    self._reply(401, {"error": "bad api key"})
                    return False
                return True

            def do_GET(self):
                if not self._authorized():
                    return
                if self.path in ("/health", "/health_generate"):  # answered while busy, as SGLang's (no lock)
                    server.probes += 1
                    if self.path == "/health_generate" and server.probe_delay_s:
                        server.probing += 1
                        time.sleep(server.probe_delay_s)
                        server.probing -= 1
                    return self._reply(200, {})
                if self.path == "/server_info":
                    info = {"model_path": server.engine.hf_dir, "dtype": "float32",
                            "enable_deterministic_inference": server.deterministic}
                    if server.max_req_input_len is not None:
                        info["max_req_input_len"] = server.max_req_input_len
                    if server.max_running_requests is not None:  # as SGLang: the scheduler's value, not the flag's
                        info["max_running_requests"] = None
                        info["internal_states"] = [{"max_running_requests": server.max_running_requests}]
                    return self._reply(200, info)
                if self.path == "/workers" and server.workers is not None:
                    ids = {u: i for i, u in server.worker_ids.items()}
                    return self._reply(200, {"workers": [{"id": ids.get(u, u), "url": u, "is_healthy": True}
                                                         for u in server.workers]})
                if self.path == "/model_info":
                    return self._reply(200, {"model_path": server.engine.hf_dir,
                                             "weight_version": server.weight_version})
                self._reply(404, {"error": "not found"})

            def do_DELETE(self):
                if not self._authorized():
                    return
                wid = unquote(self.path.removeprefix("/workers/"))
                with server.lock:
                    url = server.worker_ids.pop(wid, None)
                    server.workers = [w for w in server.workers or [] if w != url]
                return self._reply(200 if url else 404, {"message": "ok" if url else "no such worker"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self._authorized():
                    return
                if self.path == "/generate":
                    rids = body.get("rid")
                    rids = rids if isinstance(rids, list) else [rids] if rids else []
                    with server.lock:
                        dup = [r for r in rids if r in server.rids]
                        server.rids.update(rids)
                    if dup:
                        return self._reply(400, {"error": {"message": f"Duplicate request ID detected: {dup[0]}"}})
                if self.path == "/workers" and server.workers is not None:  # sglang-router's worker API
                    with server.lock:
                        wid = f"worker-{len(server.worker_ids)}"
                        server.worker_ids[wid] = body["url"]
                        server.workers = [w for w in server.workers if w != body["url"]] + [body["url"]]
                    return self._reply(202, {"status": "accepted", "worker_id": wid, "url": body["url"]})
                if self.path == "/generate" and server.workers is not None and (
                        isinstance(body.get("rid"), list) or isinstance(body.get("sampling_params"), list)):
                    return self._reply(422, {"error": "Failed to deserialize the JSON body: rid: invalid type: "
                                                      "sequence, expected a string"})
                tags, version = body.get("tags") or [], body.get("weight_version")
                server.calls.append(self.path + (":" + ",".join(tags) if tags else "")
                                    + (f"@{version}" if version else ""))
                fault = server.faults.pop(0) if server.faults and self.path == "/generate" else None
                queued = server.path_faults.get(self.path)
                if fault is None and queued:
                    fault = queued.pop(0)
                server.corrupt = fault == "corrupt"
                if fault in ("503", "400"):
                    return self._reply(int(fault), {"error": f"injected HTTP {fault}"})
                if fault == "drop":
                    self.close_connection = True
                    return
                if fault and fault.startswith("sleep:"):
                    time.sleep(float(fault.split(":")[1]))
                if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                    if not server.memory_saver:  # SGLang: the memory saver must be enabled at launch
                        return self._reply(400, {"error": "memory saver is not enabled"})
                    with server.lock:
                        if self.path.startswith("/release"):
                            server.released |= set(tags)
                        else:
                            server.released -= set(tags)
                    return self._reply(200, {"success": True, "message": "ok"})
                if self.path == "/update_weights_from_disk" and "weights" in server.released:
                    return self._reply(400, {"error": "weights are released: resume them before an update"})
                if self.path == "/generate" and server.released:
                    return self._reply(400, {"error": f"released {sorted(server.released)}: nothing to run on"})
                if self.path == "/generate":
                    ids = body["input_ids"]
                    n = (len(ids) if isinstance(ids[0], list) else 1) if ids else 0
                    with server.lock:
                        server.running += n
                        server.peak_running = max(server.peak_running, server.running)
                    try:
                        time.sleep(server.delay_s)
                        out = server.generate(body)
                    finally:
                        with server.lock:
                            server.running -= n
                    server.log.append({"body": body, "response": out})
                    return self._reply(200, out)
                failed = {"success": False, "message": "injected failure"}
                if self.path == "/update_weights_from_disk":
                    with server.lock:
                        server.engine.update_weights(body["model_path"])
                        if server.corrupt:
                            server.engine.model.load_state_dict(
                                {n: t * 1.5 for n, t in server.engine.model.state_dict().items()
                                 if t.is_floating_point()}, strict=False)
                        server.weight_version = body.get("weight_version") or server.weight_version
                        if fault and fault.startswith("slow:"):  # a load that takes long: the scheduler busy
                            time.sleep(float(fault.split(":")[1]))
                    if fault == "fail":
                        return self._reply(400, failed)
                    return self._reply(200, {"success": True, "message": "ok"})
                if self.path in IN_MEMORY:
                    if "weights" in server.released and self.path.startswith("/update"):
                        return self._reply(400, {"error": "weights are released: resume them before an update"})
                    out = server.in_memory(self.path, body)
                    return self._reply(400, failed) if fault == "fail" else self._reply(200, out)
                if self.path == "/abort_request":
                    return self._reply(200, {"success": True})
                self._reply(404, {"error": f"no route {self.path}"})

        return Handler
