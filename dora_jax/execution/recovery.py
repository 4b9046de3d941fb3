"""Failed rollout groups of this process (docs/reliability.md, "A rollout group that fails"):
host copies of each group's requests, the recovery of a failed group's requests and the rebuild
of its engine; a component of :class:`~dora_jax.execution.backend.EngineBackend`.

A group's engine that raises is *dead*: every request it held leaves it, to continue on a group
of its own version from, best first, a host copy of its KV (``"kv"``: nothing prefilled again),
its tokens so far (``"tokens"``: re-prefilled under the same version) or its prompt
(``"prompt"``: same sampling key, so the same tokens); the backend hands them to the control
plane as ``StepEvents.recovered``. The group is then *restarting* (a new engine on its devices
with the version it held) and *healthy* again (``StepEvents.health``). On the wall clock the
commands its worker never carried out are read back: requests it was to send elsewhere return to
it, and those it was to take in keep their KV copies or records as sources.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from dora_jax.execution import commands as c
from dora_jax.execution.books import Books
from dora_jax.execution.group import Place
from dora_jax.execution.payloads import PromptPayload
from dora_jax.orchestrator.backend import (
    HOST_LEAVING,
    BackendError,
    HealthChange,
    PartialRequest,
)
from dora_jax.rollout import Engine, Request
from dora_jax.rollout.moves import EngineSnapshot, Handover, split_parked
from dora_jax.rollout.requests import ExportedRequests

HANDOVER_S = 30.0  # a leaving host's groups: bound on their pause and on their host copy


class Groups(Protocol):
    """What recovery needs of the engine backend: its groups' transports and hosts, the trainer's
    versions, and the backend's own steps for a request (a new one, a finished one) and for a
    group (a new engine)."""

    handles: list[Any]  # a transport per group
    hosts: list[int]  # each group's process
    loads: list[Future]  # each group's latest weight load
    me: int  # this process
    cluster: Any  # multi-process runs: the link to the other processes (else None)
    place: Place  # where moves hand their KV over
    published: int
    trainer_params: Callable[[int], Any]

    def send(self, group: int, cmd: c.GroupCommand) -> Future: ...
    def trainer_source(self, group: int, version: int, params: Any) -> dict: ...
    def new_request(self, rid: int, version: int, prompt: PromptPayload) -> Request: ...
    def finish(self, f: Any, reason: str) -> Any: ...
    def forget_conversation(self, rid: int) -> None: ...
    def rebuild(self, group: int) -> None: ...


class GroupRecovery:
    """Host copies, recovery and rebuild of the failed groups of one engine backend, and the
    groups of rollout hosts that die (or leave on a SIGTERM, handing their requests over) and
    are started again. It owns its state (host copies, each group's health, lost and returning
    hosts, counters); it shares the control plane's :class:`~dora_jax.execution.books.Books`
    with the backend and reaches the groups through :class:`Groups`, the backend's public
    surface."""

    def __init__(self, groups: Groups, books: Books, rollout_cfg: Any):
        self.groups, self.books = groups, books
        n = len(books.versions)
        # host copies of each group's requests every ``backup_every`` of its engine steps (the
        # latest one taken, and one asked for on the wall clock), engine steps since its last
        # copy, rebuilds per group, requests recovered by source (and each recovered id's
        # source), and the recovered requests and health changes for the next step()'s events
        self.backup_every = rollout_cfg.backup_every_steps
        self.max_restarts = rollout_cfg.max_group_restarts
        self._backups: dict[int, EngineSnapshot] = {}
        self._backup_asked: dict[int, Future] = {}
        self._since_backup = [0] * n
        self.restarts = [0] * n
        self.recoveries: Counter = Counter()
        self.recovered_ids: dict[int, str] = {}
        self.recovered: list[PartialRequest] = []
        self._health: list[HealthChange] = []
        # rollout hosts that die and come back: each group's health (not "healthy": out of
        # groups()), hosts whose loss was handled, hosts building their engines again, migrations
        # whose KV comes from another process (ticket -> its process, the ids, the receiver), and
        # host losses per group
        self._state = ["healthy"] * n
        self._lost_hosts: set[int] = set()
        self._rejoining: dict[int, Future] = {}
        self._in_transit: dict[int, tuple[int, list[int], int]] = {}
        self.host_losses = [0] * n  # (its process died)
        self.host_leaves = [0] * n  # (its process was asked to stop and handed its requests over)
        self._leaving: set[int] = set()  # hosts that handed their requests over, not yet gone
        # versions that only groups out of the run held when those groups came back with the
        # newest one: their recovered requests still need them (from the trainer), until a
        # group in the run holds them again
        self.orphaned: set[int] = set()

    def take_events(self) -> tuple[tuple[PartialRequest, ...], tuple[HealthChange, ...]]:
        """The requests recovered and the health changes since the last call."""
        out = tuple(self.recovered), tuple(self._health)
        self.recovered, self._health = [], []
        return out

    def stepped(self, g: int) -> None:
        """Group ``g`` took an engine step (prefill or decode): one more since its host copy."""
        self._since_backup[g] += 1

    def out_of_run(self) -> dict[int, str]:
        """Each group out of the run and its state: ``dead`` (its process gone, or its engine
        failed for good), ``restarting`` (its process is back, building its engine), ``stale``
        (loading a version before it takes work)."""
        return {g: self._state[g] for g in range(len(self.groups.handles)) if self.gone(g)}

    def lost_hosts(self) -> list[int]:
        """The processes whose rollout groups are gone with them (not yet started again)."""
        link = self.groups.cluster.link if self.groups.cluster is not None else None
        return sorted(link.lost) if link is not None else []

    def versions_held(self) -> set[int]:
        """Every version a group holds, groups out of the run included, and the versions only
        lost groups held before they came back (the versions their recovered requests need:
        the trainer keeps them)."""
        return set(self.books.versions) | self.orphaned

    def sendable_versions(self) -> frozenset[int]:
        """Versions older than the newest that the trainer may send (only groups out of the run
        held them: their recovered requests need a group of that version)."""
        live = {self.books.versions[g] for g in range(len(self.groups.handles)) if not self.gone(g)}
        gone = {self.books.versions[g] for g in range(len(self.groups.handles)) if self.gone(g)}
        self.orphaned -= live  # (held in the run again: a group of that version serves them)
        return frozenset((gone | self.orphaned) - live - {self.groups.published})

    # -- rollout hosts that die and come back (multi-process runs) ---------------------------------
    def gone(self, g: int) -> bool:
        """Whether group ``g`` is out of the run (its process died, left, or is rejoining)."""
        link = self.groups.cluster.link if self.groups.cluster is not None else None
        return self._state[g] != "healthy" or (
            link is not None and self.groups.hosts[g] in link.lost
        )

    def _set_state(self, g: int, state: str, why: str) -> None:
        self._state[g] = state
        self._health.append(HealthChange(g, state, why))

    def hosts_changed(self) -> None:
        """Groups of a rollout host that died are dead: their requests are recovered from their
        prompts (what a lost host held is gone with it). A host started again builds its
        engines (*restarting*), loads the newest version from the trainer (*stale*), and its
        groups take work again once it is loaded (*healthy*)."""
        link = self.groups.cluster.link if self.groups.cluster is not None else None
        if link is None:
            return
        for host, why in link.take_leaving().items():
            if host not in link.lost and host not in self._lost_hosts | self._leaving:
                self._hand_over(host, why)
        # (a return takes its process out of link.lost: one that is there with a return waiting
        # was lost after it came back, and is handled after the return)
        joined = Counter(link.take_joined())
        for host, why in list(link.lost.items()):
            if host not in self._lost_hosts and host not in joined:
                self._host_lost(host, why)
        for host, joins in joined.items():
            # every return follows a loss: those not seen fell between two rounds
            unseen = joins - (host in self._lost_hosts)
            for _ in range(unseen):
                self._host_lost(host, "it was lost and started again since the last round")
            self._lost_hosts.discard(host)
            for g in self._groups_of(host):
                self._set_state(g, "restarting", f"process {host} is back: building its engines")
            if host in link.lost:  # (lost again since it came back: nothing to build)
                self._host_lost(host, link.lost[host])
            else:  # (one build for its newest process, however often it came back)
                self._rejoining[host] = self.groups.cluster.start_host(host)
        for host, fut in list(self._rejoining.items()):
            if fut.done():
                del self._rejoining[host]
                self._rejoined(host, fut.exception())
        for g, state in enumerate(self._state):
            if (
                state == "stale"
                and self.groups.loads[g].done()
                and self.groups.hosts[g] not in link.lost
            ):
                if self.groups.loads[g].exception() is None:
                    self._set_state(g, "healthy", f"v{self.books.versions[g]} loaded")
                else:
                    self._set_state(
                        g, "dead", f"its load failed: {self.groups.loads[g].exception()}"
                    )

    def _host_lost(self, host: int, why: str) -> None:
        """``host`` died: its groups are dead, what they held goes on elsewhere (unless it handed
        it over first), and so do the migrations whose KV it was still to serve."""
        self._lost_hosts.add(host)
        self._rejoining.pop(host, None)
        if host in self._leaving:  # (its groups were handed over already)
            self._leaving.discard(host)
        else:
            for g in self._groups_of(host):
                self._lose_group(g, f"process {host} is gone: {why}")
        for ticket in [t for t, x in self._in_transit.items() if x[0] == host]:
            self._lost_in_transit(ticket, f"process {host} is gone: {why}")

    def _rejoined(self, host: int, error: BaseException | None) -> None:
        """``host`` built its engines (or failed to: its groups stay out): each loads the
        newest version from the trainer before it takes work."""
        v = self.groups.published
        for g in self._groups_of(host):
            if error is not None:
                self._set_state(g, "dead", f"process {host} could not build its engines: {error}")
                continue
            self.orphan(g)
            self.books.versions[g] = v
            src = self.groups.trainer_source(g, v, self.groups.trainer_params(v))
            self.groups.loads[g] = self.groups.send(g, c.Load(g, v, **src))
            self._set_state(g, "stale", f"loading v{v}")

    def orphan(self, g: int) -> None:
        """Group ``g``, out of the run, is about to hold the newest version: if no group in the
        run holds the one it held, that version stays needed (its recovered requests)."""
        v = self.books.versions[g]
        others = [h for h in range(len(self.groups.handles)) if h != g]
        if v != self.groups.published and all(
            self.gone(h) or self.books.versions[h] != v for h in others
        ):
            self.orphaned.add(v)

    def _hand_over(self, host: int, why: str) -> None:
        """``host`` is leaving (a SIGTERM, as before a preemption): its groups leave the run
        (the planner sends them nothing more), stop stepping, and send a host copy of what they
        hold; every request in the copy goes on elsewhere from it (KV: nothing prefilled again;
        queued: from its prompt), and the host is let go. A request not in the copy finished
        before the pause: its report is on its way (``step`` still takes it). Without a copy
        (the host died meanwhile) the requests go on from their prompts. Its loss, when its
        process ends, is then nothing more to recover."""
        self._leaving.add(host)
        mine = [g for g in self._groups_of(host) if self._state[g] == "healthy"]
        for g in mine:
            self.host_leaves[g] += 1
            self._set_state(g, "dead", f"process {host} {HOST_LEAVING}{why}): handing over")
        paused = [self.groups.send(g, c.Pause(g)) for g in mine]  # (at once on one thread)
        self.groups.cluster.flush()
        for g, fut in zip(mine, paused, strict=True):
            kv: dict[int, ExportedRequests] = {}
            tokens: dict[int, Request] = {}
            try:
                fut.result(HANDOVER_S)
                snap = self.groups.send(g, c.Snapshot(g)).result(HANDOVER_S)
            except Exception:  # noqa: BLE001 - gone meanwhile: its requests from their prompts
                held = set(self.books.members[g])
            else:
                kv, tokens = _sources(snap)
                held = {*kv, *(r.id for r in snap.pending)}
            for rid in [r for r in self.books.members[g] if r in held]:
                self.books.leave(rid)
                self.recovered.append(self._recover(rid, self.books.versions[g], kv, {}, tokens))
        self.groups.cluster.link.let_go(host)

    def finished_before_leaving(self, e: Any) -> list:
        """Wall clock, the report of a group out of the run: its requests were recovered, all
        but those that finished before its host's handover paused it, which are still its own."""
        return [
            self.groups.finish(f, f.finish_reason)
            for f in e.finished
            if self.books.where.get(f.id) == e.group
        ]

    def _groups_of(self, host: int) -> list[int]:
        return [g for g in range(len(self.groups.handles)) if self.groups.hosts[g] == host]

    def _lose_group(self, g: int, why: str) -> None:
        """Group ``g``'s process died: every request it held goes on elsewhere, from its prompt
        under its own version; the group is out of the run until its process is back."""
        self.host_losses[g] += 1
        self._set_state(g, "dead", why)
        self._backups.pop(g, None)
        self._backup_asked.pop(g, None)
        self._since_backup[g] = 0
        for rid in list(self.books.members[g]):
            self.books.leave(rid)
            self.restart(rid, self.books.versions[g])

    def track_transit(self, ticket: int, src_host: int, ids: list[int], dst: int, fut) -> None:
        """A migration whose KV comes from another process: if that process dies before it
        served the KV, the requests are recovered (:meth:`_lost_in_transit`)."""
        self._in_transit[ticket] = (src_host, list(ids), dst)

        def over(_f) -> None:
            if self._in_transit.pop(ticket, None) is not None:
                self.groups.cluster.transfers.forget(ticket)

        fut.add_done_callback(over)

    def _lost_in_transit(self, ticket: int, why: str) -> None:
        """The source of migration ``ticket`` died: if it never served the KV (the receiver
        gets an error instead, and takes nothing), its requests are recovered from their
        prompts; if it did, the receiver has them."""
        moving = self._in_transit.pop(ticket, None)  # (None: it arrived meanwhile)
        if moving is None or not self.groups.cluster.transfers.fail_unless_served(ticket, why):
            return
        _, ids, dst = moving
        for rid in ids:
            if self.books.where.get(rid) == dst:
                self.books.leave(rid)
                self.restart(rid, self.books.versions[dst])

    def restart(self, rid: int, version: int) -> None:
        """Request ``rid`` (out of every group) goes on from its prompt under ``version``: a
        recovered request of the next step()'s events."""
        self.recovered.append(self._recover(rid, version, {}, {}, {}))

    def take_backups(self) -> None:
        """Ask each group of this process that has taken ``backup_every`` engine steps since its
        last host copy for a new one, before the engines step (logical clock: taken now, with
        what this round admitted and moved in; wall clock: when its worker gets to it, the
        previous copy serving until then)."""
        if not self.backup_every:
            return
        for g, fut in list(self._backup_asked.items()):
            if fut.done():
                del self._backup_asked[g]
                if fut.exception() is None:
                    self._backups[g] = fut.result()
        for g in range(len(self.groups.handles)):
            if self.groups.hosts[g] != self.groups.me or g in self._backup_asked:
                continue
            if not self.books.members[g]:
                self._backups.pop(g, None)
                self._since_backup[g] = 0
            elif self._since_backup[g] >= self.backup_every:
                self._since_backup[g] = 0
                fut = self.groups.send(g, c.Snapshot(g))
                if fut.done() and fut.exception() is None:
                    self._backups[g] = fut.result()
                else:
                    self._backup_asked[g] = fut

    def backup_due(self, g: int) -> None:
        """``g`` took in requests with KV: its next host copy is taken before it steps again."""
        if self.backup_every:
            self._since_backup[g] = max(self._since_backup[g], self.backup_every)

    def engine_failed(self, g: int, error: str) -> None:
        """Group ``g``'s engine failed: every request it held leaves it, to continue on a group
        of its version from, best first, a host copy of its KV, its tokens so far, or its prompt
        (the next step()'s ``recovered``); the engine is rebuilt on the group's devices with the
        version the group held, and the group takes requests again."""
        self.restarts[g] += 1
        reason = error.strip().splitlines()[-1] if error.strip() else "unknown error"
        if self.restarts[g] > self.max_restarts:
            raise BackendError(
                f"rollout group {g}'s engine failed {self.restarts[g]} times "
                f"(rollout.max_group_restarts: {self.max_restarts}); the last error:\n{error}"
            )
        self._health.append(HealthChange(g, "dead", reason))
        old = self.groups.handles[g]
        kv, tokens = self._unapplied(g, old)
        snap = self._backups.pop(g, None)
        self._backup_asked.pop(g, None)
        self._since_backup[g] = 0
        if snap is not None:  # (what the unapplied commands held comes first)
            kv_copy, tokens_copy = _sources(snap)
            kv, tokens = kv_copy | kv, tokens_copy | tokens
        salvaged = _host_records(old.worker.engine)
        ids = list(self.books.members[g])
        version = self.books.versions[g]
        for rid in ids:
            self.books.leave(rid)
            self.recovered.append(self._recover(rid, version, kv, salvaged, tokens))
        old.stop(1.0)
        old.worker.engine.cache = None  # (its device memory, before the new engine takes its own)
        self._health.append(HealthChange(g, "restarting", f"rebuilding its engine ({reason})"))
        self.groups.rebuild(g)
        self._health.append(
            HealthChange(g, "healthy", f"engine rebuilt, v{self.books.versions[g]}")
        )

    def _recover(
        self,
        rid: int,
        version: int,
        kv: dict[int, ExportedRequests],
        salvaged: dict[int, Request],
        tokens: dict[int, Request],
    ) -> PartialRequest:
        """Request ``rid`` of a failed group, to resubmit under ``version``: from a host copy
        of its KV, else its tokens so far (the failed engine's host record, else the copy's),
        else its prompt. A conversation starts a new episode from its prompt."""
        pg, prompt, versions = self.books.meta[rid]
        conversation = prompt.conversation is not None
        if conversation:
            self.groups.forget_conversation(rid)
        payload: Any = None
        if not conversation and rid in kv:
            source, payload = "kv", kv[rid]
            generated = len(payload.requests[0].tokens)
        else:
            records = [] if conversation else [salvaged.get(rid), tokens.get(rid)]
            usable = [x for x in records if x and x.tokens and len(x.tokens) == len(x.logprobs)]
            if usable:  # the one furthest on
                source, payload = "tokens", copy.deepcopy(max(usable, key=lambda x: len(x.tokens)))
                payload.kv_len = 0
            else:
                source, payload = "prompt", self.groups.new_request(rid, version, prompt)
            generated = len(payload.tokens)
        self.recoveries[source] += 1
        self.recovered_ids[rid] = source
        return PartialRequest(
            rid, pg, len(prompt.tokens), generated, tuple(versions), payload, source
        )

    def _unapplied(self, g: int, handle: Any) -> tuple[dict, dict]:
        """Wall clock: the commands the failed worker never carried out. Requests it was to send
        to another group come back to it (the receiver gets an empty handover); requests it was
        to take in by KV copy or resubmission keep those as their recovery sources."""
        kv: dict[int, ExportedRequests] = {}
        tokens: dict[int, Request] = {}
        for cmd in handle.unapplied() if hasattr(handle, "unapplied") else []:
            if isinstance(cmd, c.SendRequests):
                for rid in cmd.ids:
                    if rid in self.books.where:
                        self.books.leave(rid)
                        self.books.join(rid, g)
                if not cmd.remote:
                    self.groups.place.handoffs.slot(cmd.ticket).set_result(Handover(None, [], []))
            elif isinstance(cmd, c.ReceiveRequests) and not cmd.remote:
                slot = self.groups.place.handoffs.slot(cmd.ticket)  # packed by now: its KV to host
                if slot.done() and slot.exception() is None:
                    running = self.groups.place.handoffs.take(cmd.ticket, 0).running
                    if running is not None:
                        running.kv = np.asarray(running.kv)
                        kv.update((x.requests[0].id, x) for x in split_parked(running))
            elif isinstance(cmd, c.Import):
                kv.update((x.requests[0].id, x) for x in cmd.parts)
            elif isinstance(cmd, c.Submit):
                tokens.update((r.id, r) for r in cmd.requests if r.tokens)
        return kv, tokens


def _sources(snap: EngineSnapshot) -> tuple[dict[int, ExportedRequests], dict[int, Request]]:
    """A host copy's recovery sources: each request with KV (running or parked) by id, and
    each without KV that has tokens so far."""
    parts = split_parked(snap.running) if snap.running.requests else []
    kv = {x.requests[0].id: x for x in [*parts, *snap.parked]}
    return kv, {r.id: r for r in snap.pending if r.tokens}


def _host_records(engine: Engine) -> dict[int, Request]:
    """The request records a failed engine holds on the host (tokens and logprobs so far), or
    none where they cannot be read."""
    try:
        held = [*engine._device_requests(), *engine._without_kv()]
        held += [r for p in engine.parked for r in p.requests]
        return {r.id: r for r in held}
    except Exception:  # noqa: BLE001 - a broken engine: its requests recover from elsewhere
        return {}
