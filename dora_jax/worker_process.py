"""Worker processes spoken to in JSON lines over their pipes: the reward workers
(``dora_jax.data.reward_worker``) and the environment workers (``dora_jax.envs.worker``).

The parent side is :class:`WorkerProcess` (start ``python -m MODULE ARGS...`` with the package on
its path, send a message, read the complete lines, kill) and :class:`WorkerPool`, the dispatcher
thread both pools share; the child side is :func:`answers`, which keeps the child's stdout for
its answers and sends whatever user code prints to stderr. Plain JSON both ways: nothing
received is unpickled or run. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
MAX_FAILED_STARTS = 3  # workers failing to start in a row before a pool gives up


class WorkerProcess:
    def __init__(self, module: str, *args: str):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", module, *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.ready = False  # it said it has loaded what it runs
        self.dead = False  # killed and not replaced (the pool gave up on starting workers)
        self.job: Any = None  # the call it runs: has ``deadline`` (time.monotonic) and ``cid``

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
            with contextlib.suppress(OSError):
                f.close()


class WorkerPool:
    """A dispatcher thread over worker processes that run one call at a time each.

    It waits on the workers' pipes and a wake-up pipe, hands calls out (:meth:`_assign`), reads
    answers (:meth:`_answer`), and kills a worker whose call passes its deadline or whose
    process dies, starting a fresh one (:meth:`_spawn`); the killed call ends with
    :meth:`_finish`. After :data:`MAX_FAILED_STARTS` workers in a row fail to start, the pool
    gives up: ``_fatal`` says why, and no worker is started again. Subclasses set their own
    state, then call ``super().__init__``, which starts the thread; every hook runs under
    ``_lock``."""

    kind = "worker"  # names the pool in its messages

    def __init__(self, workers: int, timeout_s: float, now: Callable[[], float]):
        self.timeout_s, self.now = timeout_s, now
        self._lock = threading.RLock()
        self._closed = False
        self._fatal: str | None = None
        self._failed_starts = 0
        self._wake_r, self._wake_w = os.pipe()
        self._workers = [self._spawn(None) for _ in range(workers)]
        self._thread = threading.Thread(target=self._loop, name=f"{self.kind}-pool", daemon=True)
        self._thread.start()

    # -- hooks -----------------------------------------------------------------------------------

    def _spawn(self, old: WorkerProcess | None) -> WorkerProcess:
        """A fresh worker (in place of ``old``, just killed, when given)."""
        raise NotImplementedError

    def _assign(self) -> None:
        """Send queued calls to idle, ready workers (setting their ``job``)."""

    def _answer(self, w: WorkerProcess, msg: dict) -> None:
        """``msg`` answers ``w.job``; clear ``w.job`` and resolve the call."""

    def _finish(self, job: Any, error: str, message: str) -> None:
        """End a call that got no answer with ``error``."""

    def _ready(self, w: WorkerProcess, msg: dict) -> None:
        """Worker ``w`` said it is ready (``msg``)."""

    def _gave_up(self, w: WorkerProcess) -> None:
        """``_fatal`` is set and ``w`` is dead: end what waits for it."""

    def _drain(self) -> None:
        """The pool closed: end every call not answered."""

    def _timeout_message(self, job: Any) -> str:
        return f"no answer within {self.timeout_s:g} s"

    def _wake_times(self) -> list[float]:
        """Moments (``time.monotonic``) besides the calls' deadlines when :meth:`_assign` has
        something to do."""
        return []

    # -- the caller's side -----------------------------------------------------------------------

    def _wake(self) -> None:
        os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Stop the workers; calls not yet answered end ``crash``. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(timeout=30)
        for w in self._workers:
            if not w.dead:
                w.kill()
        if not self._thread.is_alive():  # else the thread still selects on the pipe
            os.close(self._wake_r)
            os.close(self._wake_w)

    # -- the dispatcher thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    break
                self._assign()
                ends = [w.job.deadline for w in self._workers if w.job is not None]
                ends += self._wake_times()
                timeout = max(0.0, min(ends) - time.monotonic()) + 1e-3 if ends else None
                fds = [self._wake_r] + [w.fd for w in self._workers if not w.dead]
            readable, _, _ = select.select(fds, [], [], timeout)
            with self._lock:
                if self._wake_r in readable:
                    os.read(self._wake_r, 1 << 12)
                for w in list(self._workers):
                    if not w.dead and w.fd in readable:
                        self._receive(w)
                t = time.monotonic()
                for w in list(self._workers):
                    if w.job is not None and t > w.job.deadline:
                        self._replace(w, "timeout", self._timeout_message(w.job), None)
        with self._lock:
            self._drain()

    def _receive(self, w: WorkerProcess) -> None:
        try:
            msgs = w.read()
        except (OSError, json.JSONDecodeError):
            msgs = None
        if msgs is None:
            fatal = None if w.ready else f"one of the {self.kind} workers exited while starting"
            self._replace(w, "crash", "the worker process died", fatal)
            return
        for msg in msgs:
            if "fatal" in msg:
                self._replace(w, "crash", msg["fatal"], msg["fatal"])
                return
            if msg.get("ready"):
                w.ready = True
                self._failed_starts = 0
                self._ready(w, msg)
            elif w.job is not None and msg.get("id") == w.job.cid:
                self._answer(w, msg)

    def _send(self, w: WorkerProcess, msg: dict) -> None:
        # a dead process's broken pipe: its end of file is read next and the call ends "crash"
        with contextlib.suppress(OSError):
            w.send(msg)

    def _replace(self, w: WorkerProcess, error: str, message: str, fatal: str | None) -> None:
        """Kill worker ``w`` (its call, if any, ends with ``error``) and start a fresh one,
        unless workers keep failing to start (``fatal``: why this one did)."""
        if w.job is not None:
            job, w.job = w.job, None
            self._finish(job, error, message)
        w.kill()
        if fatal is not None:
            self._failed_starts += 1
            if self._failed_starts >= MAX_FAILED_STARTS:
                self._fatal = f"{self.kind} workers cannot start: {fatal}"
        if self._fatal is None:
            self._workers[self._workers.index(w)] = self._spawn(w)
        else:
            w.ready, w.dead = False, True
            self._gave_up(w)


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
