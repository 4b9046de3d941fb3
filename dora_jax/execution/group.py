"""Handles on one rollout group's engine: run at once on the caller's thread, or on its own thread.

The backend (:mod:`dora_jax.execution.backend`) talks to every group through the same handle
API, whichever clock drives the run:

- :class:`SyncGroup` (logical clock): each call runs on the caller's thread before it returns, and
  :meth:`SyncGroup.step` advances the engine by one step. Deterministic.
- :class:`ThreadGroup` (wall clock): a worker thread owns the engine. It applies the calls in the
  order they were made (they return at once, except :meth:`interrupt`), steps the engine whenever
  it holds a request, and posts a :class:`GroupEvent` to the run's bus for every engine step,
  weight load and KV move, stamped with the run's clock. A weight load or a migration stalls
  only the groups it involves; the others keep decoding.

Migration: the source packs the requests' KV (``Engine.move_out``) and the destination unpacks
it into its cache (``Engine.move_in``); nothing is re-prefilled. Both ends take their place in
their queues when the move is asked for, so calls are applied in the order the control plane
made them on every group (the destination waits for the source's packing, which never waits on
anything: no cycle of waits can form). A weight load from another group likewise waits for that
group's own load of the version, which was asked for earlier.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import jax

from dora_jax.orchestrator.backend import GroupTick
from dora_jax.rollout import Engine, Request
from dora_jax.rollout import FinishedRequest as EngineFinished
from dora_jax.rollout.engine import Handover
from dora_jax.rollout.requests import (
    exported_as_data,
    exported_from_data,
    request_as_data,
    request_from_data,
)

Params = Any


@dataclass(frozen=True)
class FromTrainer:
    """A weight load from the trainer's export of a published version."""

    params: Params


@dataclass(frozen=True)
class Pull:
    """A weight load or a handover that waits in another process (``transfers.fetch``)."""

    uid: int


ParamsSource = FromTrainer | Future | Pull  # (a Future: a group of this process, maybe loading)

# Weight loads read arrays that other threads may be reading at the same moment (one published
# version loaded into several groups at once). Splitting a sharded array into its shards for a
# copy is not safe from several threads at once in jax 0.10 (a copy saw 3 of 4 shards), so the
# copies are started one at a time; waiting for them to land is not serialised.
_LOAD_LOCK = threading.Lock()


@dataclass(frozen=True)
class GroupStatus:
    """An engine's requests and KV use, as of its last change (read from any thread)."""

    pages: dict[Hashable, int]  # every request it holds -> device KV pages it holds now
    pages_used: int
    pages_total: int


@dataclass(frozen=True)
class GroupEvent:
    """What a group did: one span (engine step, weight load, KV move) and its finished requests
    and ended model turns (conversations, now waiting on their environment), or the error that
    stopped its worker."""

    group: int
    span: GroupTick | None = None
    finished: tuple[EngineFinished, ...] = ()
    error: BaseException | None = None
    turn_ends: tuple[EngineFinished, ...] = ()


class _Core:
    """The operations on one engine, shared by both drivers; each returns the events it made.

    ``transfers`` (multi-process runs) moves weights and handovers to and from other processes.
    """

    def __init__(self, group: int, engine: Engine, now: Callable[[], float], transfers=None):
        self.group, self.engine, self.now, self.transfers = group, engine, now, transfers
        self.params: Future = Future()  # the params of the version this group serves (or gets)
        self.params.set_result(engine.params)

    # -- what a call names, made concrete on this group's thread ----------------------------------
    def source(self, src: Any) -> ParamsSource:
        """Where a load into this group takes its params: the trainer's, a group of this process
        (its future params), or another process's (``src.serve_params()``: a :class:`Pull`)."""
        if isinstance(src, FromTrainer | Pull):
            return src
        if isinstance(src, _Core):
            return src.params
        return src.serve_params()

    def _resolve(self, source: ParamsSource, timeout: float) -> Params:
        if isinstance(source, FromTrainer):
            return source.params
        if isinstance(source, Future):
            return source.result(timeout)
        shardings = self.engine.param_shardings
        arrays, _ = self.transfers.fetch(source.uid, jax.tree.leaves(shardings), timeout)
        return jax.tree.unflatten(jax.tree.structure(shardings), arrays)

    def serve_params(self) -> Pull:
        """Offer this group's params (once its load is done) to a group of another process."""
        uid = self.transfers.new_id()
        fut = self.params

        def run():
            self.transfers.serve(uid, jax.tree.leaves(fut.result(600)))

        threading.Thread(target=run, name=f"serve-params-{self.group}", daemon=True).start()
        return Pull(uid)

    def do_send_staged(self, ids: list[Hashable], uid: int) -> list[GroupEvent]:
        """Pack requests for a group of another process and offer them under ``uid``."""
        out, events = self.do_move_out(ids)
        running = out.running
        meta = {
            "running": None if running is None else exported_as_data(running, with_kv=False),
            "queued": [request_as_data(r) for r in out.queued],
            "parked": [exported_as_data(p) for p in out.parked],
        }
        self.transfers.serve(uid, [running.kv] if running is not None else [], meta)
        return events

    def fetch_handover(self, uid: int, timeout: float) -> Handover:
        arrays, meta = self.transfers.fetch(
            uid, lambda m: [self.engine.buffer_sharding] if m["running"] else [], timeout
        )
        running = exported_from_data(meta["running"], arrays[0]) if meta["running"] else None
        return Handover(running, [request_from_data(r) for r in meta["queued"]],
                        [exported_from_data(p) for p in meta["parked"]])  # fmt: skip

    def _span(self, activity: str, t0: float, active: int = 0, **counts) -> GroupTick:
        t1 = self.now()
        return GroupTick(
            self.group, self.engine.version, activity, active,
            counts.get("tokens", 0), counts.get("prefill", 0), counts.get("reprefill", 0),
            t1 - t0, t0, t1,
        )  # fmt: skip

    def do_load(self, source: ParamsSource, version: int, done: Future, timeout: float):
        t0 = self.now()
        params = self._resolve(source, timeout)
        with _LOAD_LOCK:
            self.engine.load_params(params, version)
        jax.block_until_ready(self.engine.params)
        done.set_result(self.engine.params)
        return [GroupEvent(self.group, self._span("transfer", t0))]

    def do_move_out(self, ids: list[Hashable]) -> tuple[Handover, list[GroupEvent]]:
        t0 = self.now()
        out = self.engine.move_out(ids)
        if out.running is not None:
            jax.block_until_ready(out.running.kv)
        return out, [GroupEvent(self.group, self._span("migrate", t0))]

    def do_move_in(self, handover: Handover) -> list[GroupEvent]:
        t0 = self.now()
        self.engine.move_in(handover)
        jax.block_until_ready(self.engine.cache)
        span = self._span("migrate", t0, self.engine.num_requests)
        return [GroupEvent(self.group, span)]

    def do_interrupt(self, ids: Iterable[Hashable]) -> list[Request]:
        held = set(self.engine.request_ids())
        mine = [i for i in ids if i in held]  # the others finished meanwhile
        return self.engine.interrupt(mine) if mine else []

    def do_step(self) -> GroupEvent:
        t0 = self.now()
        ld = self.engine.load()
        rep = self.engine.step()
        kind = "prefill" if rep.prefill_tokens else "decode" if rep.decode_tokens else "idle"
        span = self._span(
            kind, t0, ld.active + ld.pending + ld.parked, tokens=rep.sampled_tokens,
            prefill=rep.prefill_tokens, reprefill=rep.reprefill_tokens,
        )  # fmt: skip
        return GroupEvent(self.group, span, tuple(rep.finished), turn_ends=tuple(rep.turn_ends))

    def snapshot_state(self):
        """A host copy of everything the engine holds (checkpoints), on the group's thread."""
        return self.call(lambda engine: engine.snapshot())

    def restore_state(self, snap, params: ParamsSource | Any) -> None:
        """Load ``params`` (a pytree, or a :class:`Pull`) at the snapshot's version and continue
        from the snapshot, on the group's thread."""

        def restore(engine):
            p = self._resolve(params, 600) if isinstance(params, Pull) else params
            engine.load_params(p, snap.version)
            engine.restore(snap)
            return engine.params

        self.params = Future()
        self.params.set_result(self.call(restore))

    def snapshot(self) -> GroupStatus:
        ld = self.engine.load()
        return GroupStatus(self.engine.held_pages(), ld.pages_used, ld.pages_total)


