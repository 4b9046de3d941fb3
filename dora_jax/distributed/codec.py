"""Bytes for messages between processes: msgpack with numpy arrays, never pickle.

What crosses a process boundary (control messages, request records, KV pages of a parked
request) is plain data: dicts, lists, numbers, strings, bytes and numpy arrays (``dtype``,
``shape`` and raw bytes). Decoding runs no code from the message, so a message from another
process (or anything that connects to a coordinator port) cannot execute anything here.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

_ND = 1  # msgpack extension type of a numpy array


def _default(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        head = msgpack.packb([x.dtype.str, list(x.shape)])
        return msgpack.ExtType(_ND, head + np.ascontiguousarray(x).tobytes())
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, tuple):
        return list(x)
    raise TypeError(f"cannot send a {type(x).__name__} between processes: {x!r:.80}")


def _ext(code: int, data: bytes) -> Any:
    if code != _ND:
        raise ValueError(f"unknown extension type {code} in a message")
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    dtype, shape = next(unpacker)
    body = data[unpacker.tell() :]
    return np.frombuffer(body, dtype=np.dtype(dtype)).reshape(shape).copy()


def encode(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext, raw=False, strict_map_key=False)
