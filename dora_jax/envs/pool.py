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

A call does not wait long behind another episode's call on a busy worker: once it has waited
``spill_after_s`` (a quarter of the timeout, at most 1 s) it moves to an idle worker, or to a
worker started for it while the pool holds fewer than ``max_workers``; its episode is rebuilt
there by replay, as below. A round of calls that all hang thus costs about one timeout, not one
per call queued on a worker.

Episodes that shared a killed worker are not lost: their next call carries their seed, task and
actions, and the fresh worker replays them first (the replay has one ``timeout_s`` per replayed
call; the call itself has its own ``timeout_s`` from the replay's end, so a call that hangs after
a replay costs one timeout, not one per action replayed); a replay that gives other results than
before ends the episode ``crash``.
:meth:`EnvPool.episode_state` gives that same seed, task, actions and digest as plain data, and
:meth:`EnvPool.adopt` makes a new episode of it, held by no worker yet, so its next call rebuilds
it: one reset forked into the members of a prompt group, or episodes restored from a checkpoint.
``spans`` records each call as ``(op, kind, t0, t1)`` on the ``now`` clock; deadlines use
``time.monotonic``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dora_jax.envs.protocol import EnvOutcome, Step
from dora_jax.worker_process import WorkerPool, WorkerProcess


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
    queued: float = field(default_factory=time.monotonic)
    sent: float = 0.0  # time.monotonic()
    t0: float = 0.0  # now()
    limit: float = 0.0

    @property
    def deadline(self) -> float:
        return self.sent + self.limit


def _close(episode: int) -> _Job:
    """Free the episode's instance in the worker whose queue this goes to (if it holds one)."""
    return _Job(-1, "close", episode, {"op": "close", "episode": episode}, Future())


class _Worker(WorkerProcess):
    def __init__(self, spec: str, kwargs_json: str):
        super().__init__("dora_jax.envs.worker", spec, kwargs_json)
        self.queue: deque[_Job] = deque()
        self.holds: set[int] = set()  # episodes whose instance lives in this process


