"""Streaming safetensors folders: lazy reader, sharded writer (atomic folder replacement is megamu.runtime.atomic's)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def _read_header(path: Path) -> tuple[dict, int]:
    """(tensor entries, offset of the data section) of a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsDir:
    """Tensors of a (possibly sharded) safetensors folder, read one at a time.

    Plain reads rather than mmap: a mapped file stays resident (and counted in RSS) while the handle lives, so
    streaming a model through an mmap reader would hold the whole input in memory.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.exists():
            files = sorted({self.folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.folder}: no *.safetensors files and no {INDEX}")
        self.entries: dict[str, tuple[Path, int, dict]] = {}
        for f in files:
            header, start = _read_header(f)
            for name, entry in header.items():
                self.entries[name] = (f, start, entry)

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def get(self, name: str) -> torch.Tensor:
        if name not in self.entries:
            raise KeyError(f"tensor {name!r} is not in {self.folder}")
        path, start, entry = self.entries[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        buf = bytearray(end - begin)
        if buf:
            with open(path, "rb") as f:
                f.seek(start + begin)
                f.readinto(buf)
        tensor = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        return tensor.reshape(entry["shape"])


def write_shards(
    items: Iterable[tuple[str, torch.Tensor]],
    folder: Path,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    prefix: str = "model",
) -> tuple[dict[str, str], int]:
    """Write tensors as ``{prefix}-0000i-of-0000n.safetensors``, holding at most one shard in memory; no index.

    Returns (tensor name -> file name, total bytes): several writers (checkpoint ranks) each write their own
    shards into one folder with distinct prefixes, and one of them writes the index for all (``write_index``)."""
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, total, written = 0, 0, []  # written: (temp file, names)

    def flush() -> None:
        nonlocal shard, shard_bytes
        tmp = folder / f".{prefix}-shard-{len(written)}.safetensors"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        _fsync(tmp)
        written.append((tmp, list(shard)))
        shard, shard_bytes = {}, 0

    for name, t in items:
        if name in shard or any(name in names for _, names in written):
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = t.numel() * t.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[name] = t.detach().to("cpu").contiguous()  # GPU tensors are written from host memory
        shard_bytes += nbytes
        total += nbytes
    if shard or not written:
        flush()
    weight_map = {}
    for i, (tmp, names) in enumerate(written):
        final = f"{prefix}-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(tmp, folder / final)
        weight_map.update(dict.fromkeys(names, final))
    return weight_map, total


def write_index(folder: Path, weight_map: dict[str, str], total_bytes: int, metadata: dict | None = None) -> dict:
    """The ``model.safetensors.index.json`` that ``SafetensorsDir`` (and transformers) read, fsynced."""
    index = {"metadata": {"total_size": total_bytes, **(metadata or {})}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _fsync(folder / INDEX)
    return index


def write_sharded(
    items: Iterable[tuple[str, torch.Tensor]],
    folder: Path,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: dict | None = None,
) -> dict:
    """Write tensors as model-0000i-of-0000n.safetensors + index, holding at most one shard in memory."""
    weight_map, total = write_shards(items, folder, max_shard_bytes)
    return write_index(folder, weight_map, total, metadata)


def _fsync(path: Path) -> None:
    """Data on disk before the folder is renamed into place: after a power loss the rename must not outlive it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_meta_files(src: Path, dst: Path, skip: Iterable[str] = ()) -> None:
    """Copy config, tokenizer and generation files (everything that is not weights or a weight index)."""
    skip = set(skip) | {INDEX, "pytorch_model.bin.index.json"}
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and f.name not in skip and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, dst / f.name)
