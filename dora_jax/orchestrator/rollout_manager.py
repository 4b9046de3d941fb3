"""Dispatch of prompt groups, admission of their requests, and the ledger of every request.

A prompt group is dispatched *at a version*: its ``G`` requests are tagged with it and wait in
the pending list of that version until a group holding that version has a free slot. The ledger
follows every request id through ``pending -> running -> finished -> consumed`` (``partial``
mode: ``running -> pending`` again on an update; ``oversample``: ``-> discarded``) and raises on
any other transition, so a request can end only once.

A run that keeps its history on disk (``keep_ended`` false, :meth:`Runtime.stream_history`)
drops a prompt group's requests from the ledger once the group is consumed and only counts them
(``consumed``): the ledger then holds the requests in flight, not every request of the run. (A
request consumed twice still raises: it is no longer in the ledger, and only a known request may
change state. Discarded requests stay, so that one finishing while it is interrupted is dropped.)
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from dataclasses import dataclass, replace
from typing import Protocol

from dora_jax.orchestrator.backend import (
    FinishedRequest,
    GroupInfo,
    PartialRequest,
    RequestSpec,
    RolloutBackend,
)
from dora_jax.orchestrator.transfer_queue import ReadyGroup, TransferQueue
from dora_jax.orchestrator.versions import VersionWindow

PENDING, RUNNING, FINISHED, CONSUMED, DISCARDED = (
    "pending",
    "running",
    "finished",
    "consumed",
    "discarded",
)
_ALLOWED = {
    PENDING: {RUNNING, DISCARDED},
    RUNNING: {FINISHED, PENDING, DISCARDED},
    FINISHED: {CONSUMED, DISCARDED},
    CONSUMED: set(),
    DISCARDED: set(),
}


@dataclass(frozen=True)
class PromptSpec:
    prompt_len: int
    payload: object = None  # prompt tokens and answer: opaque to the control plane


class PromptStream(Protocol):
    def next_prompt(self) -> PromptSpec: ...


class SyntheticPrompts:
    """Prompt lengths drawn uniformly in ``[min_len, max_len]``, deterministic per seed."""

    def __init__(self, seed: int = 0, min_len: int = 16, max_len: int = 128):
        if not 0 < min_len <= max_len:
            raise ValueError(f"need 0 < min_len <= max_len, got {min_len}, {max_len}")
        self._rng = random.Random(seed)
        self.min_len, self.max_len = min_len, max_len

    def next_prompt(self) -> PromptSpec:
        return PromptSpec(self._rng.randint(self.min_len, self.max_len))


class LedgerError(RuntimeError):
    """A request would change state illegally (e.g. end twice)."""


class RolloutManager:
    """Creates prompt groups at a version and feeds their requests to groups of that version."""

    def __init__(
        self,
        group_size: int,
        prompts: PromptStream,
        window: VersionWindow,
        queue: TransferQueue,
        admission: str = "spread",
    ):
        self.group_size = group_size
        self.admission = admission  # orchestrator.admission: spread or fill
        self.prompts = prompts
        self.window = window
        self.queue = queue
        self.status: dict[int, str] = {}
        self.pending: dict[int, deque[RequestSpec]] = {}
        self._pg_members: dict[int, tuple[int, ...]] = {}
        self._started: set[int] = set()  # prompt groups with a member admitted at least once
        self._next_pg = 0
        self.keep_ended = True  # False: consumed requests leave the ledger (counted)
        self.consumed = 0  # requests consumed and dropped from the ledger

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The ledger and the pending requests (plain data; the prompt source keeps its own
        cursor)."""
        return {
            "status": dict(self.status),
            "pending": {v: list(q) for v, q in self.pending.items()},
            "members": dict(self._pg_members),
            "started": sorted(self._started),
            "next_pg": self._next_pg,
            "consumed": self.consumed,
        }

    def load_state_dict(self, state: dict) -> None:
        self.status = dict(state["status"])
        self.pending = {v: deque(q) for v, q in state["pending"].items()}
        self._pg_members = dict(state["members"])
        self._started = set(state["started"])
        self._next_pg = state["next_pg"]
        self.consumed = state.get("consumed", 0)
        if not self.keep_ended:
            self.forget_ended()

    def forget_ended(self) -> None:
        """Drop the consumed requests (and their prompt groups) from the ledger, counted."""
        done = [rid for rid, s in self.status.items() if s == CONSUMED]
        for rid in done:
            del self.status[rid]
        self.consumed += len(done)
        for pg in [
            pg for pg, ids in self._pg_members.items() if all(rid not in self.status for rid in ids)
        ]:
            del self._pg_members[pg]
            self._started.discard(pg)

    def ledger(self) -> dict[int, str]:
        """Request id -> state (without the consumed requests dropped from the ledger)."""
        return dict(self.status)

    def state_counts(self) -> dict[str, int]:
        """Requests per state, those dropped from the ledger included."""
        counts = Counter(self.status.values())
        if self.consumed:
            counts[CONSUMED] += self.consumed
        return dict(counts)

    # -- ledger ----------------------------------------------------------------------------------

    def _move(self, rid: int, new: str) -> None:
        old = self.status.get(rid)
        if old is None or new not in _ALLOWED[old]:
            raise LedgerError(f"request {rid}: {old} -> {new} is not allowed")
        self.status[rid] = new

    def members(self, prompt_group: int) -> tuple[int, ...]:
        return self._pg_members[prompt_group]

    @property
    def dispatched_prompt_groups(self) -> int:
        return self._next_pg

    @property
    def in_flight(self) -> int:
        """Prompt groups dispatched and not ready yet."""
        return self.queue.num_open

    def pending_count(self, version: int | None = None) -> int:
        if version is None:
            return sum(len(q) for q in self.pending.values())
        return len(self.pending.get(version, ()))

    def pending_by_version(self) -> dict[int, int]:
        return {v: len(q) for v, q in self.pending.items() if q}

    # -- dispatch --------------------------------------------------------------------------------

    def dispatch(self, version: int, n: int) -> list[int]:
        """Create ``n`` prompt groups at ``version``; their requests wait to be admitted."""
        if n <= 0:
            return []
        self.window.add(version, n)
        q = self.pending.setdefault(version, deque())
        made = []
        for _ in range(n):
            pg = self._next_pg
            self._next_pg += 1
            prompt = self.prompts.next_prompt()
            ids = tuple(pg * self.group_size + j for j in range(self.group_size))
            self._pg_members[pg] = ids
            self.queue.open(pg, version)
            for rid in ids:
                self.status[rid] = PENDING
                q.append(RequestSpec(rid, pg, version, prompt.prompt_len, prompt.payload))
            made.append(pg)
        return made

    def requeue(self, partials: list[PartialRequest], version: int) -> None:
        """Interrupted requests wait again, first in line, to continue under ``version``."""
        q = self.pending.setdefault(version, deque())
        for p in reversed(partials):
            self._move(p.request_id, PENDING)
            q.appendleft(
                RequestSpec(
                    p.request_id, p.prompt_group, version, p.prompt_len, p.payload, resume=p
                )
            )

    def upgrade_unstarted(self, version: int) -> int:
        """Re-tag prompt groups none of whose requests has started to the newer ``version``; returns
        how many. A prompt group's version binds when its first request lands on a group; before
        that moving it to a newer version only makes it fresher, and never breaks the bound."""
        moved = 0
        for v in sorted(self.pending):
            if v >= version or not self.pending[v]:
                continue
            q = self.pending[v]
            order = dict.fromkeys(sp.prompt_group for sp in q)
            pgs = [pg for pg in order if pg not in self._started]
            if not pgs:
                continue
            up = set(pgs)
            self.pending[v] = deque(sp for sp in q if sp.prompt_group not in up)
            dst = self.pending.setdefault(version, deque())
            dst.extend(replace(sp, version=version) for sp in q if sp.prompt_group in up)
            self.window.retag(v, version, len(pgs))
            for pg in pgs:
                self.queue.retag(pg, version)
            moved += len(pgs)
        return moved

    def retag_pending(self, version: int) -> None:
        """Move every pending request to ``version`` (all groups switched to it)."""
        moved: deque[RequestSpec] = deque()
        for v in sorted(self.pending):
            q = self.pending.pop(v)
            moved.extend(s if s.version == version else replace(s, version=version) for s in q)
        if moved:
            self.pending[version] = moved

    # -- admission -------------------------------------------------------------------------------

    def admit(self, backend: RolloutBackend, infos: list[GroupInfo]) -> int:
        """Submit pending requests to free slots of groups holding their version, spread evenly
        or filling the fullest group first (``admission``)."""
        submitted = 0
        for version, q in self.pending.items():
            groups = [g for g in infos if g.version == version and g.free_slots]
            if not q or not groups:
                continue
            per_group = _fill(q, groups) if self.admission == "fill" else _spread(q, groups)
            for gid, specs in per_group.items():
                backend.submit(gid, specs)
                for s in specs:
                    self._move(s.request_id, RUNNING)
                    self._started.add(s.prompt_group)
                submitted += len(specs)
        for v in [v for v, q in self.pending.items() if not q]:  # (one per version: they add up)
            del self.pending[v]
        return submitted

    # -- completion ------------------------------------------------------------------------------

    def on_finished(self, fr: FinishedRequest, tick: int) -> ReadyGroup | None:
        self._move(fr.request_id, FINISHED)
        return self.queue.add(fr, tick)

    def on_consumed(self, groups: list[ReadyGroup]) -> None:
        for rg in groups:
            for t in rg.trajectories:
                self._move(t.request_id, CONSUMED)
            if not self.keep_ended:  # the whole prompt group is consumed at once
                for rid in self._pg_members.pop(rg.prompt_group):
                    del self.status[rid]
                    self.consumed += 1
                self._started.discard(rg.prompt_group)

    def abort(self, backend: RolloutBackend, prompt_groups: list[int]) -> int:
        """Discard prompt groups (oversample): interrupt their running members, drop the rest;
        returns the number of requests discarded."""
        drop = set(prompt_groups)
        running = [
            rid
            for pg in prompt_groups
            for rid in self._pg_members[pg]
            if self.status[rid] == RUNNING
        ]
        if running:
            backend.interrupt(running, discard=True)
        for v, q in self.pending.items():
            if any(s.prompt_group in drop for s in q):
                self.pending[v] = deque(s for s in q if s.prompt_group not in drop)
        n = 0
        for pg in prompt_groups:
            version, _ = self.queue.discard(pg)
            self.window.close(version)
            for rid in self._pg_members[pg]:
                self._move(rid, DISCARDED)
                n += 1
        return n


def _spread(q: deque, groups: list[GroupInfo]) -> dict[int, list[RequestSpec]]:
    """One request at a time to the group with the most free slots (the lowest id on a tie)."""
    heap = [(-g.free_slots, g.group) for g in groups]
    heapq.heapify(heap)
    per_group: dict[int, list[RequestSpec]] = {}
    while q and heap:
        free, gid = heapq.heappop(heap)
        per_group.setdefault(gid, []).append(q.popleft())
        if free + 1 < 0:
            heapq.heappush(heap, (free + 1, gid))
    return per_group


def _fill(q: deque, groups: list[GroupInfo]) -> dict[int, list[RequestSpec]]:
    """The fullest group's free slots first (the fewest free, then the lowest id)."""
    per_group: dict[int, list[RequestSpec]] = {}
    for g in sorted(groups, key=lambda g: (g.free_slots, g.group)):
        if not q:
            break
        per_group[g.group] = [q.popleft() for _ in range(min(g.free_slots, len(q)))]
    return per_group
