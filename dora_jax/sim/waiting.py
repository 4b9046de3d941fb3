"""Requests waiting on their environment: the turn boundaries of the simulated backend.

:class:`WaitingRequests` is the part of :class:`~dora_jax.sim.backend.SimBackend` that runs
conversations (the backend's module docstring gives the model, ``wake`` being when a waiting
request's observation arrives, in microseconds of modeled time) and keeps the records of
waiting requests that the figures and the timeline read. With ``latency.workers`` the calls
queue for a pool of environment workers, each running one call at a time: a conversation keeps
the worker it was given when first submitted (the one holding the fewest live conversations),
and a worker takes its calls in the order their turns ended, so ``wake`` is when its worker is
free (or the turn ended, if later) plus the call's own seconds, which alone count as the
conversation's environment time.

The mixin works on the backend's packed request rows (``rid``, ``pg``, ``gen``, ``target``,
``pf``, ``turn``, ``wake``, ``obs``, ``otok``, ``envus``, ``n``), its ``conversations`` workload,
``max_slots``, ``tick_s`` and tick.
"""

from __future__ import annotations

import numpy as np

from dora_jax.sim.conversations import US


class WaitingRequests:
    """Turn ends, wake-ups and the records of requests waiting on their environment."""

    def _init_env_workers(self) -> None:
        """The pool of environment workers (``conversations.cfg.latency.workers``; none: every
        call starts when its turn ends)."""
        lat = getattr(getattr(self.conversations, "cfg", None), "latency", None)
        n = int(getattr(lat, "workers", 0) or 0)
        self.env_workers = n
        self._env_free = np.zeros(n, np.int64)  # microseconds at which each worker is free
        self._env_live = np.zeros(n, np.int64)  # live conversations each worker holds
        self._env_of: dict[int, int] = {}  # request id -> its worker
        # with workers: every call as (its worker, microseconds it started, it ended, it
        # waited for its worker), in the order the calls were made
        self.env_calls: list[tuple[int, int, int, int]] = []

    def _env_assign(self, request_ids: list[int]) -> None:
        """New conversations take the worker holding the fewest live ones (lowest on ties)."""
        for r in request_ids if self.env_workers else ():
            w = int(np.argmin(self._env_live))
            self._env_of[r] = w
            self._env_live[w] += 1

    def _env_release(self, request_ids: list[int]) -> None:
        for r in request_ids if self.env_workers else ():
            w = self._env_of.pop(r, None)
            if w is not None:
                self._env_live[w] -= 1

    def _env_queue(self, rids: np.ndarray, at_us: np.ndarray, lat_us: np.ndarray) -> np.ndarray:
        """When calls made at ``at_us`` taking ``lat_us`` answer, on their conversations'
        workers, each taking its calls in the order their turns ended (ties: request id)."""
        out = np.empty_like(at_us)
        for i in np.lexsort((rids, at_us)).tolist():
            w = self._env_of[int(rids[i])]
            start = max(int(at_us[i]), int(self._env_free[w]))
            out[i] = start + int(lat_us[i])
            self._env_free[w] = out[i]
            self.env_calls.append((w, start, int(out[i]), start - int(at_us[i])))
        return out

    def conversation_log(self) -> dict[str, np.ndarray]:
        """Every finished conversation, sorted by request id: ``rid``, ``turns``,
        ``model_tokens``, ``observation_tokens``, ``env_us``."""
        rows = sorted(self._done_conversations)
        cols = np.array(rows, np.int64).reshape(-1, 5).T
        names = ("rid", "turns", "model_tokens", "observation_tokens", "env_us")
        return dict(zip(names, cols, strict=True))

    def _waiting(self, w: int) -> np.ndarray:
        """``[groups, w]``: held requests waiting on their environment."""
        return (self.wake[:, :w] > 0) & (self._col[None, :w] < self.n[:, None])

    def _slots_held(self, w: int) -> np.ndarray:
        """Slots each group's requests hold: all of them but those waiting on an environment."""
        if self.conversations is None:
            return self.n
        return self.n - self._waiting(w).sum(axis=1)

    def _wake_up(self) -> np.ndarray:
        """Requests whose observation arrives by the middle of this tick stop waiting: its
        tokens join their context, to prefill. Returns the rows that hold a slot this tick:
        held, not waiting, the oldest ``max_slots`` of each group."""
        w = int(self.n.max())
        waiting = self._waiting(w)
        now = int(round((self._tick + 0.5) * self.tick_s * US))
        gi, ri = np.nonzero(waiting & (self.wake[:, :w] <= now))
        if len(gi):
            obs = self.obs[gi, ri]
            self.gen[gi, ri] += obs
            self.otok[gi, ri] += obs
            self.pf[gi, ri] += obs
            self.obs[gi, ri] = 0
            self.wake[gi, ri] = 0
            waiting[gi, ri] = False
        live = (self._col[None, :w] < self.n[:, None]) & ~waiting
        return live & (np.cumsum(live, axis=1) <= self.max_slots)

    def _end_turns(self, gi: np.ndarray, ri: np.ndarray, at_us: np.ndarray) -> np.ndarray:
        """Rows ``(gi, ri)`` ended a model turn at ``at_us``: those with a turn to come wait on
        their environment from then on. Returns which of them ended their conversation."""
        conv = self.conversations
        pg, members = self.pg[gi, ri], self.rid[gi, ri] % conv.group_size
        goes, obs, lat, target = conv.after_turn(pg, members, self.turn[gi, ri], self.gen[gi, ri])
        g, r = gi[goes], ri[goes]
        self.turn[g, r] += 1
        self.obs[g, r] = obs[goes]
        if self.env_workers:
            self.wake[g, r] = self._env_queue(self.rid[g, r], at_us[goes], lat[goes])
        else:
            self.wake[g, r] = at_us[goes] + lat[goes]
        self.envus[g, r] += lat[goes]
        self.target[g, r] = target[goes]
        return ~goes

    def _log_conversations(self, gi: np.ndarray, ri: np.ndarray) -> None:
        model = self.gen[gi, ri] - self.otok[gi, ri]
        cols = (self.rid, self.turn, None, self.otok, self.envus)
        rows = [model if c is None else c[gi, ri] for c in cols]
        rows[1] = rows[1] + 1  # turns taken
        self._done_conversations.extend(zip(*(x.tolist() for x in rows), strict=True))

    def _record_waits(self, idle_s: np.ndarray) -> None:
        """This tick's requests waiting on their environment, their KV, and the idle seconds of
        groups that hold some (the ``env_wait`` activity)."""
        w = int(self.n.max())
        waiting = self._waiting(w)
        n = waiting.sum(axis=1)
        kv = np.where(waiting, self.plen[:, :w] + self.gen[:, :w], 0).sum(axis=1)
        self.waiting_requests.append(n)
        self.waiting_kv.append(kv)
        self.env_wait_s.append(np.where(n > 0, np.maximum(idle_s, 0.0), 0.0))
