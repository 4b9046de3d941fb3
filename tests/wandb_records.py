"""Reads the history of an offline Weights & Biases run from its ``run-*.wandb`` file, for the
tests (the wandb package no longer ships a reader). The file is a 7-byte header (``:W&B``, magic,
version) and then a LevelDB-style log: 32 KiB blocks of records, each with a 7-byte header (CRC,
little-endian length, type: 1 full, 2 first, 3 middle, 4 last), a block's tail under 7 bytes
padded; each assembled record is a ``wandb_internal_pb2.Record`` protobuf."""

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024


def records(path: Path):
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb run file")
    from wandb.proto import wandb_internal_pb2 as pb

    pos, chunks = 7, []
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        chunks.append(body)
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(b"".join(chunks))
            chunks = []
            yield rec


def history(path: Path) -> list[dict]:
    """Every logged row: ``{key: value}`` (nested keys joined with ``/``, values from JSON)."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows
