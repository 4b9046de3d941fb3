"""Requests waiting on their environment: the turn boundaries of the simulated backend.

:class:`WaitingRequests` runs the conversations of :class:`~dora_jax.sim.backend.SimBackend`
(the backend's module docstring gives the model, a request's ``wake_us`` being when its
observation arrives, in microseconds of modeled time) on the backend's
:class:`~dora_jax.sim.requests.RequestTable`, and keeps the records of waiting requests that the
figures and the timeline read. With ``latency.workers`` the calls queue for a pool of
environment workers, each running one call at a time: a conversation keeps the worker it was
given when first submitted (the one holding the fewest live conversations), and a worker takes
its calls in the order their turns ended, so ``wake_us`` is when its worker is free (or the turn
ended, if later) plus the call's own seconds, which alone count as the conversation's
environment time.
"""

from __future__ import annotations

import numpy as np

from dora_jax.sim.conversations import US, Conversations
from dora_jax.sim.requests import RequestTable


class WaitingRequests:
    """Turn ends, wake-ups and the records of requests waiting on their environment, for the
    requests of ``requests`` (groups of ``max_slots`` slots, ticks of ``tick_s``) and the
    ``conversations`` workload (None: single-turn requests, which never wait). Its records are
    lists that only grow."""

    def __init__(
        self,
        requests: RequestTable,
        conversations: Conversations | None,
        max_slots: int,
        tick_s: float,
    ):
        self.requests, self.conversations = requests, conversations
        self.max_slots, self.tick_s = max_slots, tick_s
        # the pool of environment workers (``conversations.cfg.latency.workers``; none: every
        # call starts when its turn ends)
        lat = getattr(getattr(conversations, "cfg", None), "latency", None)
        n = int(getattr(lat, "workers", 0) or 0)
        self.workers = n
        self._free_at = np.zeros(n, np.int64)  # microseconds at which each worker is free
        self.live = np.zeros(n, np.int64)  # live conversations each worker holds
        self.worker_of: dict[int, int] = {}  # request id -> its worker
        # with workers: every call as (its worker, microseconds it started, it ended, it
        # waited for its worker), in the order the calls were made
        self.env_calls: list[tuple[int, int, int, int]] = []
        # per tick and group, requests waiting on their environment, the KV tokens they hold,
        # and seconds idle while they wait; per finished conversation, its (request id, model
        # turns, model tokens, observation tokens, environment microseconds)
        self.waiting_requests: list[np.ndarray] = []
        self.waiting_kv: list[np.ndarray] = []
        self.env_wait_s: list[np.ndarray] = []
        self._done: list[tuple[int, int, int, int, int]] = []

    def assign(self, request_ids: list[int]) -> None:
        """New conversations take the worker holding the fewest live ones (lowest on ties)."""
        for r in request_ids if self.workers else ():
            w = int(np.argmin(self.live))
            self.worker_of[r] = w
            self.live[w] += 1

    def release(self, request_ids: list[int]) -> None:
        """These conversations ended: their workers hold them no longer."""
        for r in request_ids if self.workers else ():
            w = self.worker_of.pop(r, None)
            if w is not None:
                self.live[w] -= 1

    def _queue(self, rids: np.ndarray, at_us: np.ndarray, lat_us: np.ndarray) -> np.ndarray:
        """When calls made at ``at_us`` taking ``lat_us`` answer, on their conversations'
        workers, each taking its calls in the order their turns ended (ties: request id)."""
        out = np.empty_like(at_us)
        for i in np.lexsort((rids, at_us)).tolist():
            w = self.worker_of[int(rids[i])]
            start = max(int(at_us[i]), int(self._free_at[w]))
            out[i] = start + int(lat_us[i])
            self._free_at[w] = out[i]
            self.env_calls.append((w, start, int(out[i]), start - int(at_us[i])))
        return out

    def conversation_log(self) -> dict[str, np.ndarray]:
        """Every finished conversation, sorted by request id: ``rid``, ``turns``,
        ``model_tokens``, ``observation_tokens``, ``env_us``."""
        rows = sorted(self._done)
        cols = np.array(rows, np.int64).reshape(-1, 5).T
        names = ("rid", "turns", "model_tokens", "observation_tokens", "env_us")
        return dict(zip(names, cols, strict=True))

    def waiting(self, w: int) -> np.ndarray:
        """``[groups, w]``: held requests waiting on their environment."""
        return (self.requests.wake_us[:, :w] > 0) & self.requests.held(w)

    def slots_held(self, w: int) -> np.ndarray:
        """Slots each group's requests hold: all of them but those waiting on an environment."""
        if self.conversations is None:
            return self.requests.count
        return self.requests.count - self.waiting(w).sum(axis=1)

    def wake_up(self, tick: int) -> np.ndarray:
        """Requests whose observation arrives by the middle of tick ``tick`` stop waiting: its
        tokens join their context, to prefill. Returns the rows that hold a slot this tick:
        held, not waiting, the oldest ``max_slots`` of each group."""
        q = self.requests
        w = q.width()
        waiting = self.waiting(w)
        now = int(round((tick + 0.5) * self.tick_s * US))
        gi, ri = np.nonzero(waiting & (q.wake_us[:, :w] <= now))
        if len(gi):
            obs = q.pending_observation[gi, ri]
            q.generated[gi, ri] += obs
            q.observation_tokens[gi, ri] += obs
            q.prefill_left[gi, ri] += obs
            q.pending_observation[gi, ri] = 0
            q.wake_us[gi, ri] = 0
            waiting[gi, ri] = False
        live = q.held(w) & ~waiting
        return live & (np.cumsum(live, axis=1) <= self.max_slots)

    def end_turns(self, gi: np.ndarray, ri: np.ndarray, at_us: np.ndarray) -> np.ndarray:
        """Rows ``(gi, ri)`` ended a model turn at ``at_us``: those with a turn to come wait on
        their environment from then on. Returns which of them ended their conversation."""
        q, conv = self.requests, self.conversations
        pg, members = q.prompt_group[gi, ri], q.request_id[gi, ri] % conv.group_size
        goes, obs, lat, target = conv.after_turn(pg, members, q.turn[gi, ri], q.generated[gi, ri])
        g, r = gi[goes], ri[goes]
        q.turn[g, r] += 1
        q.pending_observation[g, r] = obs[goes]
        if self.workers:
            q.wake_us[g, r] = self._queue(q.request_id[g, r], at_us[goes], lat[goes])
        else:
            q.wake_us[g, r] = at_us[goes] + lat[goes]
        q.env_us[g, r] += lat[goes]
        q.target[g, r] = target[goes]
        return ~goes

    def finish(self, gi: np.ndarray, ri: np.ndarray) -> None:
        """Rows ``(gi, ri)`` ended their conversations: log them and release their workers."""
        q = self.requests
        model = q.generated[gi, ri] - q.observation_tokens[gi, ri]
        cols = (q.request_id, q.turn, None, q.observation_tokens, q.env_us)
        rows = [model if c is None else c[gi, ri] for c in cols]
        rows[1] = rows[1] + 1  # turns taken
        self._done.extend(zip(*(x.tolist() for x in rows), strict=True))
        self.release(q.request_id[gi, ri].tolist())

    def record(self, idle_s: np.ndarray) -> None:
        """This tick's requests waiting on their environment, their KV, and the idle seconds of
        groups that hold some (the ``env_wait`` activity)."""
        w = self.requests.width()
        waiting = self.waiting(w)
        n = waiting.sum(axis=1)
        kv = np.where(waiting, self.requests.context(w), 0).sum(axis=1)
        self.waiting_requests.append(n)
        self.waiting_kv.append(kv)
        self.env_wait_s.append(np.where(n > 0, np.maximum(idle_s, 0.0), 0.0))
