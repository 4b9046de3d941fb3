"""Group commands across processes: the transport to a group on another process
(:class:`RemoteTransport`, on process 0) and the process that runs it (:class:`GroupHost`).

Process 0 runs the control plane, the trainer and the groups on its own devices; a group on
another process gets a :class:`RemoteTransport`, which has the two calls of the local transports
(``send(command) -> future``, ``status``). Each command becomes a message on the ordered channel
to that process (``channel.py``), written by the record codec (``codec.py``); the host hands it to
the group's local transport, which keeps the local semantics: on the wall clock a worker thread
per group, whose events come back as ``events`` messages (stamped in seconds since the epoch,
turned into the run's clock on arrival) with the number of commands each group has applied (which
completes their futures here); on the logical clock every command is carried out before its
reply, so a multi-process logical run makes the same decisions as a single-process one.

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
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import jax

from dora_jax.distributed.channel import Channel
from dora_jax.distributed.transfers import Transfers
from dora_jax.execution.commands import GroupCommand, GroupEvent, GroupStatus
from dora_jax.execution.group import GroupWorker, Place
from dora_jax.execution.transport import GroupDead, done, transport_for
from dora_jax.orchestrator.clock import Bus

WAIT_S = 600.0


class RemoteError(RuntimeError):
    """An error raised in another process (its type and message)."""


class HostLink:
    """Process 0's end of the channels to every other process: messages with replies, the events
    they report, and the params staged for them."""

    def __init__(
        self,
        channel: Channel,
        transfers: Transfers,
        hosts: list[int],
        post,
        now,
        stage_shardings: Callable[[], Any],
    ):
        self.channel, self.transfers, self.post, self.now = channel, transfers, post, now
        self.stage_shardings = stage_shardings  # the group layout on process 0's devices
        self.groups: dict[int, RemoteTransport] = {}
        self._replies: dict[int, tuple[int, Future]] = {}  # reply id -> (host, its future)
        # rollout hosts that died (and why), and those started again since, for the backend
        self.lost: dict[int, str] = {}
        self.joined: list[int] = []
        self.leaving: dict[int, str] = {}  # hosts that said they are about to leave (and why)
        self.left: dict[int, str] = {}  # the same, kept until the host is started again
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._staged: dict[int, Future] = {}  # version -> its params staged for pulls
        self._outbox: dict[int, list[dict]] = {h: [] for h in hosts}  # not yet sent
        for h in hosts:
            channel.listen(h, lambda msg, h=h: self._on_message(h, msg))

    def request(self, host: int, msg: dict, wait: bool) -> Future:
        """Send ``msg`` to ``host``. Messages that need no reply wait in an outbox, sent as one
        message by :meth:`flush` (once per control round), in order; one that needs a reply
        flushes first, and its future is the reply's value."""
        if host in self.lost:  # (nothing reaches it: its groups are recovered elsewhere)
            return _gone(host, self.lost[host])
        if not wait:
            with self._lock:
                self._outbox[host].append(msg)
            return done()
        self.flush(host)
        fut: Future = Future()
        rid = next(self._ids)
        with self._lock:
            self._replies[rid] = (host, fut)
        self.channel.send(host, msg | {"reply": rid})
        return fut

    def host_lost(self, host: int, why: str) -> None:
        """``host`` died: every reply it owes fails (:class:`GroupDead`), so do its groups'
        commands from now on, and the control plane is woken to recover their requests."""
        with self._lock:
            self.lost[host] = why
            self._outbox[host] = []
            owed = [rid for rid, (h, _) in self._replies.items() if h == host]
            futures = [self._replies.pop(rid)[1] for rid in owed]
        for fut in futures:
            fut.set_exception(_dead(host, why))
        for t in list(self.groups.values()):
            if t.host == host:
                t.lose(why)
        self.post(None)

    def host_joined(self, host: int, token: str) -> None:
        """``host`` was started again (join token ``token``): messages go to the new process;
        the backend builds its groups (:attr:`joined`)."""
        self.channel.reconnect(host, token)
        self.channel.listen(host, lambda msg, h=host: self._on_message(h, msg))
        with self._lock:
            self.lost.pop(host, None)
            self.left.pop(host, None)
            self._outbox[host] = []
            self.joined.append(host)
        for t in list(self.groups.values()):
            if t.host == host:
                t.revive()
        self.post(None)

    def take_joined(self) -> list[int]:
        with self._lock:
            out, self.joined = self.joined, []
        return out

    def take_leaving(self) -> dict[int, str]:
        """Hosts that said they are leaving (a SIGTERM) since the last call, and why."""
        with self._lock:
            out, self.leaving = self.leaving, {}
        return out

    def let_go(self, host: int) -> None:
        """Tell a leaving ``host`` that its requests were handed over: it may exit."""
        if host not in self.lost:
            self.flush(host)
            self.channel.send(host, {"op": "leave"})

    def flush(self, host: int | None = None) -> None:
        for h in [host] if host is not None else list(self._outbox):
            with self._lock:
                items, self._outbox[h] = self._outbox[h], []
            if items:
                self.channel.send(
                    h, items[0] if len(items) == 1 else {"op": "batch", "items": items}
                )

    def stage_trainer(self, params: Any, version: int) -> int:
        """Offer the trainer's ``params`` of ``version`` in the group layout under a new ticket
        (placed once per version, on a helper thread; the load goes out at once, in order)."""
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
        return uid

    def _on_message(self, host: int, msg: dict) -> None:
        op = msg["op"]
        offset = time.time() - self.now()  # host stamps are epoch seconds
        for g, (st, applied) in msg.get("groups", {}).items():
            if g in self.groups:  # (transports are made one by one at the start)
                self.groups[g].report(st, applied)
        if op == "reply":
            with self._lock:
                _, fut = self._replies.pop(msg["reply"], (host, None))
            if fut is None:  # (failed already: its host was taken for dead)
                return
            if msg.get("error"):
                fut.set_exception(RemoteError(f"on process {host}: {msg['error']}"))
            else:
                fut.set_result(msg.get("value"))
        elif op == "events":
            for e in msg["items"]:
                self.post(shift(e, offset, host))
        elif op == "leaving":
            with self._lock:
                self.leaving[host] = msg.get("why", "it is leaving")
                self.left[host] = self.leaving[host]
            self.post(None)


