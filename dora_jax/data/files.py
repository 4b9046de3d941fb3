"""Rows of a dataset file as users have them: JSONL, Parquet, or a local Hugging Face dataset.

:func:`read_rows` returns ``[(number, row), ...]``: the line number of a JSONL row, the 1-based
row index otherwise, so every later error can say where the row is. Parquet needs ``pyarrow``
and the ``hf`` kind the ``datasets`` package (the ``data`` extra); a missing one is named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

KINDS = ("jsonl", "parquet", "hf")


class DataError(ValueError):
    """A data file is missing or malformed, or a row lacks a needed field; the message names
    the file and the line or row."""


def read_rows(
    kind: str, path: str | Path, split: str = "train", *, setting: str = "data.path / eval.path"
) -> list[tuple[int, Any]]:
    """The rows of ``path`` read as ``kind`` (``data.task``); ``setting`` names the config field
    that points at ``path``, for a missing file."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file ({setting})")
    if kind == "jsonl":
        return _jsonl(p)
    if kind == "parquet":
        return _numbered(_parquet_table(p).to_pylist())
    if kind == "hf":
        return _numbered(_hf_rows(p, split))
    raise DataError(f"{p}: unknown dataset kind {kind!r} (expected one of {', '.join(KINDS)})")


def _numbered(rows: list[Any]) -> list[tuple[int, Any]]:
    return list(enumerate(rows, start=1))


def _jsonl(p: Path) -> list[tuple[int, Any]]:
    if not p.is_file():
        raise DataError(f"{p}: not a file (a JSONL dataset is one file)")
    out = []
    with p.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{p}:{n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                out.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{n}: not valid JSON ({e.msg})") from None
    return out


def _parquet_table(p: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{p}: reading Parquet needs pyarrow (pip install 'dora-jax[data]')"
        ) from None
    try:
        return pq.read_table(p)
    except Exception as e:  # pyarrow raises several types for a malformed file
        raise DataError(f"{p}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _hf_rows(p: Path, split: str) -> list[Any]:
    """A ``save_to_disk`` directory (a Dataset, or a DatasetDict and its ``split``), or a
    ``.json``/``.jsonl``/``.parquet`` file through ``load_dataset``."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{p}: data.task=hf needs the datasets package (pip install 'dora-jax[data]')"
        ) from None
    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p))
        except FileNotFoundError as e:
            raise DataError(f"{p}: not a dataset saved with save_to_disk ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{p}: no split {split!r} (has: {sorted(ds)}; data.split)")
            ds = ds[split]
    else:
        builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(p.suffix)
        if builder is None:
            raise DataError(
                f"{p}: data.task=hf reads a save_to_disk directory or a .json, "
                ".jsonl or .parquet file"
            )
        ds = datasets.load_dataset(builder, data_files=str(p), split=split)
    return ds.to_list()
