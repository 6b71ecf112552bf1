"""The weights a set of SGLang servers serve, owned by one object: ``ServerWeights``, an SGLangEngine's part.

It holds what every weight change is checked against and what it changes: the running model's tensor layout and the
servers' dtype (a sync that does not fit is refused before anything is sent, weight_sync.check_layout), the weight
version every sample must carry, the launch version and the folder or host copy a restarted server is given back, and
the in-memory sync group (weight_sync.WeightSync). Its methods are the syncs themselves: from a folder or in memory
(``update``), pushes the trainer's ranks made (``pushed_by_ranks``, ``confirm``), and a restarted server's weights
(``restorable``, ``restore``; health.py's ``WeightRestorer``). The transports and checks they use live in
weight_sync.py and tensor_sync.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from megamu.engines.sglang.launch import SGLangConfig, load_seconds, model_bytes
from megamu.engines.sglang.pool import ServerPool
from megamu.engines.sglang.schema import SGLangError
from megamu.engines.sglang.weight_sync import (
    ModelLayout,
    SyncReport,
    WeightMismatch,
    WeightSync,
    check_layout,
    host_copy,
    probe_servers,
    push_tensors,
)
from megamu.engines.types import GeneratedSample
from megamu.engines.weights import LogprobProbe

Logprobs = Callable[[list[int], str], list[float]]  # SGLangEngine.teacher_forced_logprobs(token_ids, url)


class ServerWeights:
    """The servers' weight state (see the module's docstring). ``logprobs`` scores a probe on one server."""

    def __init__(self, pool: ServerPool, config: SGLangConfig, logprobs: Logprobs):
        self.pool, self.config, self.logprobs = pool, config, logprobs
        self.sync = WeightSync()  # the in-memory weight-sync group and the restore copy
        self.layout: ModelLayout | None = None  # the running model's, when its folder is readable here
        self.server_dtype: str | None = None
        self.version: str | None = None  # what the servers serve now: every sample must carry it
        self.launch_version: str | None = None  # what a restarted server loads from its launch folder
        self.folder: str | None = None  # the last disk sync's folder: what a restarted server is given

    def read(self, infos: list[dict], served: str | None, launched: bool) -> None:
        """The servers' answers (/server_info with /model_info) at start: dtype, layout, the version they agree on;
        this is also what a restarted server will load."""
        first = infos[0] if infos else {}
        self.server_dtype = self.config.dtype if launched else first.get("dtype")
        try:
            self.layout = ModelLayout.from_folder(served) if served else None
        except (WeightMismatch, OSError, ValueError):
            self.layout = None  # a remote server's folder we cannot read: only the architecture is checked
        versions = {str((i.get("model_info") or {}).get("weight_version")) for i in infos if i.get("model_info")}
        if len(versions) > 1:
            raise SGLangError(f"the servers run different weight versions {sorted(versions)}: sync them first")
        self.version = versions.pop() if versions else None
        self.launch_version, self.folder = self.version, None

    def check_samples(self, samples: list[GeneratedSample], what: str) -> None:
        """Samples must be from the weights of the last sync, which the trainer's importance ratio assumes."""
        stale = [s.weight_version for s in samples if self.version and s.weight_version != self.version]
        if stale:
            raise SGLangError(f"{what}: made by weight version {stale[0]}, but the servers were synced to "
                              f"{self.version}")

    def update(self, hf_dir, state_dict, version, probe: LogprobProbe | None) -> SyncReport:
        """Check, send, verify: SGLangEngine.update_weights."""
        if (hf_dir is None) == (state_dict is None):
            raise ValueError("update_weights needs exactly one of hf_dir or state_dict")
        t0 = time.monotonic()
        if version is None:
            version = int(self.version) + 1 if str(self.version).isdigit() else 1
        version = str(version)
        if hf_dir is not None:
            new = ModelLayout.from_folder(hf_dir)
            if self.layout is not None:
                check_layout(new, self.layout, self.server_dtype, f"weights in {hf_dir}")
            self.pool.post_all("/update_weights_from_disk",
                               {"model_path": str(hf_dir), "flush_cache": True, "weight_version": version},
                               f"weight update from {hf_dir}", timeout=self.reload_timeout(hf_dir))
            self.layout, sent, mode = new, 0, "disk"
            self.sync.restore_tensors = None
        else:
            self.check_pushable(state_dict)
            try:
                sent, mode = push_tensors(self.pool, self.sync, state_dict, version)
            except BaseException:
                # The servers may hold part of the new weights under the old version: expect a version no server
                # reports, so every sample generated before a successful sync is refused.
                self.version = f"{version} (incomplete sync)"
                raise
            self.keep_for_restarts(state_dict)
        report = self.confirm(version, probe, folder=hf_dir)
        return SyncReport(mode, time.monotonic() - t0, version, sent, report.probe_mean_abs_diff)

    def reload_timeout(self, hf_dir) -> float:
        """One attempt of ``/update_weights_from_disk`` from ``hf_dir``: the model's load time, at least a control
        call's bound."""
        return max(self.config.control_timeout_s, load_seconds(model_bytes(hf_dir)))

    def check_pushable(self, state_dict: dict) -> None:
        """Refuse, before anything is sent, in-memory weights that do not fit the running model."""
        if self.layout is None:
            raise WeightMismatch("an in-memory sync needs the running model's layout (its HF folder readable here)")
        new = ModelLayout.from_state_dict(state_dict, self.layout.architectures, self.layout.tied_embeddings)
        check_layout(new, self.layout, self.server_dtype, "in-memory weights")

    def pushed_by_ranks(self, state_dict: dict, version) -> None:
        """The trainer's ranks pushed ``state_dict`` to these servers themselves (rank_push.py): expect ``version``
        on the samples, and keep the host copy a restarted server gets back."""
        self.version, self.folder = str(version), None
        self.keep_for_restarts(state_dict)

    def keep_for_restarts(self, state_dict: dict) -> None:
        """A restarted server loads its launch folder, then these (health.py): a host copy of the last in-memory
        push, none when no server is restarted."""
        sync = self.sync
        sync.restore_tensors = host_copy(state_dict, sync.restore_tensors) if self.config.max_restarts else None

    def confirm(self, version, probe: LogprobProbe | None, folder=None) -> SyncReport:
        """Every server reports weight version ``version`` (else RuntimeError), which is then expected on every
        sample, and serves the probe's log-probs. Also what rank 0 runs after each node pushed to its own servers."""
        t0, version = time.monotonic(), str(version)
        try:
            infos = [self.pool.call(u, "/model_info", None, timeout=60.0) or {} for u in self.pool.control_urls]
        except RuntimeError as e:  # a router may not forward /model_info; the samples' versions are still checked
            if getattr(e, "status", None) != 404:
                raise
            infos = [{"weight_version": version}]
        got = {str(i.get("weight_version")) for i in infos}
        if got != {version}:
            raise RuntimeError(f"after the sync the servers report weight version(s) {sorted(got)}, not {version}")
        self.version = version
        self.folder = str(folder) if folder is not None else None  # what a restarted server loads (health.py)
        probe_diff = self.check_probe(probe) if probe is not None else None
        return SyncReport("confirm", time.monotonic() - t0, version, 0, probe_diff)

    def check_probe(self, probe: LogprobProbe) -> float:
        """The worst server's mean |log-prob difference| on the probe; raises WeightMismatch beyond its tolerance.
        The servers must hold their KV cache (a colocated server that released it checks after taking it back)."""
        return probe_servers(probe, self.pool.control_urls, self.logprobs)

    def restorable(self) -> bool:
        """Whether a restarted server, which loads the launch folder, can serve the last sync: no sync came since
        launch, or ``restore`` has them, from the last disk sync's folder or the host copy of an in-memory push."""
        return self.version == self.launch_version or self.folder is not None or self.sync.restore_tensors is not None

    def restore(self, url: str) -> None:
        """Give server ``url`` the weights of the last sync when it serves others (a restart loads the launch
        folder): the folder of the last disk sync, or the host copy of the last in-memory push."""
        served = str((self.pool.call(url, "/model_info", None, timeout=60.0) or {}).get("weight_version"))
        if self.version is None or served == str(self.version):
            return
        if self.folder is not None:
            self.pool.post_with_retries([url], "/update_weights_from_disk",
                                        {"model_path": self.folder, "flush_cache": True,
                                         "weight_version": self.version}, f"restoring the weights of {url}",
                                        timeout=self.reload_timeout(self.folder), retry_timeouts=True)
        elif self.sync.restore_tensors is not None:
            push_tensors(self.pool, self.sync, self.sync.restore_tensors, str(self.version), urls=[url])
        else:
            raise SGLangError(f"it serves weight version {served}, not {self.version}, which was pushed in memory by "
                              "another process: that process restores it")
        after = str((self.pool.call(url, "/model_info", None, timeout=60.0) or {}).get("weight_version"))
        if after != str(self.version):
            raise SGLangError(f"after restoring its weights it reports version {after}, not {self.version}")

    def close(self) -> None:
        self.sync.close()


