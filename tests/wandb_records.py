"""Read back what wandb wrote offline: the history rows of a ``run-<id>.wandb`` file, parsed independently of the
logger that wrote them. The file is wandb's transaction log: a 7-byte header (``:W&B``, magic, version), then
LevelDB-log framed records (32 KiB blocks; each chunk a 7-byte header of crc32, length and type FULL=1, FIRST=2,
MIDDLE=3, LAST=4), each record a ``wandb_internal_pb2.Record`` protobuf."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7


def history_rows(path: Path) -> list[dict]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb transaction log"
    pos, chunk, rows = HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        pos += HEADER
        if kind == 0:  # zero padding up to the block's end
            pos += left - HEADER
            continue
        chunk += data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows
