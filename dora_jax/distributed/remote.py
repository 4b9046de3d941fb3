"""Rollout groups on other processes: the control plane's handle (:class:`RemoteGroup`, on process
0) and the process that runs them (:class:`GroupHost`, on every other process).

Process 0 runs the control plane, the trainer and the groups on its own devices; a group on
another process gets a :class:`RemoteGroup`, which has the same calls as the local handles of
:mod:`dora_jax.execution.group`. Each call becomes a message on the ordered channel to that
process (``channel.py``); the host applies it to the group's own handle, which keeps the local
semantics: on the wall clock a worker thread per group, whose reports come back as ``events``
messages (time stamped in seconds since the epoch, turned into the run's clock on arrival); on
the logical clock every call is carried out before its reply, and ``step`` returns the group's
events, so a multi-process logical run makes the same decisions as a single-process one.

Weights and KV pages cross processes through the transfer servers (``transfers.py``): the
trainer's export is first placed on process 0 in the group's layout (same mesh shape and
PartitionSpecs as the group), then pulled shard to shard; a group's params or a handover's pack
buffer are already in that layout on the source group's mesh.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import jax

from dora_jax.distributed import wire
from dora_jax.distributed.channel import Channel
from dora_jax.distributed.transfers import Transfers
from dora_jax.execution.group import FromTrainer, GroupEvent, GroupStatus, Pull

WAIT_S = 600.0


class HostLink:
    """Process 0's end of the channels to every other process: requests with replies, the
    events they report, and the params staged for them."""

    def __init__(self, channel: Channel, transfers: Transfers, hosts: list[int], post, now,
                 stage_shardings: Callable[[], Any]):  # fmt: skip
        self.channel, self.transfers, self.post, self.now = channel, transfers, post, now
        self.stage_shardings = stage_shardings  # the group layout on process 0's devices
        self.groups: dict[int, RemoteGroup] = {}
        self._replies: dict[int, Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._staged: dict[int, Future] = {}  # version -> its params staged for pulls
        self._outbox: dict[int, list[dict]] = {h: [] for h in hosts}  # calls not yet sent
        for h in hosts:
            channel.listen(h, lambda msg, h=h: self._on_message(h, msg))

    def request(self, host: int, msg: dict, wait: bool) -> Any:
        """Send a call to ``host``. Calls that need no reply wait in an outbox, sent as one
        message by :meth:`flush` (once per control round), in order; one that needs a reply
        flushes first, then waits for it."""
        if not wait:
            with self._lock:
                self._outbox[host].append(msg)
            return None
        self.flush(host)
        rid = next(self._ids)
        fut: Future = Future()
        with self._lock:
            self._replies[rid] = fut
        self.channel.send(host, msg | {"reply": rid})
        return fut.result(WAIT_S)

    def flush(self, host: int | None = None) -> None:
        for h in [host] if host is not None else list(self._outbox):
            with self._lock:
                items, self._outbox[h] = self._outbox[h], []
            if items:
                self.channel.send(h, items[0] if len(items) == 1 else
                                  {"op": "batch", "items": items})  # fmt: skip

    def stage_trainer(self, params: Any, version: int) -> Pull:
        """Offer the trainer's ``params`` of ``version`` in the group layout (placed once per
        version, on a helper thread; the load message goes out at once, in order)."""
        uid = self.transfers.new_id()

        def run() -> None:
            def stage() -> list:
                """Once per version, shared by every group that loads it: a host copy (CPU; no
                layout needed), else the params placed in the group layout."""
                if self.transfers.via_store:
                    return self.transfers.host_copy(jax.tree.leaves(params))
                return jax.tree.leaves(jax.device_put(params, self.stage_shardings()))

            with self._lock:
                fut = self._staged.get(version)
                first = fut is None
                if first:
                    self._staged = {v: f for v, f in self._staged.items() if v >= version - 1}
                    fut = self._staged[version] = Future()
            if first:
                try:
                    fut.set_result(stage())
                except Exception as e:
                    fut.set_exception(e)
            self.transfers.serve(uid, fut.result(WAIT_S))

        threading.Thread(target=run, name=f"stage-v{version}", daemon=True).start()
        return Pull(uid)

    def _on_message(self, host: int, msg: dict) -> None:
        op = msg["op"]
        offset = time.time() - self.now()  # host stamps are epoch seconds
        self._statuses(msg.get("status", {}))
        if op == "reply":
            fut = self._replies.pop(msg["reply"])
            if msg.get("error"):
                fut.set_exception(wire.RemoteError(f"on process {host}: {msg['error']}"))
            else:
                fut.set_result(msg.get("value"))
        elif op == "events":
            for item in msg["items"]:
                e = _shift(wire.to_event(item, host), offset)
                if e.span is not None and e.span.activity == "transfer":
                    self.groups[e.group].loaded()
                self.post(e)
        elif op == "failed":
            self.post(GroupEvent(msg["group"], error=wire.RemoteError(
                f"on process {host}: {msg['error']}")))  # fmt: skip

    def _statuses(self, statuses: dict) -> None:
        for g, st in statuses.items():
            if int(g) in self.groups:  # (handles are made one by one at the start)
                self.groups[int(g)].status = wire.to_status(st)


def _shift(e: GroupEvent, offset: float) -> GroupEvent:
    if e.span is None:
        return e
    s = e.span
    return dataclasses.replace(e, span=s._replace(t0=s.t0 - offset, t1=s.t1 - offset))


class RemoteGroup:
    """The handle of a group on process ``host`` (same calls as the local handles)."""

    def __init__(self, group: int, host: int, link: HostLink, sync: bool, pages_total: int):
        self.group, self.host, self.link, self.sync = group, host, link, sync
        self.transfers = link.transfers
        self.status = GroupStatus({}, 0, pages_total)
        self.params: Future = Future()
        self._loads: list[Future] = []
        self._paused = False
        link.groups[group] = self

    def _send(self, op: str, wait: bool | None = None, **fields) -> Any:
        wait = self.sync if wait is None else wait
        return self.link.request(self.host, {"op": op, "g": self.group, **fields}, wait)

    # -- calls ----------------------------------------------------------------------------------
    def load(self, src: Any, version: int) -> Future:
        fut = self.params = Future()
        self._loads.append(fut)
        if isinstance(src, FromTrainer):
            source = {"pull": self.link.stage_trainer(src.params, version).uid}
        elif isinstance(src, RemoteGroup) and src.host == self.host:
            source = {"group": src.group}
        else:
            source = {"pull": src.serve_params().uid}
        self._send("load", version=version, src=source)
        if self.sync:
            self.loaded()
        return fut

    def loaded(self) -> None:
        if self._loads:
            self._loads.pop(0).set_result(None)

    def serve_params(self) -> Pull:
        uid = self.transfers.new_id()
        self._send("serve_params", uid=uid)
        return Pull(uid)

    def submit(self, requests: list) -> None:
        self._send("submit", requests=[wire.request(r) for r in requests])

    def migrate(self, ids: list, dst: Any) -> None:
        if isinstance(dst, RemoteGroup) and dst.host == self.host:
            self._send("migrate", ids=list(ids), dst=dst.group)
            return
        uid = self.transfers.new_id()
        self._send("migrate", ids=list(ids), uid=uid)
        dst.expect(uid)

    def expect(self, uid: int) -> None:
        self._send("receive", uid=uid)

    def interrupt(self, ids: list) -> list:
        return [wire.to_request(r) for r in self._send("interrupt", wait=True, ids=list(ids))]

    def extend(self, items: list) -> None:
        self._send("extend", items=[[rid, list(tokens)] for rid, tokens in items])

    def end(self, ids: list) -> None:
        self._send("end", ids=list(ids))

    def snapshot_state(self):
        return wire.to_snapshot(self._send("snapshot", wait=True))

    def restore_state(self, snap, params: Any) -> None:
        uid = self.link.stage_trainer(params, snap.version).uid
        self._send("restore", wait=True, snapshot=wire.snapshot(snap), uid=uid)
        self.params = Future()
        self.params.set_result(None)

    def step(self) -> list[GroupEvent]:
        offset = time.time() - self.link.now()
        items = self._send("step", wait=True)
        return [_shift(wire.to_event(i, self.host), offset) for i in items]

    def pause(self) -> None:
        self._paused = False
        self._send("pause", wait=False)

    def paused(self) -> bool:
        if not self._paused:
            self._paused = bool(self._send("paused", wait=True))
        return self._paused

    def resume(self) -> None:
        self._paused = False
        self._send("resume", wait=False)

    def stop(self, timeout: float = 10.0) -> None:
        """Nothing: the host stops all its groups at shutdown (``Cluster.stop_hosts``)."""


class GroupHost:
    """Runs this process's groups for process 0 (every process but 0)."""

    def __init__(self, channel: Channel, transfers: Transfers, engines: dict, wall: bool):
        from dora_jax.execution.group import SyncGroup, ThreadGroup
        from dora_jax.orchestrator.clock import Bus

        self.channel, self.transfers, self.wall = channel, transfers, wall
        self.bus = Bus()
        self.stopped = threading.Event()
        now = time.time  # epoch seconds: process 0 puts them on its own clock
        if wall:
            self.handles = {g: ThreadGroup(g, e, now, self.bus.post, transfers=transfers)
                            for g, e in engines.items()}  # fmt: skip
            for h in self.handles.values():
                h.start()
            threading.Thread(target=self._forward, name="forward", daemon=True).start()
        else:
            self.handles = {g: SyncGroup(g, e, now, transfers=transfers)
                            for g, e in engines.items()}  # fmt: skip

    def _statuses(self) -> dict:
        return {g: wire.status(h.status) for g, h in self.handles.items()}

    def _forward(self) -> None:
        while not self.stopped.is_set():
            events = self.bus.collect(0.05)
            if events:
                time.sleep(0.002)  # let a few more arrive: fewer, larger messages
                events += self.bus.collect(0)
                items = [wire.event(e) for e in events]
                self.channel.send(0, {"op": "events", "items": items, "status": self._statuses()})

    def handle(self, msg: dict) -> None:
        """Apply one message from process 0 (on the channel's thread, in order)."""
        try:
            value = self._apply(msg)
        except BaseException as e:  # noqa: BLE001 - reported to process 0, which raises it
            if "reply" in msg:
                self.channel.send(0, {"op": "reply", "reply": msg["reply"],
                                      "error": f"{type(e).__name__}: {e}"})  # fmt: skip
            else:
                self.channel.send(0, {"op": "failed", "group": msg.get("g", -1),
                                      "error": f"{type(e).__name__}: {e}"})  # fmt: skip
            return
        if "reply" in msg:
            self.channel.send(0, {"op": "reply", "reply": msg["reply"], "value": value,
                                  "status": self._statuses()})  # fmt: skip

    def _apply(self, msg: dict) -> Any:
        op, g = msg["op"], msg.get("g")
        if op == "batch":
            for item in msg["items"]:
                self.handle(item)
            return None
        h = self.handles.get(g)
        if op == "load":
            src = msg["src"]
            h.load(Pull(src["pull"]) if "pull" in src else self.handles[src["group"]],
                   msg["version"])  # fmt: skip
        elif op == "serve_params":
            fut, uid = h.params, msg["uid"]
            threading.Thread(target=lambda: self.transfers.serve(
                uid, jax.tree.leaves(fut.result(WAIT_S))), daemon=True).start()  # fmt: skip
        elif op == "submit":
            h.submit([wire.to_request(r) for r in msg["requests"]])
        elif op == "migrate":
            if "dst" in msg:
                h.migrate(msg["ids"], self.handles[msg["dst"]])
            else:
                h.send_staged(msg["ids"], msg["uid"])
        elif op == "receive":
            h.expect(msg["uid"])
        elif op == "interrupt":
            return [wire.request(r) for r in h.interrupt(msg["ids"])]
        elif op == "extend":
            h.extend([(rid, tuple(tokens)) for rid, tokens in msg["items"]])
        elif op == "end":
            h.end(msg["ids"])
        elif op == "snapshot":
            return wire.snapshot(h.snapshot_state())
        elif op == "restore":
            h.restore_state(wire.to_snapshot(msg["snapshot"]), Pull(msg["uid"]))
        elif op == "step":
            return [wire.event(e) for e in h.step()]
        elif op == "pause":
            h.pause()
        elif op == "paused":
            return h.paused()
        elif op == "resume":
            h.resume()
        else:
            raise ValueError(f"unknown operation {op!r}")
        return None
