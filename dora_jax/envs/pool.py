"""Environment episodes run in worker processes, off the caller's loop, with a per-call timeout.

:meth:`EnvPool.reset` starts an episode on the worker holding the fewest and returns its id and a
:class:`~concurrent.futures.Future`; :meth:`EnvPool.step` sends the next action to the same
worker (an episode's instance lives there). Each worker runs one call at a time; a dispatcher
thread moves JSON lines over pipes (``python -m dora_jax.envs.worker``) and stops a call that runs
past ``timeout_s``: the worker is killed and a fresh one started. Every future resolves to an
:class:`~dora_jax.envs.protocol.EnvOutcome` whose ``error`` is ``timeout``, ``exception`` (the
environment raised), ``invalid`` (it returned junk), ``crash`` (the worker died, or the pool
closed) or None. A failed call ends its episode (further steps are refused); the pool and the
other episodes go on.

Episodes that shared a killed worker are not lost: their next call carries their seed, task and
actions, and the fresh worker replays them first (the call's timeout grows by one ``timeout_s``
per replayed call); a replay that gives other results than before ends the episode ``crash``.
:meth:`EnvPool.episode_state` gives that same seed, task, actions and digest as plain data, and
:meth:`EnvPool.adopt` makes a new episode of it, held by no worker yet, so its next call rebuilds
it: one reset forked into the members of a prompt group, or episodes restored from a checkpoint.
``spans`` records each call as ``(op, kind, t0, t1)`` on the ``now`` clock; deadlines use
``time.monotonic``.
"""

from __future__ import annotations

import json
import os
import select
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dora_jax.envs.protocol import EnvOutcome, Step
from dora_jax.worker_process import WorkerProcess

_MAX_FAILED_STARTS = 3


class EnvPoolError(RuntimeError):
    """The workers cannot start, or a call was made on an episode that has ended."""


@dataclass
class _Episode:
    worker: int
    seed: int
    task: dict[str, Any]
    actions: list[str] = field(default_factory=list)
    digest: str = ""
    busy: bool = False
    ended: str | None = None  # why the episode can take no more calls


@dataclass
class _Job:
    cid: int
    op: str
    episode: int
    msg: dict[str, Any]
    fut: Future
    sent: float = 0.0  # time.monotonic()
    t0: float = 0.0  # now()
    limit: float = 0.0


class _Worker(WorkerProcess):
    def __init__(self, spec: str, kwargs_json: str):
        super().__init__("dora_jax.envs.worker", spec, kwargs_json)
        self.dead = False  # killed and not replaced (the workers cannot start)
        self.job: _Job | None = None
        self.queue: deque[_Job] = deque()
        self.holds: set[int] = set()  # episodes whose instance lives in this process


