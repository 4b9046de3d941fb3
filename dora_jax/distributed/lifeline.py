"""One TCP connection from every process to process 0, held open for the whole run.

The kernel closes a process's sockets when it ends, however it ends (SIGKILL, a crash, the OOM
killer), so the far end of its lifeline reads end-of-file at once: process 0 learns of a lost
rollout host in milliseconds instead of after the runtime's heartbeat timeout, and the other
processes learn of process 0's end the same way. A host that vanishes without closing anything
(a machine powered off, a cut cable) is still found by the heartbeat, which stays the fallback.

Nothing travels on a lifeline but its first line, ``"<process index> <join token>\\n"`` (the
token names the process's incarnation). Process 0 keeps the newest connection of each process,
so a process started again replaces its old one and the old one's closing says nothing; nor does
the closing of a lifeline whose token is no longer its process's (``current_token``): a second
copy of the process's command took its place while the first still ran.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

FIRST_LINE_MAX = 64  # bytes: an index and a token


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _wait_closed(conn: socket.socket, then: Callable[[], None]) -> None:
    """Block until the peer closes ``conn`` (or it breaks), then call ``then``."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    then()


class Lifelines:
    """Process 0's end: accepts a lifeline from every other process; ``on_closed(index)`` when
    the newest one of a process closes, unless it announced a token and ``current_token(index)``
    names another (None: not known)."""

    def __init__(
        self,
        host: str,
        on_closed: Callable[[int], None],
        count: int,
        current_token: Callable[[int], str | None] = lambda index: None,
    ):
        name = host.strip("[]")
        family = socket.AF_INET6 if ":" in name else socket.AF_INET
        self._server = socket.create_server((name, 0), family=family, backlog=max(count, 8))
        self._count = count
        self._on_closed = on_closed
        self._current_token = current_token
        self._newest: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, name="dora-lifelines", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        line = b""
        try:
            while not line.endswith(b"\n") and len(line) < FIRST_LINE_MAX:
                part = conn.recv(FIRST_LINE_MAX)
                if not part:
                    break
                line += part
            first, _, token = line.decode("ascii").strip().partition(" ")
            index = int(first)
        except (OSError, ValueError):
            conn.close()
            return
        if not 0 < index < self._count:
            conn.close()
            return
        with self._lock:
            self._newest[index] = conn

        def closed() -> None:
            with self._lock:
                newest = self._newest.get(index) is conn
            if newest and token:
                current = self._current_token(index)
                newest = current is None or current == token
            if newest:
                self._on_closed(index)

        _wait_closed(conn, closed)

    def close(self) -> None:
        self._server.close()


def hold(
    address: str,
    index: int,
    on_closed: Callable[[], None],
    timeout_s: float = 60,
    token: str = "",
) -> None:
    """Another process's end: connect to process 0's lifelines at ``address`` (``host:port``),
    say who we are (``index``, and ``token``: this incarnation's), and call ``on_closed()`` when
    process 0 closes it (ends)."""
    conn = socket.create_connection(_split(address), timeout=timeout_s)
    conn.settimeout(None)
    conn.sendall(f"{index} {token}".strip().encode() + b"\n")
    threading.Thread(
        target=_wait_closed, args=(conn, on_closed), name="dora-lifeline", daemon=True
    ).start()