class SyncGroup(_Core):
    """Every call runs before it returns (logical clock); :meth:`step` is one engine step."""

    def __init__(self, group, engine, now, wait_s: float = 600, transfers=None):
        super().__init__(group, engine, now, transfers)
        self.events: list[GroupEvent] = []  # spans of loads and moves since the last step
        self.wait_s = wait_s
        self.status = self.snapshot()

    def load(self, src: Any, version: int) -> Future:
        """``src``: :class:`FromTrainer` or the handle of the group to copy from."""
        source = self.source(src)
        self.params = Future()
        self.events += self.do_load(source, version, self.params, self.wait_s)
        self.status = self.snapshot()
        return self.params

    def submit(self, requests: list[Request]) -> None:
        self.engine.submit(requests)
        self.status = self.snapshot()

    def migrate(self, ids: list[Hashable], dst: Any) -> None:
        if isinstance(dst, SyncGroup):
            handover, events = self.do_move_out(ids)
            self.events += events
            dst.events += dst.do_move_in(handover)
            self.status, dst.status = self.snapshot(), dst.snapshot()
            return
        uid = self.transfers.new_id()  # a group of another process
        self.send_staged(ids, uid)
        dst.expect(uid)

    def send_staged(self, ids: list[Hashable], uid: int) -> None:
        """Pack requests and offer them under ``uid`` to another process's group."""
        self.events += self.do_send_staged(ids, uid)
        self.status = self.snapshot()

    def expect(self, uid: int) -> None:
        """Take the handover offered under ``uid`` by another process's group."""
        self.events += self.do_move_in(self.fetch_handover(uid, self.wait_s))
        self.status = self.snapshot()

    def interrupt(self, ids: list[Hashable]) -> list[Request]:
        out = self.do_interrupt(ids)
        self.status = self.snapshot()
        return out

    def extend(self, items: list[tuple[Hashable, tuple[int, ...]]]) -> None:
        """Conversations waiting on their environment: append its turns (``(id, tokens)``)."""
        for rid, tokens in items:
            self.engine.extend(rid, tokens)
        self.status = self.snapshot()

    def end(self, ids: list[Hashable]) -> None:
        """Conversations whose episode is over: free them."""
        self.engine.end(ids)
        self.status = self.snapshot()

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """``fn(engine)`` now (snapshots and restores for checkpoints)."""
        out = fn(self.engine)
        self.status = self.snapshot()
        return out

    def step(self) -> list[GroupEvent]:
        events, self.events = self.events, []
        if self.engine.has_work:  # an empty engine's step is free: skip the call
            events.append(self.do_step())
        else:  # idle, or waiting on the environment of the conversations it holds
            kind = "env_wait" if self.engine.waiting_ids() else "idle"
            span = self._span(kind, self.now(), self.engine.num_requests)
            events.append(GroupEvent(self.group, span))
        self.status = self.snapshot()
        return events


