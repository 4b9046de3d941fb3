"""Ordered messages between processes over the runtime's key-value store.

A message is a msgpack map (``codec.py``) stored under ``dora/m/<to>/<from>/<seq>``; the sender
numbers its messages to each destination, and the receiver reads them in that order with bounded
blocking gets (one thread per sender), deletes each once read, and hands it to a handler. No
socket protocol of our own: the store, its blocking reads and its liveness are JAX's.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from dora_jax.distributed.codec import decode, encode

POLL_MS = 1000  # how long one blocking read waits before the receiver checks whether to stop


class Channel:
    def __init__(self, client: Any, me: int, prefix: str = "dora/m"):
        self.client, self.me, self.prefix = client, me, prefix
        self._seq: dict[int, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def send(self, to: int, msg: dict) -> None:
        data = encode(msg)
        with self._lock:  # numbers are given in send order, per destination
            seq = self._seq[to]
            self._seq[to] += 1
            self.client.key_value_set_bytes(f"{self.prefix}/{to}/{self.me}/{seq}", data)

    def listen(self, sender: int, handler: Callable[[dict], None], on_error=None) -> None:
        """Hand every message from ``sender`` to ``handler``, in order, on a thread of its own.
        A handler that raises is reported to ``on_error`` (default: printed) and listening goes
        on."""

        def run() -> None:
            seq = 0
            while not self._stop.is_set():
                key = f"{self.prefix}/{self.me}/{sender}/{seq}"
                try:
                    data = self.client.blocking_key_value_get_bytes(key, POLL_MS)
                except Exception as e:  # noqa: BLE001 - a timeout, or the coordinator is gone
                    if "DEADLINE" not in str(e).upper():
                        time.sleep(0.2)  # the watchdog reports a dead coordinator
                    continue
                self.client.key_value_delete(key)
                seq += 1
                try:
                    handler(decode(data))
                except Exception as e:  # noqa: BLE001 - one bad message must not stop the rest
                    on_error(e) if on_error else traceback.print_exc()

        t = threading.Thread(target=run, name=f"dora-recv-{sender}", daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