class EnvPool:
    def __init__(
        self,
        spec: str,
        kwargs: dict[str, Any] | None,
        workers: int,
        timeout_s: float,
        now: Callable[[], float] = time.monotonic,
        start_timeout_s: float = 120.0,
    ):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.spec, self.timeout_s, self.now = spec, timeout_s, now
        self._kwargs_json = json.dumps(kwargs or {})
        self.spans: deque[tuple[str, str, float, float]] = deque(maxlen=100_000)
        self.errors: Counter[str] = Counter()
        self.stop_strings: tuple[str, ...] = ()
        self._lock = threading.RLock()
        self._episodes: dict[int, _Episode] = {}
        self._next_call = self._next_episode = 0
        self._closed = False
        self._fatal: str | None = None
        self._failed_starts = 0
        self._started = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._workers = [_Worker(spec, self._kwargs_json) for _ in range(workers)]
        self._thread = threading.Thread(target=self._loop, name="env-pool", daemon=True)
        self._thread.start()
        if not self._started.wait(start_timeout_s):
            self.close()
            raise EnvPoolError(f"env: no worker started within {start_timeout_s:g} s")
        if self._fatal is not None:
            self.close()
            raise EnvPoolError(self._fatal)

    # -- the caller's side -----------------------------------------------------------------------

    def reset(self, seed: int, task: dict[str, Any]) -> tuple[int, Future]:
        """Start an episode: its id, and a future of the first observation."""
        with self._lock:
            w = self._least_loaded()
            eid = self._next_episode
            self._next_episode += 1
            self._episodes[eid] = _Episode(w, int(seed), dict(task), busy=True)
            msg = {"op": "reset", "episode": eid, "seed": int(seed), "task": dict(task)}
            return eid, self._submit(w, "reset", eid, msg)

    def step(self, episode: int, action: str) -> Future:
        """Send ``action`` to the episode; a future of its result."""
        with self._lock:
            ep = self._live(episode)
            if ep.busy:
                raise EnvPoolError(f"episode {episode} already has a call running")
            ep.busy = True
            msg = {"op": "step", "episode": episode, "action": str(action)}
            return self._submit(ep.worker, "step", episode, msg)

    def finish(self, episode: int) -> None:
        """Drop a finished episode (its instance is freed in its worker)."""
        with self._lock:
            ep = self._episodes.pop(episode, None)
            if ep is not None:
                w = self._workers[ep.worker]
                w.queue.append(_Job(-1, "close", episode, {"op": "close", "episode": episode},
                                    Future()))  # fmt: skip
        os.write(self._wake_w, b"x")

    def episode_state(self, episode: int) -> dict[str, Any]:
        """What rebuilds the episode elsewhere, as plain JSON data: ``seed``, ``task``,
        ``actions`` (the steps answered so far) and ``digest`` (of their results). Refused while
        a call runs on it (its state is not settled) and after it ended."""
        with self._lock:
            ep = self._live(episode)
            if ep.busy:
                raise EnvPoolError(f"episode {episode} has a call running: its state is not "
                                   "settled")  # fmt: skip
            state = {"seed": ep.seed, "task": ep.task, "actions": ep.actions, "digest": ep.digest}
            return json.loads(json.dumps(state))

    def adopt(self, state: dict[str, Any]) -> int:
        """A new episode from :meth:`episode_state`'s ``state`` (of this pool or another): no
        worker holds it yet, so its next :meth:`step` first replays ``seed``, ``task`` and
        ``actions`` on the worker holding the fewest episodes (checking ``digest``). Adopting
        one state several times forks the episode; a pool restored from a checkpoint adopts
        the saved episodes."""
        try:
            seed, task, digest = int(state["seed"]), dict(state["task"]), str(state["digest"])
            actions = [str(a) for a in state["actions"]]
        except (KeyError, TypeError, ValueError) as e:
            raise EnvPoolError(f"not an episode state ({type(e).__name__}: {e}): "
                               f"{state!r:.120}") from None  # fmt: skip
        with self._lock:
            eid = self._next_episode
            self._next_episode += 1
            self._episodes[eid] = _Episode(self._least_loaded(), seed, task, actions, digest)
            return eid

    def live_episodes(self) -> int:
        with self._lock:
            return sum(1 for e in self._episodes.values() if e.ended is None)

    def close(self) -> None:
        """Stop the workers; calls not yet answered end ``crash``. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=30)
        for w in self._workers:
            if not w.dead:
                w.kill()
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _live(self, episode: int) -> _Episode:
        ep = self._episodes.get(episode)
        if ep is None or ep.ended is not None:
            why = "is unknown" if ep is None else f"has ended ({ep.ended})"
            raise EnvPoolError(f"episode {episode} {why}")
        return ep

    def _least_loaded(self) -> int:
        load = Counter(e.worker for e in self._episodes.values() if e.ended is None)
        return min(range(len(self._workers)), key=lambda i: (load[i], i))

    def _submit(self, w: int, op: str, eid: int, msg: dict) -> Future:
        fut: Future = Future()
        if self._closed or self._fatal is not None:
            self._episodes[eid].ended = "crash"
            why = self._fatal or "the environment pool is closed"
            fut.set_result(EnvOutcome(None, "crash", why))
            self.errors["crash"] += 1
            return fut
        self._next_call += 1
        self._workers[w].queue.append(_Job(self._next_call, op, eid, msg, fut))
        os.write(self._wake_w, b"x")
        return fut

    # -- the dispatcher thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    break
                self._assign()
                timeout = self._next_deadline()
                fds = [self._wake_r] + [w.fd for w in self._workers if not w.dead]
            readable, _, _ = select.select(fds, [], [], timeout)
            with self._lock:
                if self._wake_r in readable:
                    os.read(self._wake_r, 1 << 12)
                for w in list(self._workers):
                    if not w.dead and w.fd in readable:
                        self._receive(w)
                self._expire()
        with self._lock:
            for w in self._workers:
                for job in [w.job, *w.queue]:
                    if job is not None and job.cid >= 0:
                        self._resolve(job, EnvOutcome(None, "crash", "the environment pool closed"))
                w.job, w.queue = None, deque()
        self._started.set()

    def _assign(self) -> None:
        for w in self._workers:
            while w.ready and w.job is None and w.queue:
                job = w.queue.popleft()
                ep = self._episodes.get(job.episode)
                if job.op == "close":
                    if job.episode in w.holds:
                        w.holds.discard(job.episode)
                        self._send(w, job.msg)
                    continue
                if ep is None:  # finished while its call waited: nothing to run or count
                    why = f"episode {job.episode} was finished before its call ran"
                    job.fut.set_result(EnvOutcome(None, "crash", why))
                    continue
                job.limit = self.timeout_s
                if job.op == "step" and job.episode not in w.holds:
                    job.msg["rebuild"] = {"seed": ep.seed, "task": ep.task,
                                          "actions": ep.actions, "digest": ep.digest}  # fmt: skip
                    job.limit = self.timeout_s * (2 + len(ep.actions))
                job.sent, job.t0 = time.monotonic(), self.now()
                w.job = job
                self._send(w, {"id": job.cid, **job.msg})

    def _send(self, w: _Worker, msg: dict) -> None:
        try:
            w.send(msg)
        except (BrokenPipeError, OSError):
            pass  # the process died: its end of file is read next and the call ends "crash"

    def _next_deadline(self) -> float | None:
        busy = [w.job.sent + w.job.limit for w in self._workers if w.job is not None]
        if not busy:
            return None
        return max(0.0, min(busy) - time.monotonic()) + 1e-3

    def _receive(self, w: _Worker) -> None:
        try:
            msgs = w.read()
        except (OSError, json.JSONDecodeError):
            msgs = None
        if msgs is None:
            fatal = None if w.ready else "an environment worker exited while starting"
            self._replace(w, EnvOutcome(None, "crash", "the worker process died"), fatal)
            return
        for msg in msgs:
            if "fatal" in msg:
                self._replace(w, None, msg["fatal"])
                return
            if msg.get("ready"):
                w.ready = True
                self._failed_starts = 0
                self.stop_strings = tuple(msg.get("stop", ()))
                self._started.set()
            elif w.job is not None and msg.get("id") == w.job.cid:
                job, w.job = w.job, None
                if "error" in msg:
                    w.holds.discard(job.episode)
                    self._resolve(job, EnvOutcome(None, msg["error"], msg.get("message", "")))
                    continue
                w.holds.add(job.episode)
                ep = self._episodes.get(job.episode)
                if ep is not None:
                    ep.digest = msg["digest"]
                    if job.op == "step":
                        ep.actions.append(job.msg["action"])
                r = msg["result"]
                step = Step(r["observation"], float(r["reward"]), bool(r["terminated"]),
                            bool(r["truncated"]), dict(r["info"]))  # fmt: skip
                self._resolve(job, EnvOutcome(step))

    def _expire(self) -> None:
        t = time.monotonic()
        for w in list(self._workers):
            if w.job is not None and t - w.job.sent > w.job.limit:
                msg = f"no answer within the environment timeout of {w.job.limit:g} s"
                self._replace(w, EnvOutcome(None, "timeout", msg), None)

    def _resolve(self, job: _Job, out: EnvOutcome) -> None:
        seconds = time.monotonic() - job.sent if job.sent else 0.0
        out = EnvOutcome(out.step, out.error, out.message, seconds)
        self.spans.append((job.op, out.error or "ok", job.t0 or self.now(), self.now()))
        ep = self._episodes.get(job.episode)
        if ep is not None:
            ep.busy = False
            if out.error is not None:
                ep.ended = out.error
        if out.error is not None:
            self.errors[out.error] += 1
        job.fut.set_result(out)

    def _replace(self, w: _Worker, out: EnvOutcome | None, fatal: str | None) -> None:
        """Kill worker ``w`` (its call, if any, ends with ``out``) and start a fresh one that takes
        over its queue, unless workers keep failing to start (then every call ends ``crash``)."""
        if w.job is not None:
            job, w.job = w.job, None
            self._resolve(job, out or EnvOutcome(None, "crash", fatal or ""))
        w.kill()
        if fatal is not None:
            self._failed_starts += 1
            if self._failed_starts >= _MAX_FAILED_STARTS:
                self._fatal = f"environment workers cannot start: {fatal}"
                self._started.set()
        i = self._workers.index(w)
        if self._fatal is not None:
            for job in w.queue:
                if job.cid >= 0:
                    self._resolve(job, EnvOutcome(None, "crash", self._fatal))
            w.queue.clear()
            w.ready, w.dead = False, True
            return
        fresh = _Worker(self.spec, self._kwargs_json)
        fresh.queue = w.queue
        self._workers[i] = fresh
