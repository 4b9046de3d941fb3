"""Plain-data state <-> JSON text plus numpy arrays, without pickle.

A checkpoint's host state (the control plane, everything in flight, the trainer log) is a tree of
``None``, booleans, integers, floats, strings, lists, tuples, dicts, numpy arrays and scalars, and
a fixed set of record types (the dataclasses and named tuples listed in :data:`RECORD_TYPES`).
:func:`encode` turns such a tree into a JSON-able tree and a dict of large arrays; :func:`decode`
turns them back. Decoding builds only the listed record types (looked up by module and name), so
reading a checkpoint never runs code named by the file, unlike ``pickle``.

Encoding of what JSON has no literal for:

- a tuple is ``{"__tuple__": [...]}``; a dict whose keys are not all plain strings is
  ``{"__dict__": [[key, value], ...]}``; a set is ``{"__set__": [...]}``;
- a non-finite float is ``{"__float__": "nan" | "inf" | "-inf"}``; bytes are base64;
- a numpy array of fewer than :data:`INLINE_BYTES` bytes is inline (dtype, shape, base64 of its
  bytes: exact for every dtype); a larger one is ``{"__array__": "a3"}``, a key of the arrays
  dict, which the caller stores as arrays (the engines' KV pages); a numpy scalar keeps its type;
- a ``jax.Array`` is copied to the host and comes back as a numpy array;
- a record is ``{"__record__": "module:Name", "fields": {...}}``.

Anything else raises :class:`StateCodecError` naming where in the tree it is, at save time.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import importlib
import json
import math
from typing import Any

import numpy as np

INLINE_BYTES = 1 << 14

# The record types a host state may hold: "module:Name", or "module:*" for the records a module
# lists in its RECORDS tuple. Decoding builds nothing else.
RECORD_TYPES = (
    "dora_jax.orchestrator.backend:GroupInfo",
    "dora_jax.orchestrator.backend:GroupTick",
    "dora_jax.orchestrator.backend:PartialRequest",
    "dora_jax.orchestrator.backend:RequestSpec",
    "dora_jax.orchestrator.backend:FinishedRequest",
    "dora_jax.orchestrator.backend:StepEvents",
    "dora_jax.orchestrator.records:ClusterTick",
    "dora_jax.orchestrator.records:StepRecord",
    "dora_jax.orchestrator.records:PlanRecord",
    "dora_jax.orchestrator.records:Records",
    "dora_jax.orchestrator.transfer_queue:ReadyGroup",
    "dora_jax.orchestrator.transfer_queue:ConsumedRecord",
    "dora_jax.orchestrator.rollout_manager:PromptSpec",
    "dora_jax.execution.payloads:PromptPayload",
    "dora_jax.execution.payloads:Completion",
    "dora_jax.execution.backend:Overheads",
    "dora_jax.rollout.requests:Request",
    "dora_jax.rollout.requests:EngineFinished",
    "dora_jax.rollout.requests:ExportedRequests",
    "dora_jax.rollout.moves:EngineSnapshot",
    "dora_jax.train.batch:TrainBatch",
    "dora_jax.execution.commands:*",  # every record its RECORDS tuple names
)


class StateCodecError(ValueError):
    """A value the codec cannot write, or a stored tree it cannot read back."""


@functools.cache
def _listed(module: str, qualname: str) -> bool:
    if f"{module}:{qualname}" in RECORD_TYPES:
        return True
    if f"{module}:*" not in RECORD_TYPES:
        return False
    records = getattr(importlib.import_module(module), "RECORDS", ())
    return any(r.__qualname__ == qualname for r in records)


def _record_name(x: Any) -> str | None:
    module, qualname = type(x).__module__, type(x).__qualname__
    return f"{module}:{qualname}" if _listed(module, qualname) else None


RENAMED = {"dora_jax.rollout.requests:FinishedRequest": "dora_jax.rollout.requests:EngineFinished"}


def _record_type(name: str) -> type:
    module, _, qualname = RENAMED.get(name, name).partition(":")
    if not _listed(module, qualname):
        raise StateCodecError(f"the state names a record type {name!r} this version does not read")
    return getattr(importlib.import_module(module), qualname)


def _dtype_name(dtype: np.dtype) -> str:
    return dtype.name if dtype.kind != "V" else str(dtype)


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16" or name.startswith("float8"):
        import ml_dtypes  # noqa: F401  (registers the dtype names with numpy)

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def encode(obj: Any, inline_bytes: int = INLINE_BYTES) -> tuple[Any, dict[str, np.ndarray]]:
    """``(json-able tree, {key: large array})``; see the module docstring (arrays of fewer than
    ``inline_bytes`` bytes are inline; messages between processes keep every array apart)."""
    arrays: dict[str, np.ndarray] = {}

    def array(a: np.ndarray) -> Any:
        shape = list(a.shape)  # (ascontiguousarray makes a 0-d array 1-d)
        a = np.ascontiguousarray(a).reshape(shape)
        if a.dtype.hasobject:
            raise TypeError("an array of Python objects")
        if a.nbytes >= inline_bytes:
            key = f"a{len(arrays)}"
            arrays[key] = a
            return {"__array__": key}
        data = base64.b64encode(a.tobytes()).decode("ascii")
        return {"__ndarray__": [_dtype_name(a.dtype), shape, data]}

    def enc(x: Any, where: str) -> Any:
        if x is None or isinstance(x, bool | str):
            return x
        if isinstance(x, int) and not isinstance(x, np.generic):
            return int(x)
        if isinstance(x, float) and not isinstance(x, np.generic):
            if math.isfinite(x):
                return float(x)
            return {"__float__": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
        if isinstance(x, list):
            return [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]
        name = _record_name(x)
        if name is not None:
            if dataclasses.is_dataclass(x):
                names = [f.name for f in dataclasses.fields(x)]
            else:
                names = list(x._fields)
            fields = {n: enc(getattr(x, n), f"{where}.{n}") for n in names}
            return {"__record__": name, "fields": fields}
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: enc(v, f"{where}.{k}") for k, v in x.items()}
            return {
                "__dict__": [
                    [enc(k, f"{where} key"), enc(v, f"{where}[{k!r}]")] for k, v in x.items()
                ]
            }
        if isinstance(x, set | frozenset):
            return {"__set__": [enc(v, f"{where} item") for v in sorted(x)]}
        if isinstance(x, bytes):
            return {"__bytes__": base64.b64encode(x).decode("ascii")}
        if isinstance(x, np.generic):
            a = np.asarray(x)
            return {
                "__scalar__": [_dtype_name(a.dtype), base64.b64encode(a.tobytes()).decode("ascii")]
            }
        if isinstance(x, np.ndarray):
            try:
                return array(x)
            except TypeError as e:
                raise StateCodecError(f"{where}: cannot store {e}") from None
        if type(x).__module__.startswith("jax") and hasattr(x, "__array__"):
            return array(np.asarray(x))
        raise StateCodecError(
            f"{where}: cannot store a {type(x).__module__}.{type(x).__qualname__} (not plain "
            "data nor a listed record type; add it to state_codec.RECORD_TYPES)"
        )

    return enc(obj, "state"), arrays


def decode(tree: Any, arrays: dict[str, np.ndarray]) -> Any:
    """The inverse of :func:`encode`."""

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        if len(x) == 1:
            ((tag, v),) = x.items()
            if tag == "__tuple__":
                return tuple(dec(i) for i in v)
            if tag == "__dict__":
                return {dec(k): dec(i) for k, i in v}
            if tag == "__set__":
                return {dec(i) for i in v}
            if tag == "__float__":
                return float(v)
            if tag == "__bytes__":
                return base64.b64decode(v)
            if tag == "__ndarray__":
                dtype, shape, data = v
                return np.frombuffer(base64.b64decode(data), _dtype(dtype)).reshape(shape).copy()
            if tag == "__scalar__":
                dtype, data = v
                return np.frombuffer(base64.b64decode(data), _dtype(dtype))[0]
            if tag == "__array__":
                if v not in arrays:
                    raise StateCodecError(f"the state refers to array {v!r}, which is missing")
                return np.asarray(arrays[v])
        if "__record__" in x:
            cls = _record_type(x["__record__"])
            return cls(**{k: dec(v) for k, v in x["fields"].items()})
        return {k: dec(v) for k, v in x.items()}

    return dec(tree)


def dumps(obj: Any) -> tuple[bytes, dict[str, np.ndarray]]:
    """``(UTF-8 JSON, large arrays)``."""
    tree, arrays = encode(obj)
    return json.dumps(tree, allow_nan=False, separators=(",", ":")).encode(), arrays


def loads(text: bytes, arrays: dict[str, np.ndarray]) -> Any:
    try:
        tree = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateCodecError(f"the stored state is not valid JSON: {e}") from None
    return decode(tree, arrays)
