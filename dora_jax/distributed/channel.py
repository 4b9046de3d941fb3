"""Ordered messages between processes over the runtime's key-value store.

A message is a msgpack map (``codec.py``) stored under ``dora/m/<to>/<from>/<epoch>/<seq>``; the
sender numbers its messages to each destination, and the receiver reads them in that order with
bounded blocking gets (one thread per sender), deletes each once read, and hands it to a handler.
No socket protocol of our own: the store, its blocking reads and its liveness are JAX's.

The epoch is the join token of the process other than 0 at either end (``Process.token``, new
each time that process starts): a rollout host started again after it died talks to process 0
under a new epoch, numbered from 0, and nothing its earlier incarnation left unread is read.
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
    def __init__(self, client: Any, me: int, prefix: str = "dora/m", token: str = ""):
        self.client, self.me, self.prefix = client, me, prefix
        self._seq: dict[int, int] = defaultdict(int)
        self._epoch: dict[int, str] = defaultdict(lambda: token)  # peer -> epoch (both ways)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def send(self, to: int, msg: dict) -> None:
        data = encode(msg)
        with self._lock:  # numbers are given in send order, per destination
            seq = self._seq[to]
            self._seq[to] += 1
            key = f"{self.prefix}/{to}/{self.me}/{self._epoch[to]}/{seq}"
        self.client.key_value_set_bytes(key, data)

    def epoch_of(self, peer: int) -> str | None:
        return self._epoch.get(peer)

    def reconnect(self, peer: int, token: str) -> None:
        """Talk to ``peer`` under epoch ``token`` from now on (numbered from 0 both ways); the
        listener of its earlier epoch stops, and what either side left unread there is
        deleted."""
        with self._lock:
            old, self._epoch[peer], self._seq[peer] = self._epoch.get(peer), token, 0
        if old is not None and old != token:
            for key in (
                f"{self.prefix}/{peer}/{self.me}/{old}",
                f"{self.prefix}/{self.me}/{peer}/{old}",
            ):
                try:
                    self.client.key_value_delete(key)
                except Exception:  # noqa: BLE001 - nothing left there
                    pass

    def listen(self, sender: int, handler: Callable[[dict], None], on_error=None) -> None:
        """Hand every message from ``sender`` to ``handler``, in order, on a thread of its own.
        A handler that raises is reported to ``on_error`` (default: printed) and listening goes
        on."""

        epoch = self._epoch[sender]

        def run() -> None:
            seq = 0
            while not self._stop.is_set() and self._epoch[sender] == epoch:
                key = f"{self.prefix}/{self.me}/{sender}/{epoch}/{seq}"
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
