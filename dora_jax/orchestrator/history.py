"""A run's per-event history on disk, so that what a run holds in memory does not grow with it.

:class:`~dora_jax.orchestrator.records.Records` attached to a run directory (:meth:`Records.attach`)
writes what it gathered at every published version and forgets it. Two append-only files:

- ``records.jsonl``: one line per flush, ``{"records": {kind: [record, ...]}}`` for every kind of
  record gathered since the last flush (per-tick group rows, wall-clock spans, cluster rows, train
  steps, plans, weight transfers, migrations, discards, moves between processes, adaptive-K
  choices), in the checkpoint codec's encoding (:mod:`dora_jax.state_codec`), so floats and
  record types read back exactly;
- ``consumed.jsonl``: one line per trajectory handed to the trainer: its request id, prompt group,
  version, the trainer version that consumed it, staleness, prompt and response lengths, version
  span and the tick (seconds on the wall clock) it was consumed at.

A checkpoint stores the two files' lengths in bytes. On ``--resume`` each file is cut back to its
length at the checkpoint (a killed run may have written past it), exactly like ``metrics.jsonl``,
so nothing is counted twice. The summary and the timeline plot read the files back at the end of
a run (:meth:`HistoryFiles.read`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from dora_jax import state_codec
from dora_jax.orchestrator.transfer_queue import ConsumedRecord

RECORDS_FILE = "records.jsonl"
CONSUMED_FILE = "consumed.jsonl"
FILES = (RECORDS_FILE, CONSUMED_FILE)
_CONSUMED_FIELDS = tuple(f.name for f in dataclasses.fields(ConsumedRecord))


class HistoryError(RuntimeError):
    """A history file cannot be read back (message names the file and line)."""


class HistoryFiles:
    """The two history files of ``run_dir``. ``offsets`` (bytes of each file) continue a run
    from its checkpoint: longer files are cut back to them; ``None`` starts both empty."""

    def __init__(self, run_dir: str | Path, offsets: tuple[int, int] | None = None):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.paths = tuple(Path(run_dir) / name for name in FILES)
        self.short: list[str] = []  # files found shorter than the checkpoint says (a note)
        for path, offset in zip(self.paths, offsets or (0, 0), strict=True):
            size = path.stat().st_size if path.is_file() else 0
            if offsets is not None and size < offset:
                self.short.append(path.name)
            if size > offset or (offsets is None and path.is_file()):
                with open(path, "r+b") as f:
                    f.truncate(offset)
            elif not path.is_file():
                path.touch()
        self.offsets = tuple(p.stat().st_size for p in self.paths)

    def append(self, records: dict[str, list], consumed: list[ConsumedRecord]) -> tuple[int, int]:
        """Append one flush; returns the files' new lengths (what a checkpoint stores)."""
        if any(records.values()):
            tree, arrays = state_codec.encode({"records": records})
            if arrays:  # (records hold no arrays; a guard against a future field)
                raise HistoryError(f"{self.paths[0]}: a record holds a large array")
            self._write(0, json.dumps(tree, allow_nan=False, separators=(",", ":")) + "\n")
        if consumed:
            lines = [json.dumps(dataclasses.asdict(c), separators=(",", ":")) for c in consumed]
            self._write(1, "\n".join(lines) + "\n")
        self.offsets = tuple(p.stat().st_size for p in self.paths)
        return self.offsets

    def _write(self, which: int, text: str) -> None:
        with open(self.paths[which], "a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> tuple[list[dict[str, list]], list[ConsumedRecord]]:
        """Every flush of ``records.jsonl`` (a dict of kind -> records each) and every consumed
        trajectory, in order, up to the lengths of the last flush."""
        return read_history(self.paths[0].parent, self.offsets)


def read_history(
    run_dir: str | Path, offsets: tuple[int, int] | None = None
) -> tuple[list[dict[str, list]], list[ConsumedRecord]]:
    """The history files of ``run_dir`` (up to ``offsets`` bytes, else whole): the flushes of
    ``records.jsonl`` and the consumed trajectories. A torn last line is left out."""
    paths = [Path(run_dir) / name for name in FILES]
    texts = []
    for i, path in enumerate(paths):
        data = path.read_bytes() if path.is_file() else b""
        texts.append(data[: offsets[i]] if offsets is not None else data)
    flushes = [state_codec.decode(row, {})["records"] for row in _rows(texts[0], paths[0])]
    consumed = []
    for row in _rows(texts[1], paths[1]):
        try:
            consumed.append(ConsumedRecord(**{k: row[k] for k in _CONSUMED_FIELDS}))
        except (KeyError, TypeError) as e:
            raise HistoryError(f"{paths[1]}: a line without the field {e}") from None
    return flushes, consumed


def _rows(data: bytes, path: Path) -> list[Any]:
    lines = data.decode("utf-8", errors="replace").split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i >= len(lines) - 2:  # a torn last line (the file ends with it, or with "\n")
                break
            raise HistoryError(f"{path}:{i + 1}: not a JSON line") from None
    return out
