"""Durable stage datasets: Parquet shards of complete prompt groups plus a ``manifest.json`` written last.

Layout of ``rollouts/stage_k/``: ``shard-00000.parquet`` ... (each a fixed number of complete groups, written to a
temporary name and renamed, so a shard file is either whole or absent) and ``manifest.json`` (counts, sha256 of
every shard, sampling config, engine, model, reward statistics). A directory without a manifest is an unfinished
rollout; the reader refuses it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megamu.data.order import epoch_stream
from megamu.rollout.records import RolloutSample
from megamu.runtime.atomic import atomic_write

MANIFEST = "manifest.json"
FORMAT_VERSION = 1

# Log-probs and advantages as float32: engines produce fp32 log-probs, so nothing is lost and shards stay small.
SCHEMA = pa.schema([
    ("prompt_id", pa.int64()),
    ("sample_index", pa.int32()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("behaviour_logprobs", pa.list_(pa.float32())),
    ("reward", pa.float64()),
    ("advantage", pa.float32()),
    ("finish_reason", pa.string()),
    ("response_length", pa.int32()),
    ("stage", pa.int32()),
    ("policy_version", pa.int64()),
])


class StageDatasetError(RuntimeError):
    """A stage dataset that is unfinished, corrupt or inconsistent; the message names the file."""


@dataclass
class ShardInfo:
    file: str
    sha256: str
    num_rows: int
    num_groups: int
    t_generate_s: float = 0.0
    deterministic: bool | None = None  # made by an engine that draws each sample from its seed alone (None: unknown)


@dataclass
class StageManifest:
    stage: int
    num_groups: int
    group_size: int
    num_shards: int
    shards: list[ShardInfo]
    sampling: dict
    engine: str
    model_path: str
    policy_version: int = 0
    reward_mean: float = 0.0
    all_correct_fraction: float = 0.0  # groups whose every reward is >= 1
    all_wrong_fraction: float = 0.0  # groups whose every reward is <= 0
    truncation_rate: float = 0.0  # samples that hit max_new_tokens
    mean_response_length: float = 0.0
    t_rollout_s: float = 0.0  # generation + scoring time summed over shards (across resumed runs)
    deterministic: bool | None = None  # every shard's engine drew from seeds alone (False if any did not)
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> StageManifest:
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["shards"] = [ShardInfo(**s) for s in data["shards"]]
        return cls(**data)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


_MODES = {True: b"true", False: b"false", None: b"unknown"}


def combined_mode(modes: list[bool | None]) -> bool | None:
    """Deterministic as a whole: False if any part is not, True if all are, else None (unknown)."""
    return False if False in modes else True if modes and all(modes) else None


def write_shard(out_dir: str | Path, index: int, groups: list[list[RolloutSample]], t_generate_s: float = 0.0,
                deterministic: bool | None = None) -> ShardInfo:
    """Write complete groups as one shard, atomically; the generation time and whether the engine drew each sample
    from its seed alone travel in the file's metadata."""
    rows = [s for g in groups for s in g]
    table = pa.Table.from_pydict(
        {
            "prompt_id": [s.prompt_id for s in rows],
            "sample_index": [s.sample_index for s in rows],
            "prompt_ids": [s.prompt_ids for s in rows],
            "response_ids": [s.response_ids for s in rows],
            "behaviour_logprobs": [s.behaviour_logprobs for s in rows],
            "reward": [s.reward for s in rows],
            "advantage": [s.advantage for s in rows],
            "finish_reason": [s.finish_reason for s in rows],
            "response_length": [len(s.response_ids) for s in rows],
            "stage": [s.stage for s in rows],
            "policy_version": [s.policy_version for s in rows],
        },
        schema=SCHEMA.with_metadata({"megamu.t_generate_s": str(t_generate_s), "megamu.num_groups": str(len(groups)),
                                     "megamu.deterministic": _MODES[deterministic]}),
    )
    path = Path(out_dir) / shard_name(index)
    atomic_write(path, lambda p: pq.write_table(table, p))
    return ShardInfo(path.name, sha256_file(path), len(rows), len(groups), t_generate_s, deterministic)


def shard_info(path: Path) -> ShardInfo:
    """ShardInfo of an existing shard file (used when a resumed phase finds shards of an earlier run)."""
    meta = pq.read_schema(path).metadata or {}
    num_rows = pq.read_metadata(path).num_rows
    return ShardInfo(path.name, sha256_file(path), num_rows, int(meta.get(b"megamu.num_groups", b"0")),
                     float(meta.get(b"megamu.t_generate_s", b"0")), shard_mode(path))


def shard_mode(path: Path) -> bool | None:
    """Whether the engine that wrote this shard drew each sample from its seed alone (None: unknown or older)."""
    value = (pq.read_schema(path).metadata or {}).get(b"megamu.deterministic", b"unknown")
    return {v: k for k, v in _MODES.items()}.get(value)