def _dead(host: int, why: str) -> GroupDead:
    return GroupDead(f"process {host} is gone: {why}")


def _gone(host: int, why: str) -> Future:
    """A call's future that failed at once: its process is gone."""
    fut: Future = Future()
    fut.set_exception(_dead(host, why))
    return fut


def shift(e: GroupEvent, offset: float, host: int) -> GroupEvent:
    """An event of ``host`` on process 0's clock (and its error named as another process's)."""
    err = None if e.error is None else f"on process {host}: {e.error}"
    span = None if e.span is None else e.span._replace(t0=e.span.t0 - offset, t1=e.span.t1 - offset)
    return dataclasses.replace(e, span=span, error=err)


class RemoteTransport:
    """The transport to group ``group`` on process ``host``: ``sync`` (logical clock) waits for
    each command's reply; otherwise a command's future completes when the host reports it
    applied (a command that ``replies`` waits for its value)."""

    def __init__(self, group: int, host: int, link: HostLink, sync: bool, pages_total: int):
        self.group, self.host, self.link, self.sync = group, host, link, sync
        self.status = GroupStatus({}, 0, pages_total)
        self._sent = 0  # commands sent so far
        self._pending: deque[tuple[int, Future]] = deque()  # (number, future) not yet applied
        self._lock = threading.Lock()
        self.dead: str | None = None  # why its process is gone (None: it is there)
        link.groups[group] = self

    def send(self, cmd: GroupCommand) -> Future:
        wait = self.sync or cmd.replies
        if self.dead is not None:
            return _gone(self.host, self.dead)
        with self._lock:
            self._sent += 1
            n = self._sent
            fut: Future = Future()
            if not wait:
                self._pending.append((n, fut))
        reply = self.link.request(self.host, {"op": "cmd", "cmd": cmd, "n": n}, wait)
        if not wait:
            return fut
        if self.sync:  # the logical clock: carried out before the reply
            try:
                return done(reply.result(WAIT_S))
            except GroupDead:  # (its process died meanwhile: the future says so)
                return reply
        return reply

    def lose(self, why: str) -> None:
        """Its process died: every command not yet applied fails, and so does every later one
        (until :meth:`revive`)."""
        with self._lock:
            self.dead = why
            pending, self._pending = list(self._pending), deque()
        for _, fut in pending:
            fut.set_exception(_dead(self.host, why))

    def revive(self) -> None:
        """Its process was started again: commands are numbered from 0 for the new process."""
        with self._lock:
            self.dead, self._sent, self._pending = None, 0, deque()
            self.status = GroupStatus({}, 0, self.status.pages_total)

    def report(self, status: GroupStatus, applied: int) -> None:
        self.status = status
        with self._lock:
            while self._pending and self._pending[0][0] <= applied:
                self._pending.popleft()[1].set_result(None)

    def stop(self, timeout: float = 10.0) -> None:
        """Nothing: the host stops all its groups at shutdown (``Cluster.stop_hosts``)."""