class EnvPool(WorkerPool):
    kind = "environment"

    def __init__(
        self,
        spec: str,
        kwargs: dict[str, Any] | None,
        workers: int,
        timeout_s: float,
        now: Callable[[], float] = time.monotonic,
        start_timeout_s: float = 120.0,
        max_workers: int = 0,
    ):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.max_workers = max(workers, max_workers)  # 0: never more than ``workers``
        self.spill_after_s = min(1.0, timeout_s / 4)
        self.moved = 0  # calls moved off a busy worker
        self.spec = spec
        self._kwargs_json = json.dumps(kwargs or {})
        self.spans: deque[tuple[str, str, float, float]] = deque(maxlen=100_000)
        self.errors: Counter[str] = Counter()
        self.stop_strings: tuple[str, ...] = ()
        self._episodes: dict[int, _Episode] = {}
        self._next_call = self._next_episode = 0
        self._started = threading.Event()
        super().__init__(workers, timeout_s, now)
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
                w.queue.append(_close(episode))
        self._wake()

    def episode_state(self, episode: int) -> dict[str, Any]:
        """What rebuilds the episode elsewhere, as plain JSON data: ``seed``, ``task``,
        ``actions`` (the steps answered so far) and ``digest`` (of their results). Refused while
        a call runs on it (its state is not settled) and after it ended."""
        with self._lock:
            ep = self._live(episode)
            if ep.busy:
                raise EnvPoolError(
                    f"episode {episode} has a call running: its state is not settled"
                )
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
            raise EnvPoolError(
                f"not an episode state ({type(e).__name__}: {e}): {state!r:.120}"
            ) from None
        with self._lock:
            eid = self._next_episode
            self._next_episode += 1
            self._episodes[eid] = _Episode(self._least_loaded(), seed, task, actions, digest)
            return eid

    def live_episodes(self) -> int:
        with self._lock:
            return sum(1 for e in self._episodes.values() if e.ended is None)

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
        self._wake()
        return fut

    # -- the dispatcher thread's hooks -----------------------------------------------------------

    def _spawn(self, old: _Worker | None) -> _Worker:
        fresh = _Worker(self.spec, self._kwargs_json)
        if old is not None:  # the fresh worker takes over the killed one's queue
            fresh.queue = old.queue
        return fresh

    def _idle(self) -> list[_Worker]:
        return [v for v in self._workers if v.ready and v.job is None and not v.queue]

    def _can_grow(self) -> bool:
        return len(self._workers) < self.max_workers and self._fatal is None

    def _wake_times(self) -> list[float]:
        # only while a call could move: else a saturated pool's overdue calls would wake the
        # dispatcher at once, again and again (a worker's answer or start wakes it anyway)
        if not self._can_grow() and not self._idle():
            return []
        return [
            job.queued + self.spill_after_s
            for w in self._workers
            if w.job is not None
            for job in w.queue
            if job.cid >= 0
        ]

    def _spill(self) -> None:
        """Move calls that waited ``spill_after_s`` behind another call on a busy worker to an
        idle one, starting one while the pool is below ``max_workers`` (the call waits there
        for its start)."""
        t = time.monotonic()
        for w in list(self._workers):
            if w.job is None:
                continue
            for job in [j for j in w.queue if j.cid >= 0 and t - j.queued >= self.spill_after_s]:
                idle = self._idle()
                if idle:
                    target = idle[0]
                elif self._can_grow():
                    target = self._spawn(None)
                    self._workers.append(target)
                else:
                    return
                w.queue.remove(job)
                job.queued = t
                target.queue.append(job)
                self.moved += 1
                ep = self._episodes.get(job.episode)
                if ep is not None:
                    ep.worker = self._workers.index(target)
                if job.episode in w.holds:  # its instance there is left behind: freed, and
                    # a later call sent back to ``w`` replays the episode afresh
                    w.queue.append(_close(job.episode))

    def _assign(self) -> None:
        self._spill()
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
                    job.msg["rebuild"] = {
                        "seed": ep.seed,
                        "task": ep.task,
                        "actions": ep.actions,
                        "digest": ep.digest,
                    }
                    # the replay's limit (its reset and actions); the step's own timeout starts
                    # when the worker says the replay is done (_answer)
                    job.limit = self.timeout_s * (1 + len(ep.actions))
                job.sent, job.t0 = time.monotonic(), self.now()
                w.job = job
                self._send(w, {"id": job.cid, **job.msg})

    def _ready(self, w: _Worker, msg: dict) -> None:
        self.stop_strings = tuple(msg.get("stop", ()))
        self._started.set()

    def _answer(self, w: _Worker, msg: dict) -> None:
        if msg.get("rebuilt"):  # the replay is done: the step itself gets a full timeout_s
            w.job.limit = time.monotonic() - w.job.sent + self.timeout_s
            return
        job, w.job = w.job, None
        if "error" in msg:
            w.holds.discard(job.episode)
            self._resolve(job, EnvOutcome(None, msg["error"], msg.get("message", "")))
            return
        w.holds.add(job.episode)
        ep = self._episodes.get(job.episode)
        if ep is not None:
            ep.digest = msg["digest"]
            if job.op == "step":
                ep.actions.append(job.msg["action"])
        r = msg["result"]
        step = Step(
            r["observation"],
            float(r["reward"]),
            bool(r["terminated"]),
            bool(r["truncated"]),
            dict(r["info"]),
        )
        self._resolve(job, EnvOutcome(step))

    def _timeout_message(self, job: _Job) -> str:
        return f"no answer within the environment timeout of {job.limit:g} s"

    def _finish(self, job: _Job, error: str, message: str) -> None:
        self._resolve(job, EnvOutcome(None, error, message))

    def _gave_up(self, w: _Worker) -> None:
        for job in w.queue:
            if job.cid >= 0:
                self._finish(job, "crash", self._fatal)
        w.queue.clear()
        self._started.set()

    def _drain(self) -> None:
        for w in self._workers:
            for job in [w.job, *w.queue]:
                if job is not None and job.cid >= 0:
                    self._finish(job, "crash", "the environment pool closed")
            w.job, w.queue = None, deque()
        self._started.set()

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
