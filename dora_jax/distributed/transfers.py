"""Arrays between processes: point-to-point pulls through each process's transfer server.

The holder of the arrays calls :meth:`Transfers.serve` (the arrays wait on its server under a
fresh id, and a small record, with the holder's process and the arrays' shapes plus any plain
``meta`` data, goes to the key-value store); the receiver calls :meth:`Transfers.fetch` with the
shardings it wants them in, and blocks (bounded) until the record is there, then pulls. Neither
side waits for the other to reach a common point: a receiver may ask before the holder serves.

A pull copies shard to shard: the receiver's shardings must cut the arrays the same way as the
holder's (the same mesh shape and PartitionSpecs on both sides; weights for a rollout group are
first placed in that layout on the holder's devices).

On CPU hosts the arrays travel instead as host copies through the key-value store, in pieces of
at most ``CHUNK`` bytes: the CPU transfer server serves a pull only when the holder's devices are
between computations, so a pull of a new version would wait for the whole next train step (seen
here: 5.7 s for a 1.2 MB array while another device of the holder ran a 3 s computation). A host
copy of a finished array does not wait, and the receiver places it into its own shardings.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from dora_jax.distributed.codec import decode, dtype_from_tag, dtype_tag, encode
from dora_jax.distributed.process import Process
from dora_jax.execution.commands import TransferError

WAIT_S = 600.0
CHUNK = 4 << 20  # bytes per key-value entry on the host-copy path
# one host copy at a time: jax.device_get of the same arrays from two threads at once can fail
# inside jax (seen with jax 0.10: IndexError in copy_to_host_async, four groups served one
# version's params from four threads)
_HOST_COPY_LOCK = threading.Lock()


class Transfers:
    def __init__(self, proc: Process, via_store: bool | None = None):
        import jax

        self.proc = proc
        self.via_store = (
            jax.local_devices()[0].platform == "cpu" if via_store is None else via_store
        )
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        # how many times this process has joined the run before (process 0 says, 0 to 255): a
        # rollout host started again numbers its transfers apart from its earlier incarnations'
        self.epoch = 0

    def new_id(self) -> int:
        with self._lock:
            return (self.proc.index << 40) | ((self.epoch & 0xFF) << 32) | next(self._ids)

    def host_copy(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """NumPy copies of ``arrays`` (one host copy at a time in this process)."""
        import jax

        with _HOST_COPY_LOCK:
            return [np.asarray(h) for h in jax.device_get(list(arrays))]

    def serve(self, uid: int, arrays: Sequence[Any], meta: dict | None = None) -> None:
        """Offer ``arrays`` under ``uid``. If that fails, the receiver gets the error (its
        :meth:`fetch` raises :class:`TransferError` at once instead of waiting out its bound),
        and it is raised here too."""
        try:
            self._serve(uid, arrays, meta)
        except Exception as e:
            err = {"error": f"process {self.proc.index} could not serve transfer {uid}: {e!r}"}
            self.proc.client.key_value_set_bytes(f"dora/x/{uid}", encode(err))
            raise

    def fail_unless_served(self, uid: int, why: str) -> bool:  # (``why`` names HOST_GONE)
        """The holder of ``uid`` died: unless it served it already, the receiver gets ``why`` as
        an error (its :meth:`fetch` raises :class:`TransferError`). True: it never served it."""
        try:
            self.proc.client.key_value_set_bytes(f"dora/x/{uid}", encode({"error": why}))
        except Exception:  # noqa: BLE001 - the record is there: it was served
            return False
        return True

    def forget(self, uid: int) -> None:
        """Delete ``uid``'s record (one fetched with ``keep``)."""
        try:
            self.proc.client.key_value_delete(f"dora/x/{uid}")
        except Exception:  # noqa: BLE001 - gone already
            pass

    def _serve(self, uid: int, arrays: Sequence[Any], meta: dict | None) -> None:
        arrays = list(arrays)
        record = {
            "from": self.proc.index,
            "shapes": [[list(a.shape), dtype_tag(np.dtype(a.dtype))] for a in arrays],
            "meta": meta or {},
            "chunks": 0,
        }
        if self.via_store and arrays:
            data = encode(self.host_copy(arrays))
            pieces = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
            for i, piece in enumerate(pieces):
                self.proc.client.key_value_set_bytes(f"dora/xc/{uid}/{i}", piece)
            record["chunks"] = len(pieces)
        elif arrays:
            self.proc.server.await_pull(uid, arrays)
        self.proc.client.key_value_set_bytes(f"dora/x/{uid}", encode(record))

    def fetch(
        self, uid: int, shardings: Any, timeout_s: float = WAIT_S, keep: bool = False
    ) -> tuple[list, dict]:
        """``(arrays, meta)`` of ``uid``; ``shardings`` is a list (one per array) or a function
        of ``meta`` returning that list. ``keep``: the record stays (process 0 deletes it,
        :meth:`forget`), so that it can tell a transfer served from one that never was."""
        import jax

        key = f"dora/x/{uid}"
        record = decode(self.proc.client.blocking_key_value_get_bytes(key, int(timeout_s * 1e3)))
        if not keep:
            self.proc.client.key_value_delete(key)
        if "error" in record:
            raise TransferError(record["error"])
        meta = record["meta"]
        if callable(shardings):
            shardings = shardings(meta)
        if record["chunks"]:
            client, ms = self.proc.client, int(timeout_s * 1e3)
            keys = [f"dora/xc/{uid}/{i}" for i in range(record["chunks"])]
            data = b"".join(client.blocking_key_value_get_bytes(k, ms) for k in keys)
            for k in keys:
                client.key_value_delete(k)
            host = decode(data)
            return [jax.device_put(h, s) for h, s in zip(host, shardings, strict=True)], meta
        specs = [
            jax.ShapeDtypeStruct(tuple(shape), dtype_from_tag(dt), sharding=s)
            for (shape, dt), s in zip(record["shapes"], shardings, strict=True)
        ]
        arrays = []
        if specs:
            conn = self.proc.connection(self.proc.address(record["from"]))
            arrays = list(conn.pull(uid, specs))
        return arrays, meta