class GroupHost:
    """Runs this process's groups for process 0 (every process but 0)."""

    def __init__(self, channel: Channel, transfers: Transfers, engines: dict, clock: Any):
        self.channel, self.transfers = channel, transfers
        self.bus = Bus()
        self.stopped = threading.Event()
        now = time.time  # epoch seconds: process 0 puts them on its own clock
        place = Place(transfers)
        workers = {g: GroupWorker(g, e, now, place) for g, e in engines.items()}
        transport = transport_for(clock)
        self.transports = {g: transport(w, self.bus.post) for g, w in workers.items()}
        self._applied = dict.fromkeys(engines, 0)
        # the workers' events go to process 0 as they come (a sync transport posts none)
        threading.Thread(target=self._forward, name="forward", daemon=True).start()

    def _groups(self) -> dict:
        return {g: (t.status, self._applied[g]) for g, t in self.transports.items()}

    def _forward(self) -> None:
        """Send the groups' events as they come (and how many commands each has applied); a
        sync transport (the logical clock) posts none: its events go with each reply."""
        while not self.stopped.is_set():
            items = self.bus.collect(0.05)
            if items:
                time.sleep(0.002)  # let a few more arrive: fewer, larger messages
                items += self.bus.collect(0)
                events = [e for e in items if isinstance(e, GroupEvent)]
                self.channel.send(0, {"op": "events", "items": events, "groups": self._groups()})

    def handle(self, msg: dict) -> None:
        """Apply one message from process 0 (on the channel's thread, in order)."""
        if msg["op"] == "batch":
            for item in msg["items"]:
                self.handle(item)
            return
        cmd, n, rid = msg["cmd"], msg["n"], msg.get("reply")
        try:
            fut = self.transports[cmd.group].send(cmd)
        except BaseException as e:  # noqa: BLE001 - (inline) reported to process 0 with the reply
            fut = Future()
            fut.set_exception(e)
        fut.add_done_callback(lambda f: self._applied_one(cmd.group, n, rid, f))

    def _applied_one(self, group: int, n: int, rid: int | None, fut: Future) -> None:
        self._applied[group] = n
        err = fut.exception()
        if rid is not None:
            reply = {"op": "reply", "reply": rid, "groups": self._groups()}
            if err is not None:
                reply["error"] = f"{type(err).__name__}: {err}"
            else:
                reply["value"] = fut.result()
            self.channel.send(0, reply)
        else:
            self.bus.post(None)  # the forward loop reports it applied
