"""A pool of reward worker processes with a per-call timeout.

:meth:`RewardPool.submit` returns at once with a :class:`~concurrent.futures.Future`; a
dispatcher thread hands calls to idle workers (``python -m dora_jax.data.reward_worker``, JSON
lines over pipes), collects the answers and stops any call that runs past ``timeout_s``: the
worker is killed and a fresh one started, so a verifier that hangs costs that one call, never
the run. Every future resolves to an :class:`Outcome`; ``error`` names what went wrong:
``timeout``, ``exception`` (the function raised), ``invalid`` (it returned junk) or ``crash``
(the worker process died). ``spans`` records when each call ran, on the ``now`` clock (the
run's); deadlines use ``time.monotonic``.
"""

from __future__ import annotations

import json
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from dora_jax.worker_process import WorkerProcess

ERROR_KINDS = ("timeout", "exception", "invalid", "crash")
_MAX_FAILED_STARTS = 3


@dataclass(frozen=True)
class Outcome:
    """One scored response: ``score`` (0 on an error), extra ``metrics``, and ``error`` (one of
    :data:`ERROR_KINDS`, or None)."""

    score: float
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    message: str = ""


class RewardPoolError(RuntimeError):
    """The workers cannot start (the reward function fails to load in them)."""


class _Worker(WorkerProcess):
    def __init__(self, spec: str):
        super().__init__("dora_jax.data.reward_worker", spec)
        self.job: tuple[int, float, float] | None = None  # (call id, sent: monotonic, now())


class RewardPool:
    def __init__(
        self,
        spec: str,
        workers: int,
        timeout_s: float,
        now: Callable[[], float] = time.monotonic,
    ):
        self.spec, self.timeout_s, self.now = spec, timeout_s, now
        self.spans: deque[tuple[str, float, float]] = deque(maxlen=100_000)  # (kind, t0, t1)
        self._lock = threading.Lock()
        self._queue: deque[tuple[int, dict, Future]] = deque()
        self._futures: dict[int, Future] = {}
        self._next = 0
        self._closed = False
        self._fatal: str | None = None
        self._failed_starts = 0
        self._wake_r, self._wake_w = os.pipe()
        self._workers = [_Worker(spec) for _ in range(workers)]
        self._thread = threading.Thread(target=self._loop, name="reward-pool", daemon=True)
        self._thread.start()

    def submit(self, response: str, answer: str, metadata: dict | None = None) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RewardPoolError("the reward pool is closed")
            cid = self._next
            self._next += 1
            job = {"id": cid, "response": response, "answer": answer, "metadata": metadata or {}}
            self._queue.append((cid, job, fut))
        os.write(self._wake_w, b"x")
        return fut

    def close(self) -> None:
        """Stop the workers; calls not yet answered end ``crash``. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=30)
        for w in self._workers:
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
            timeout = self._next_deadline()
            fds = [self._wake_r] + [w.fd for w in self._workers]
            readable, _, _ = select.select(fds, [], [], timeout)
            if self._wake_r in readable:
                os.read(self._wake_r, 1 << 12)
            for w in list(self._workers):
                if w.fd in readable:
                    self._receive(w)
            self._expire()
        with self._lock:
            left = list(self._queue)
            self._queue.clear()
        for _, _, fut in left:
            fut.set_result(Outcome(0.0, error="crash", message="the reward pool closed"))
        for w in self._workers:
            if w.job is not None:
                self._resolve(w, Outcome(0.0, error="crash", message="the reward pool closed"))

    def _assign(self) -> None:
        for w in self._workers:
            if not (w.ready and w.job is None):
                continue
            with self._lock:
                if not self._queue:
                    return
                cid, job, fut = self._queue.popleft()
            self._futures[cid] = fut
            w.job = (cid, time.monotonic(), self.now())
            try:
                w.send(job)
            except (BrokenPipeError, OSError):
                pass  # the process died: its end of file is read next and the call ends "crash"
        if self._fatal is not None:  # no worker can run the function: every call fails
            with self._lock:
                left = list(self._queue)
                self._queue.clear()
            for _, _, fut in left:
                fut.set_result(Outcome(0.0, error="crash", message=self._fatal))

    def _next_deadline(self) -> float | None:
        busy = [w.job[1] for w in self._workers if w.job is not None]
        if not busy:
            return None
        return max(0.0, min(busy) + self.timeout_s - time.monotonic()) + 1e-3

    def _receive(self, w: _Worker) -> None:
        try:
            msgs = w.read()
        except (OSError, json.JSONDecodeError):
            msgs = None
        if msgs is None:
            fatal = None if w.ready else "a reward worker exited while starting"
            self._replace(w, Outcome(0.0, error="crash", message="the worker process died"), fatal)
            return
        for msg in msgs:
            if "fatal" in msg:
                self._replace(w, None, msg["fatal"])
                return
            if msg.get("ready"):
                w.ready = True
                self._failed_starts = 0
            elif w.job is not None and msg.get("id") == w.job[0]:
                if "error" in msg:
                    out = Outcome(0.0, error=msg["error"], message=msg.get("message", ""))
                else:
                    out = Outcome(float(msg["score"]), dict(msg.get("metrics", {})))
                self._resolve(w, out)

    def _expire(self) -> None:
        t = time.monotonic()
        for w in list(self._workers):
            if w.job is not None and t - w.job[1] > self.timeout_s:
                msg = f"no answer within data.reward_timeout_s={self.timeout_s:g} s"
                self._replace(w, Outcome(0.0, error="timeout", message=msg), None)

    def _resolve(self, w: _Worker, out: Outcome) -> None:
        cid, _, t0 = w.job
        w.job = None
        self.spans.append((out.error or "ok", t0, self.now()))
        self._futures.pop(cid).set_result(out)

    def _replace(self, w: _Worker, out: Outcome | None, fatal: str | None) -> None:
        """Kill worker ``w`` (its call, if any, ends with ``out``) and start a fresh one, unless
        workers keep failing to start (then every call ends ``crash``, saying why)."""
        if w.job is not None:
            self._resolve(w, out or Outcome(0.0, error="crash", message=fatal or ""))
        w.kill()
        i = self._workers.index(w)
        if fatal is not None:
            self._failed_starts += 1
            if self._failed_starts >= _MAX_FAILED_STARTS:
                self._fatal = f"reward workers cannot start: {fatal}"
        if self._fatal is not None:
            del self._workers[i]
        else:
            self._workers[i] = _Worker(self.spec)
