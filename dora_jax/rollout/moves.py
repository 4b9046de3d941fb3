"""Requests leaving and entering an engine with their KV: export/import (migration between groups
of one version), park to host memory, interrupt (KV dropped), snapshot/restore (checkpoints).

:class:`RequestMoves` is the part of :class:`~dora_jax.rollout.engine.Engine` that moves requests;
it works on the engine's slots, queues, page allocator and cache. A request keeps its state when
it moves: running (in a slot, decoding), waiting on its environment (multi-turn: KV kept, no
slot), ready to be fed (an environment turn appended, not yet prefilled) or queued (no KV).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from dora_jax.rollout.requests import ExportedRequests, Request


class EngineError(RuntimeError):
    """A request or operation the engine refuses (wrong version, too long, no capacity)."""


@dataclass
class EngineSnapshot:
    version: int | None
    running: ExportedRequests  # every request with KV on the device (KV as host numpy)
    pending: list[Request]  # requests without KV (queued, or waiting after an interrupt)
    parked: list[ExportedRequests]


@dataclass
class Handover:
    """Requests leaving an engine for another of the same version: those with KV on the device
    packed (``running``), those without KV as they are (``queued``), parked ones with their KV in
    host memory (``parked``). Nothing is recomputed where they land."""

    running: ExportedRequests | None
    queued: list[Request]
    parked: list[ExportedRequests]

    @property
    def ids(self) -> list[Hashable]:
        out = [r.id for r in self.running.requests] if self.running else []
        out += [r.id for r in self.queued]
        return out + [r.id for p in self.parked for r in p.requests]


def split_parked(x: ExportedRequests) -> list[ExportedRequests]:
    """One host-memory export per request, so parked requests resume, end or move one by one.

    A pack buffer ``[2, 1, K, L * w, Z, H]`` holds ``n`` pages per layer padded to ``w``, the
    next power of two (page ``j`` of layer ``l`` at ``l * w + j``); each part is laid out the
    same way for its own pages."""
    if len(x.requests) == 1:
        return [x]
    kv = np.asarray(x.kv)
    width = padded_pages(x.num_pages)
    layers = kv.shape[3] // width
    out, first = [], 0
    for r, c in zip(x.requests, x.page_counts, strict=True):
        w = padded_pages(c)
        part = np.zeros((*kv.shape[:3], layers * w, *kv.shape[4:]), kv.dtype)
        for l in range(layers):
            part[:, :, :, l * w : l * w + c] = kv[
                :, :, :, l * width + first : l * width + first + c
            ]
        out.append(ExportedRequests([r], [c], part))
        first += c
    return out


def padded_pages(n: int) -> int:
    """The padded page count of a pack buffer (the engine's ``_page_ids``): the next power of two
    (1 for none)."""
    return 1 << max(n - 1, 0).bit_length()


class RequestMoves:
    """Export, import, park, interrupt, snapshot and restore (mixed into the engine)."""

    # -- moving requests -----------------------------------------------------------------------
    def move_sizes(self) -> list[int]:
        """The pack sizes a move can have here: powers of two up to the pages a group holds."""
        top = padded_pages(self.alloc.num_pages - 1)
        return [1 << i for i in range(top.bit_length())]

    def compile_move(self, size: int) -> None:
        """Compile the programs that pack and unpack a move of ``size`` padded pages on this
        group's device, by packing the padding page into itself (its content stays its own).
        Without it a group's first move of each size compiles on the spot: about 0.15 s on an
        idle CPU core, several times that beside busy groups."""
        ids = [0] * size
        self._unpack(self._pack(ids), self._page_ids(ids))
        jax.block_until_ready(self.cache)

    def compile_moves(self) -> list[int]:
        """:meth:`compile_move` for every size; returns the sizes."""
        sizes = self.move_sizes()
        for n in sizes:
            self.compile_move(n)
        return sizes

    def export_requests(self, ids: Sequence[Hashable]) -> ExportedRequests:
        """Take requests whose KV is on the device (running, waiting or ready to be fed) out with
        their KV pages packed into one buffer on this mesh. Their slots and pages are freed here;
        nothing is recomputed at the destination."""
        reqs = [self._on_device(i) for i in ids]
        for r in reqs:
            r.compact_routes()
        page_counts, kv = self._pack_requests(reqs)
        for r in reqs:
            self._release(r)
        return ExportedRequests(reqs, page_counts, kv)

    def snapshot(self):
        """A host copy of everything in flight (request records and the KV pages of the requests
        that have them on the device), taken without disturbing the engine: what a checkpoint
        stores."""
        on_device = self._device_requests()
        for r in on_device:
            r.compact_routes()
        counts, kv = self._pack_requests(on_device)
        kv = np.asarray(kv)
        return EngineSnapshot(
            version=self.version,
            running=ExportedRequests(copy.deepcopy(on_device), counts, kv),
            pending=copy.deepcopy(self._without_kv()),
            parked=copy.deepcopy(list(self.parked)),
        )

    def _pack_requests(self, reqs: Sequence[Request]) -> tuple[list[int], jax.Array]:
        """(pages per request, pack buffer of their cached KV), in request order."""
        counts = [self.alloc.pages_for(r.kv_len) for r in reqs]
        pages = [p for r, n in zip(reqs, counts, strict=True) for p in self.alloc.table(r.id)[:n]]
        return counts, self._pack(pages)

    def restore(self, snap) -> None:
        """Continue from a snapshot: the engine must be empty and serve ``snap.version``. Requests
        with KV get it back (no re-prefill); the rest queue or wait as they were."""
        if self.num_requests:
            raise EngineError(f"restore needs an empty engine, this one holds {self.num_requests}")
        if snap.version != self.version:
            raise EngineError(f"snapshot of version {snap.version}, engine serves {self.version}")
        if snap.running.requests:
            migrations = [r.migrations for r in snap.running.requests]
            self.import_requests(snap.running)
            for r, m in zip(snap.running.requests, migrations, strict=True):
                r.migrations = m  # a restore is not a migration
        for r in snap.pending:
            self._queue(r)
        for x in snap.parked:
            self.parked.extend(split_parked(x))

    def can_import(self, exported: ExportedRequests) -> bool:
        slots = sum(r is None for r in self.slots)
        running = sum(not r.waiting and not r.needs_feed for r in exported.requests)
        pages = sum(self.alloc.pages_for(self._room(r)) for r in exported.requests)
        return slots >= running and pages <= self.alloc.pages_free

    def import_requests(self, exported: ExportedRequests) -> None:
        """Take requests exported by an engine of the same version (any mesh of the same shape,
        or parked on the host) and continue them from their cached KV: a running one takes a
        slot, a waiting one waits here, one ready to be fed queues for its prefill."""
        self._check_version(exported.requests)
        if not self.can_import(exported):
            raise EngineError(
                f"no room for {len(exported.requests)} imported request(s): "
                f"{self.load().free_slots} free slot(s), {self.alloc.pages_free} free page(s)"
            )
        page_ids: list[int] = []
        for r, n in zip(exported.requests, exported.page_counts, strict=True):
            table = self.alloc.ensure(r.id, self._room(r))
            page_ids.extend(table[:n])
            r.migrations += 1
        ids = self._page_ids(page_ids)
        kv = exported.kv
        if kv.shape[3] != ids.shape[0]:
            raise EngineError(f"KV buffer holds {kv.shape[3]} pages, expected {ids.shape[0]}")
        self._unpack(jax.device_put(kv, self.buffer_sharding), ids)
        for r in exported.requests:
            self._place(r)

    def move_out(self, ids: Iterable[Hashable]) -> Handover:
        """Take requests out for another engine of this version, wherever they are here: those
        with KV on the device packed, those without as they are, parked ones with their host KV.
        Ids this engine does not hold (finished meanwhile) are skipped; :attr:`Handover.ids` says
        which were taken."""
        wanted = set(ids)
        device = [r.id for r in self._device_requests() if r.id in wanted]
        exported = self.export_requests(device) if device else None
        queued = [r for r in self._without_kv() if r.id in wanted]
        self._drop_unqueued(wanted)
        parked = [p for p in self.parked if p.requests[0].id in wanted]
        self.parked = deque(p for p in self.parked if p.requests[0].id not in wanted)
        return Handover(exported, queued, parked)

    def move_in(self, handover: Handover) -> None:
        """Take a :class:`Handover` from an engine of the same version: requests with KV continue
        from it when slots and pages allow, else wait parked (KV in host memory, resumed before
        any new admission); the others queue or wait. Nothing is re-prefilled."""
        for r in handover.queued:
            self._check_admissible(r)
        if handover.running is not None:
            if self.can_import(handover.running):
                self.import_requests(handover.running)
            else:
                self._check_version(handover.running.requests)
                handover.running.kv = np.asarray(handover.running.kv)
                self.parked.extend(split_parked(handover.running))  # moved when resumed
        for p in handover.parked:
            self._check_version(p.requests)
            self.parked.extend(split_parked(p))
        for r in handover.queued:
            self._queue(r)

    def park(self, ids: Sequence[Hashable]) -> ExportedRequests:
        """Export requests with their KV copied to host memory (the hierarchical KV store)."""
        out = self.export_requests(ids)
        out.kv = np.asarray(out.kv)
        return out

    def interrupt(self, ids: Sequence[Hashable]) -> list[Request]:
        """Stop requests (wherever they are) and return them without KV; what they generated so
        far stays on the returned records (a conversation waiting on its environment still
        waits: resubmitted, it waits again, and is prefilled afresh when extended)."""
        wanted = set(ids)
        out = [r for r in self._device_requests() if r.id in wanted]
        for r in out:
            self._release(r)
        out += [r for r in self._without_kv() if r.id in wanted]
        self._drop_unqueued(wanted)
        out += [p.requests[0] for p in self.parked if p.requests[0].id in wanted]
        self.parked = deque(p for p in self.parked if p.requests[0].id not in wanted)
        missing = wanted - {r.id for r in out}
        if missing:
            raise EngineError(f"unknown request id(s) {sorted(map(str, missing))}")
        for r in out:
            r.kv_len = 0
        return out

    # -- where requests are --------------------------------------------------------------------
    def _device_requests(self) -> list[Request]:
        """Requests whose KV is in this engine's cache: running, waiting, ready to be fed."""
        out = [r for r in self.slots if r is not None]
        out += [r for r in self.waiting.values() if r.kv_len]
        return out + [r for r in self.ready if r.kv_len]

    def _without_kv(self) -> list[Request]:
        """Requests held with no KV: queued for admission, or waiting/ready after an interrupt."""
        out = list(self.pending)
        out += [r for r in self.waiting.values() if not r.kv_len]
        return out + [r for r in self.ready if not r.kv_len]

    def _drop_unqueued(self, ids: set) -> None:
        """Forget the requests of ``ids`` that hold no KV here (they leave the engine)."""
        self.pending = deque(r for r in self.pending if r.id not in ids)
        self.ready = deque(r for r in self.ready if r.kv_len or r.id not in ids)
        for rid in [i for i, r in self.waiting.items() if not r.kv_len and i in ids]:
            del self.waiting[rid]

    def _on_device(self, rid: Hashable) -> Request:
        for r in self._device_requests():
            if r.id == rid:
                return r
        raise EngineError(f"request {rid!r} has no KV on this engine")

    def _release(self, r: Request) -> None:
        """Free ``r``'s slot or queue place and its pages (it leaves the engine)."""
        if r in self.slots:
            self.slots[self.slots.index(r)] = None
        elif r.id in self.waiting:
            del self.waiting[r.id]
        else:
            self.ready.remove(r)
        self.alloc.free(r.id)

    def _place(self, r: Request) -> None:
        """Put a request whose KV pages this engine now holds where its state says."""
        if r.waiting:
            self.waiting[r.id] = r
        elif r.needs_feed:
            self.ready.append(r)
        else:
            self.slots[self._free_slot()] = r

    def _queue(self, r: Request) -> None:
        """Hold a request that has no KV here: it waits (conversation), or queues for admission."""
        if r.waiting:
            self.waiting[r.id] = r
        elif r.tokens and r.needs_sample:
            self.ready.append(r)  # extended while it was away: prefilled from the start
        else:
            self.pending.append(r)

    @staticmethod
    def _room(r: Request) -> int:
        """Tokens of KV the request needs pages for: what it has, or what its next write adds."""
        return max(r.kv_len, 1) if r.waiting else r.feed_end + 1