class ThreadGroup(_Core):
    """A worker thread owns the engine; calls are queued and applied in order (module docs)."""

    POLL_S = 0.05  # how long an idle worker waits for a command before looking again

    def __init__(self, group, engine, now, post, wait_s: float = 600, transfers=None):
        super().__init__(group, engine, now, transfers)
        self.post, self.wait_s = post, wait_s
        self.status = self.snapshot()  # replaced after every change
        self._q: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._pausing = False
        self._paused = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=f"group-{group}", daemon=True)

    # -- calls from the control loop's thread -----------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def load(self, src: Any, version: int) -> Future:
        """``src``: :class:`FromTrainer` or the handle of the group to copy from."""
        source = self.source(src)
        done = self.params = Future()
        self._q.put(lambda: self._emit(self.do_load(source, version, done, self.wait_s)))
        return done

    def submit(self, requests: list[Request]) -> None:
        self._q.put(lambda: self.engine.submit(requests))

    def migrate(self, ids: list[Hashable], dst: Any) -> None:
        """Queue the move on both ends at once: the destination's place in its own queue is taken
        now, so every later call to either group sees the requests where the control plane
        put them (a request moved on before it landed follows in order)."""
        if not isinstance(dst, ThreadGroup):  # a group of another process
            uid = self.transfers.new_id()
            self.send_staged(ids, uid)
            dst.expect(uid)
            return
        handover: Future = Future()

        def send():
            try:
                out, events = self.do_move_out(ids)
            except BaseException as e:
                handover.set_exception(e)
                raise
            handover.set_result(out)
            self._emit(events)

        dst._q.put(lambda: dst._emit(dst.do_move_in(handover.result(dst.wait_s))))
        self._q.put(send)

    def send_staged(self, ids: list[Hashable], uid: int) -> None:
        """Pack requests (in queue order) and offer them under ``uid`` to another process."""
        self._q.put(lambda: self._emit(self.do_send_staged(ids, uid)))

    def expect(self, uid: int) -> None:
        """Take (in queue order) the handover another process's group offers under ``uid``."""
        self._q.put(lambda: self._emit(self.do_move_in(self.fetch_handover(uid, self.wait_s))))

    def interrupt(self, ids: list[Hashable]) -> list[Request]:
        return self.call(lambda engine: self.do_interrupt(ids))

    def extend(self, items: list[tuple[Hashable, tuple[int, ...]]]) -> None:
        """Queue environment turns for conversations waiting on them (``(id, tokens)``)."""

        def run():
            for rid, tokens in items:
                self.engine.extend(rid, tokens)

        self._q.put(run)

    def end(self, ids: list[Hashable]) -> None:
        """Queue the end of conversations whose episode is over."""
        self._q.put(lambda: self.engine.end(ids))

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """``fn(engine)`` on the worker thread, in order with the other calls; waits for it (also
        while paused: snapshots and restores for checkpoints)."""
        fut: Future = Future()

        def run():
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                fut.set_exception(e)

        self._q.put(run)
        return fut.result(self.wait_s)

    def pause(self) -> None:
        """Stop stepping once every call made before this one is applied (see :meth:`paused`)."""
        self._paused.clear()

        def mark():
            self._pausing = True

        self._q.put(mark)

    def paused(self) -> bool:
        return self._paused.is_set()

    def resume(self) -> None:
        def unmark():
            self._pausing = False
            self._paused.clear()

        self._q.put(unmark)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._q.put(lambda: None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker thread ------------------------------------------------------------------------
    def _emit(self, events: list[GroupEvent]) -> None:
        self.status = self.snapshot()
        for e in events:
            self.post(e)

    def _loop(self) -> None:
        waiting_since = None  # idle while conversations wait on their environment, since then
        try:
            while not self._stop:
                idle = self._pausing or not self.engine.has_work
                if idle and waiting_since is None and self.engine.waiting_ids():
                    waiting_since = self.now()
                try:
                    call = self._q.get(timeout=self.POLL_S) if idle else self._q.get_nowait()
                except queue.Empty:
                    call = None
                if call is not None:
                    if waiting_since is not None:  # the environment wait ends with this call
                        n = self.engine.num_requests
                        self._emit(
                            [GroupEvent(self.group, self._span("env_wait", waiting_since, n))]
                        )
                        waiting_since = None
                    call()
                    self.status = self.snapshot()
                    continue
                if self._pausing:
                    self._paused.set()
                elif self.engine.has_work:
                    self._emit([self.do_step()])
        except BaseException as e:  # noqa: BLE001 - handed to the control loop, which raises it
            self.post(GroupEvent(self.group, error=e))
