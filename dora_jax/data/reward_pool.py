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

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from dora_jax.worker_process import WorkerPool, WorkerProcess

ERROR_KINDS = ("timeout", "exception", "invalid", "crash")


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


@dataclass
class _Call:
    cid: int
    job: dict
    fut: Future
    deadline: float = 0.0  # time.monotonic()
    t0: float = 0.0  # now()


class RewardPool(WorkerPool):
    kind = "reward"

    def __init__(
        self,
        spec: str,
        workers: int,
        timeout_s: float,
        now: Callable[[], float] = time.monotonic,
    ):
        self.spec = spec
        self.spans: deque[tuple[str, float, float]] = deque(maxlen=100_000)  # (kind, t0, t1)
        self._queue: deque[_Call] = deque()
        self._next = 0
        super().__init__(workers, timeout_s, now)

    def submit(self, response: str, answer: str, metadata: dict | None = None) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RewardPoolError("the reward pool is closed")
            cid, self._next = self._next, self._next + 1
            job = {"id": cid, "response": response, "answer": answer, "metadata": metadata or {}}
            self._queue.append(_Call(cid, job, fut))
        self._wake()
        return fut

    # -- the dispatcher thread's hooks -----------------------------------------------------------

    def _spawn(self, old: WorkerProcess | None) -> WorkerProcess:
        return WorkerProcess("dora_jax.data.reward_worker", self.spec)

    def _assign(self) -> None:
        for w in self._workers:
            if w.ready and w.job is None and self._queue:
                call = w.job = self._queue.popleft()
                call.deadline, call.t0 = time.monotonic() + self.timeout_s, self.now()
                self._send(w, call.job)
        if self._fatal is not None:  # no worker can run the function: every call fails
            while self._queue:
                self._finish(self._queue.popleft(), "crash", self._fatal)

    def _answer(self, w: WorkerProcess, msg: dict) -> None:
        call, w.job = w.job, None
        if "error" in msg:
            self._resolve(call, Outcome(0.0, error=msg["error"], message=msg.get("message", "")))
        else:
            self._resolve(call, Outcome(float(msg["score"]), dict(msg.get("metrics", {}))))

    def _finish(self, call: _Call, error: str, message: str) -> None:
        self._resolve(call, Outcome(0.0, error=error, message=message))

    def _timeout_message(self, call: _Call) -> str:
        return f"no answer within data.reward_timeout_s={self.timeout_s:g} s"

    def _drain(self) -> None:
        calls = [*self._queue, *(w.job for w in self._workers if w.job is not None)]
        self._queue.clear()
        for call in calls:
            self._finish(call, "crash", "the reward pool closed")

    def _resolve(self, call: _Call, out: Outcome) -> None:
        if call.deadline:  # it was sent to a worker
            self.spans.append((out.error or "ok", call.t0, self.now()))
        call.fut.set_result(out)
