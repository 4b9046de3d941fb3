"""A worker process spoken to in JSON lines over its pipes: the reward workers
(``dora_jax.data.reward_worker``) and the environment workers (``dora_jax.envs.worker``).

The parent side is :class:`WorkerProcess` (start ``python -m MODULE ARGS...`` with the package on
its path, send a message, read the complete lines, kill); the child side is :func:`answers`,
which keeps the child's stdout for its answers and sends whatever user code prints to stderr.
Plain JSON both ways: nothing received is unpickled or run. Standard library only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


class WorkerProcess:
    def __init__(self, module: str, *args: str):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", module, *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.ready = False  # it said it has loaded what it runs

    def send(self, msg: dict) -> None:
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()

    def read(self) -> list[dict] | None:
        """The complete lines now readable; None at end of file (the process died)."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            return None
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def answers() -> Callable[[dict], None]:
    """In the worker: a function that sends one JSON line to the parent on a private copy of
    stdout; from now on anything printed goes to stderr and cannot corrupt the answers."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(msg: dict) -> None:
        out.write(json.dumps(msg, allow_nan=False) + "\n")
        out.flush()

    return send
