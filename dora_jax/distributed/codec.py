"""Bytes for messages between processes: the checkpoints' record codec (``dora_jax.state_codec``)
in msgpack, with numpy arrays as raw bytes; never pickle.

What crosses a process boundary (commands, their values, group events, the metadata of a
handover) is plain data and the record types the state codec lists; numpy arrays travel as
``dtype``, ``shape`` and raw bytes. Decoding builds only those, and runs no code from the
message, so a message from another process (or anything that connects to a coordinator port)
cannot execute anything here.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import msgpack
import numpy as np

from dora_jax import state_codec

_ND = 1  # msgpack extension type of a numpy array


def dtype_tag(dt: np.dtype) -> str:
    """NumPy's own types by their type string (``<f4``); the extension types jax uses
    (``bfloat16``, the float8 types: all ``V`` to NumPy) by name."""
    return dt.name if dt.kind == "V" else dt.str


def dtype_from_tag(tag: str) -> np.dtype:
    if tag[:1] in "<>|=":
        return np.dtype(tag)
    t = getattr(ml_dtypes, tag, None)
    if t is None or not isinstance(t, type):
        raise ValueError(f"unknown array dtype {tag!r} in a message")
    return np.dtype(t)


def _default(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        head = msgpack.packb([dtype_tag(x.dtype), list(x.shape)])
        return msgpack.ExtType(_ND, head + np.ascontiguousarray(x).tobytes())
    raise TypeError(f"cannot send a {type(x).__name__} between processes: {x!r:.80}")


def _ext(code: int, data: bytes) -> Any:
    if code != _ND:
        raise ValueError(f"unknown extension type {code} in a message")
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    dtype, shape = next(unpacker)
    body = data[unpacker.tell() :]
    return np.frombuffer(body, dtype=dtype_from_tag(dtype)).reshape(shape).copy()


def encode(obj: Any) -> bytes:
    tree, arrays = state_codec.encode(obj, inline_bytes=0)
    return msgpack.packb([tree, arrays], default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    tree, arrays = msgpack.unpackb(data, ext_hook=_ext, raw=False, strict_map_key=False)
    return state_codec.decode(tree, arrays)