def table_to_samples(table: pa.Table) -> list[RolloutSample]:
    cols = table.to_pydict()
    return [
        RolloutSample(
            prompt_id=cols["prompt_id"][i],
            sample_index=cols["sample_index"][i],
            prompt_ids=cols["prompt_ids"][i],
            response_ids=cols["response_ids"][i],
            behaviour_logprobs=cols["behaviour_logprobs"][i],
            reward=cols["reward"][i],
            advantage=cols["advantage"][i],
            finish_reason=cols["finish_reason"][i],
            stage=cols["stage"][i],
            policy_version=cols["policy_version"][i],
        )
        for i in range(table.num_rows)
    ]


def group_stats(rewards: list[list[float]], finish_reasons: list[str], lengths: list[int]) -> dict:
    n_groups = max(len(rewards), 1)
    n = max(len(finish_reasons), 1)
    flat = [r for g in rewards for r in g]
    return dict(
        reward_mean=sum(flat) / max(len(flat), 1),
        all_correct_fraction=sum(all(r >= 1.0 for r in g) for g in rewards) / n_groups,
        all_wrong_fraction=sum(all(r <= 0.0 for r in g) for g in rewards) / n_groups,
        truncation_rate=sum(f == "length" for f in finish_reasons) / n,
        mean_response_length=sum(lengths) / n,
    )


def write_manifest(out_dir: str | Path, manifest: StageManifest) -> None:
    path = Path(out_dir) / MANIFEST
    atomic_write(path, lambda p: p.write_text(json.dumps(asdict(manifest), indent=2)))


def read_manifest(stage_dir: str | Path) -> StageManifest:
    path = Path(stage_dir) / MANIFEST
    if not path.exists():
        raise StageDatasetError(f"{path} is missing: the rollout of {stage_dir} is unfinished (rerun it to resume)")
    try:
        return StageManifest.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise StageDatasetError(f"{path}: unreadable manifest ({e})") from e


class StageDataset:
    """Reader of a finished stage: validated against the manifest, groups served in a seeded shuffled order."""

    def __init__(self, stage_dir: str | Path, *, verify: bool = True):
        self.dir = Path(stage_dir)
        self.manifest = read_manifest(self.dir)
        m = self.manifest
        if len(m.shards) != m.num_shards:
            raise StageDatasetError(f"{self.dir / MANIFEST}: {len(m.shards)} shards listed, num_shards={m.num_shards}")
        self._tables: list[pa.Table] = []
        self._group_at: list[tuple[int, int]] = []  # group index -> (shard, first row)
        for s_idx, info in enumerate(m.shards):
            path = self.dir / info.file
            if not path.exists():
                raise StageDatasetError(f"{path}: shard listed in the manifest is missing")
            if verify and sha256_file(path) != info.sha256:
                raise StageDatasetError(f"{path}: sha256 does not match the manifest (corrupt or replaced shard)")
            table = pq.read_table(path)
            if table.num_rows != info.num_rows or info.num_rows != info.num_groups * m.group_size:
                raise StageDatasetError(
                    f"{path}: {table.num_rows} rows, manifest says {info.num_rows} rows of {info.num_groups} groups "
                    f"x {m.group_size}"
                )
            self._tables.append(table)
            self._group_at += [(s_idx, g * m.group_size) for g in range(info.num_groups)]
        if len(self._group_at) != m.num_groups:
            raise StageDatasetError(f"{self.dir}: shards hold {len(self._group_at)} groups, manifest {m.num_groups}")

    @property
    def num_groups(self) -> int:
        return self.manifest.num_groups

    @property
    def group_size(self) -> int:
        return self.manifest.group_size

    def group(self, index: int) -> list[RolloutSample]:
        shard, row = self._group_at[index]
        return table_to_samples(self._tables[shard].slice(row, self.group_size))

    def groups(self) -> list[list[RolloutSample]]:
        return [self.group(i) for i in range(self.num_groups)]

    def samples(self) -> list[RolloutSample]:
        return [s for t in self._tables for s in table_to_samples(t)]

    def update_order(self, groups_per_update: int, seed: int, num_updates: int | None = None) -> list[list[int]]:
        """Group indices of each update: epochs of seeded permutations chained end to end, cut into B_mini slices.

        Default ``num_updates`` is one epoch, num_groups // groups_per_update (a remainder is left out)."""
        if not 0 < groups_per_update <= self.num_groups:
            raise ValueError(f"groups_per_update must be in 1..{self.num_groups} (groups in {self.dir}), "
                             f"got {groups_per_update}")
        if num_updates is None:
            num_updates = self.num_groups // groups_per_update
        stream = epoch_stream(self.num_groups, seed, 0, num_updates * groups_per_update)
        return [stream[u * groups_per_update : (u + 1) * groups_per_update] for u in range(num_updates)]

    def minibatches(self, groups_per_update: int, seed: int, start_update: int = 0, num_updates: int | None = None
                    ) -> Iterator[list[RolloutSample]]:
        """Yield the samples of updates ``start_update`` .. ``num_updates - 1`` (resume at an update offset)."""
        for group_ids in self.update_order(groups_per_update, seed, num_updates)[start_update:]:
            yield [s for g in group_ids for s in self.group(g)]
