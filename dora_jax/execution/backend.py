"""The real :class:`~dora_jax.orchestrator.backend.RolloutBackend`: one engine per group submesh.

The control plane's view (which group holds which request, at which version) is kept here and
changes the moment the control plane decides; the engines catch up through their handles
(:mod:`dora_jax.execution.group`):

- on the **logical** clock every call is carried out before it returns and :meth:`step` advances
  every engine by one step, in group order (deterministic);
- on the **wall** clock every engine runs on its own worker thread; calls are queued to it,
  :meth:`step` returns what the workers reported since the last call (waiting a bounded time for
  the first report), weight loads and KV moves stall only the groups they involve, and
  :meth:`pause` quiesces every worker (checkpoints, evaluation).

Weights move trainer -> group by ``jax.device_put`` into the group's rollout shardings, and group
-> group between meshes of identical shape and PartitionSpecs (shard to shard). A migration packs
the requests' KV pages on the source mesh, copies the buffer to the destination mesh and unpacks
it there: no request is prefilled twice.

Multi-turn conversations (a :class:`~dora_jax.execution.turns.TurnDriver`, ``turns``): a request
whose payload carries a conversation runs as one; each model turn it ends goes to the driver
(its environment answers off the control loop), the answer comes back as an ``extend`` of the
request on whichever group holds it then, or as its end, which makes it a finished request
(reward, loss mask and figures in its :class:`Completion`). While it waits the request holds its
KV and pins its version, but no decode slot (``GroupInfo.waiting``). On the logical clock an
environment call takes one tick: the answers to the turns that ended in a tick are applied at
the end of the next (waiting for them) and fed the tick after, so a run with a deterministic
environment is reproducible; on the wall clock each answer is applied when it comes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from jax.sharding import Mesh

from dora_jax import faults
from dora_jax.config import ModelConfig, RolloutConfig
from dora_jax.execution import commands as c
from dora_jax.execution.books import Books
from dora_jax.execution.commands import GroupEvent
from dora_jax.execution.group import GroupWorker, Place, error_text
from dora_jax.execution.payloads import Completion, PromptPayload
from dora_jax.execution.recovery import GroupRecovery
from dora_jax.execution.transport import GroupDead, done, transport_for
from dora_jax.execution.turns import TurnDriver, TurnOutcome
from dora_jax.model.params import Params
from dora_jax.orchestrator.backend import (
    TRAINER,
    BackendError,
    FinishedRequest,
    GroupInfo,
    GroupTick,
    PartialRequest,
    RequestSpec,
    Source,
    StepEvents,
    check_migrate,
    check_set_version,
)
from dora_jax.orchestrator.clock import Bus, LogicalClock, WallClock
from dora_jax.rollout import Engine, EngineFinished, Request, request_key

WAIT_S = 600.0  # the longest wait for a group's answer (a snapshot, an interrupt, a step)


@dataclass
class Overheads:
    """Seconds spent moving data for the control plane (weight loads, KV packing/unpacking)."""

    weight_transfer_s: float = 0.0
    weight_transfers: int = 0
    migration_s: float = 0.0
    migrated_requests: int = 0
    log: list[tuple[str, int, float, float]] = field(default_factory=list)  # kind, group, t0, s


class EngineBackend:
    """Groups = engines on ``meshes``; version 0 (``initial_params``) is loaded everywhere.

    ``eos_id``: one id or several (any of them ends a response; the engines add
    ``rollout.extra_eos_ids``). ``initial_params`` should be the trainer's export of version 0
    (``GRPOTrainer.params_for(0)``), not a separate copy: an engine on the trainer's devices with
    the same layout then aliases it instead of holding a second version 0.

    ``clock``: a :class:`LogicalClock` (default) or a :class:`WallClock` (worker threads; call
    :meth:`close` when done). ``trainer_params(version)`` returns the trainer's export of a
    published version.
    """

    WAIT_S = 0.05  # wall clock: longest wait of one step() for the first report

    def __init__(
        self,
        model_cfg: ModelConfig,
        rollout_cfg: RolloutConfig,
        meshes: Sequence[Mesh],
        eos_id: int | Sequence[int],
        initial_params: Params,
        trainer_params: Callable[[int], Params],
        *,
        seed: int,
        clock: LogicalClock | WallClock | None = None,
        bus: Bus | None = None,
        max_new_tokens: int | None = None,
        interpret: bool | None = None,
        cluster: Any = None,
        turns: TurnDriver | None = None,
    ):
        self.clock = clock or LogicalClock()
        self.transport = transport_for(self.clock)  # (Inline: every call carried out at once)
        self.bus = bus or Bus()
        self.cluster = cluster  # multi-process: groups on other processes get remote transports
        self.me = cluster.index if cluster is not None else 0
        place = Place(cluster.transfers if cluster is not None else None)
        # what rebuilding a failed group's engine on its devices needs
        self.place, self._meshes = place, list(meshes)
        self._build = (model_cfg, rollout_cfg, eos_id, interpret)
        self._new_ticket = cluster.transfers.new_id if cluster else itertools.count(1).__next__
        self.handles: list[Any] = []  # a transport per group
        self.hosts: list[int] = []
        self.loads: list[Future] = []  # each group's latest weight load
        for g, m in enumerate(meshes):
            host = cluster.owner(m, f"rollout group {g}") if cluster is not None else 0
            self.hosts.append(host)
            if host != self.me:
                self.handles.append(
                    cluster.remote(g, host, self.transport.sync, rollout_cfg.num_pages - 1)
                )
                src = self.trainer_source(g, 0, initial_params)
                self.loads.append(self.send(g, c.Load(g, 0, **src)))
                continue
            e = Engine(model_cfg, rollout_cfg, m, eos_id, interpret=interpret)
            e.load_params(initial_params, 0)
            w = GroupWorker(g, e, self.clock.now, place)
            self.handles.append(self.transport(w, self.bus.post))
            self.loads.append(done())
        self.seed = seed
        self.max_slots = rollout_cfg.max_slots
        self.tokens_per_slot_tick = rollout_cfg.decode_steps  # for utilisation figures
        self.max_new_tokens = max_new_tokens or rollout_cfg.max_new_tokens
        self.trainer_params = trainer_params
        self.published = 0
        self.overheads = Overheads()
        # told of every finished request as the control plane takes it in (the pipeline starts
        # scoring it at once, off the control loop); must return at once
        self.on_finished: Callable[[int, Completion], None] | None = None
        self._tick = 0
        self.books = Books(len(meshes))  # versions, members, where each request is
        self._held: list[GroupEvent] = []  # reports pulled while pausing, for the next step()
        self._closed = False
        self._paused: list[Future] = []  # the last pause, per group (wall clock)
        # multi-turn conversations: the driver; requests waiting on their environment; each
        # one's last turn-end record; environment turns (and ends) that came while a request was
        # interrupted, applied when it is resubmitted; conversations ended, for the next step()
        self.turns = turns
        # (kept: a waiting step() wakes when an answer comes; with sync transports nobody waits)
        if turns is not None and not self.transport.sync and hasattr(turns, "on_answer"):
            turns.on_answer = lambda: self.bus.post(None)  # step() stops waiting for reports
        self._waiting: set[int] = set()
        self._last_turn: dict[int, EngineFinished] = {}
        self._held_turns: dict[int, list[tuple[int, ...]]] = {}
        self._over: dict[int, TurnOutcome] = {}
        self._ended: list[FinishedRequest] = []
        self.recovery = GroupRecovery(self, self.books, rollout_cfg)  # failed groups

    # -- queries ---------------------------------------------------------------------------------
    def groups(self) -> list[GroupInfo]:
        """The groups in the run (a group whose process died is out until it is back)."""
        return [self._info(g) for g in range(len(self.handles)) if not self.recovery.gone(g)]

    def _info(self, g: int) -> GroupInfo:
        st, ids = self.handles[g].status, tuple(self.books.members[g])
        return GroupInfo(
            group=g,
            version=self.books.versions[g],
            busy_ticks=0 if self.loads[g].done() else 1,
            max_slots=self.max_slots,
            free_slots=self._free_slots(g),
            kv_pages_used=st.pages_used,
            kv_pages_total=st.pages_total,
            requests=ids,
            request_pages=tuple(st.pages.get(r, 0) for r in ids),
            host=self.hosts[g],
            waiting=tuple(r for r in ids if r in self._waiting),
        )

    def _free_slots(self, group: int) -> int:
        """Decode slots left: requests waiting on their environment hold none."""
        members = self.books.members[group]
        busy = len(members) - sum(1 for r in members if r in self._waiting)
        return max(self.max_slots - busy, 0)

    def live_requests(self) -> int:
        return len(self.books.where)

    # -- versions --------------------------------------------------------------------------------
    def publish(self, version: int) -> None:
        if version != self.published + 1:
            raise BackendError(f"published version {version} after {self.published}")
        self.published = version

    def set_version(self, group: int, version: int, source: Source) -> None:
        self._check_group(group)
        if source != TRAINER:
            self._check_group(source)
        if self.recovery.gone(group) or (source != TRAINER and self.recovery.gone(source)):
            return  # (its process died: the next step() takes the group out of the run)
        held, version_of = len(self.books.members[group]), self.books.versions.__getitem__
        more = self.recovery.sendable_versions()  # (older versions only lost groups held)
        if not check_set_version(group, version, source, held, self.published, version_of, more):
            return
        if source == TRAINER:
            src = self.trainer_source(group, version, self.trainer_params(version))
            cmd = c.Load(group, version, **src)
        elif self.hosts[source] == self.hosts[group]:  # (it may still be loading it)
            cmd = c.Load(group, version, peer=source)
        else:
            cmd = c.Load(group, version, ticket=self._new_ticket())
            self.send(source, c.OfferParams(source, cmd.ticket))
        self.books.versions[group] = version
        self.loads[group] = self.send(group, cmd)

    def trainer_source(self, group: int, version: int, params: Params) -> dict:
        """Where ``group`` takes the trainer's ``params``: as they are for a group of this
        process, else staged for the group's process to pull (``Load``/``Restore`` fields)."""
        if self.hosts[group] == self.me:
            return {"params": params}
        return {"ticket": self.cluster.link.stage_trainer(params, version)}

    def send(self, group: int, cmd: c.GroupCommand) -> Future:
        return self.handles[group].send(cmd)

    def sendable_versions(self) -> frozenset[int]:
        """Versions older than the newest that only groups out of the run held."""
        return self.recovery.sendable_versions()

    def rebuild(self, g: int) -> None:
        """A new engine on group ``g``'s devices with the version it held (the newest published
        one if that version's params are no longer kept)."""
        model_cfg, rollout_cfg, eos_id, interpret = self._build
        v = self.books.versions[g]
        try:
            params = self.trainer_params(v)
        except KeyError:
            v = self.books.versions[g] = self.published
            params = self.trainer_params(v)
        e = Engine(model_cfg, rollout_cfg, self._meshes[g], eos_id, interpret=interpret)
        e.load_params(params, v)
        w = GroupWorker(g, e, self.clock.now, self.place)
        self.handles[g] = self.transport(w, self.bus.post)
        self.loads[g] = done()
        if self._paused:  # the others are paused: so is it, until resume()
            self._paused[g] = self.send(g, c.Pause(g))

    # -- requests --------------------------------------------------------------------------------
    def new_request(self, rid: int, version: int, prompt: PromptPayload) -> Request:
        """Request ``rid`` as first submitted (the same sampling key, so the same tokens)."""
        budget = prompt.max_new_tokens or self.max_new_tokens
        r = Request(rid, list(prompt.tokens), version, request_key(self.seed, rid), budget)
        if prompt.conversation is not None:
            if self.turns is None:
                raise BackendError(
                    f"request {rid} is a conversation and the backend has no turn driver"
                )
            r.multi_turn, r.stop_seqs = True, self.turns.stop_sequences
        return r

    def submit(self, group: int, requests: list[RequestSpec]) -> None:
        self._check_group(group)
        free = self._free_slots(group)
        if len(requests) > free:
            raise BackendError(f"{len(requests)} requests, group {group} has {free} free slots")
        reqs, over, imports = [], [], []
        for spec in requests:
            rid = spec.request_id
            if spec.version != self.books.versions[group]:
                raise BackendError(
                    f"request {rid} of version {spec.version} "
                    f"submitted to group {group} of version {self.books.versions[group]}"
                )
            if spec.resume is not None:  # partial rollout (a new version) or recovery (its own)
                if rid not in self.books.meta or rid in self.books.where:
                    raise BackendError(f"request {rid} was not interrupted")
                versions = self.books.meta[rid][2]
                r: Request = spec.resume.payload
                if spec.resume.source == "kv":  # a host copy of its KV: continues from it
                    if spec.version == versions[-1]:
                        imports.append(spec.resume.payload)
                        continue
                    r = spec.resume.payload.requests[0]  # moved on to a newer version (partial
                    r.kv_len = 0  # rollout): its KV is the old version's, it is re-prefilled
                if spec.resume.source == "prompt" and r.multi_turn:  # a new episode
                    self.turns.begin(rid, self.books.meta[rid][1])
                for obs in self._held_turns.pop(r.id, ()):  # its environment answered meanwhile
                    r.append_env_turn(list(obs))
                if r.id in self._over:  # its episode ended meanwhile: it finishes now
                    over.append(r.id)
                    continue
                r.version = spec.version
                if versions[-1] != spec.version:
                    versions.append(spec.version)
            else:
                prompt = spec.payload
                if not isinstance(prompt, PromptPayload):
                    raise BackendError(f"request {rid}: payload must be a PromptPayload")
                if rid in self.books.meta:
                    raise BackendError(f"request {rid} was already submitted")
                r = self.new_request(rid, spec.version, prompt)
                self.books.meta[rid] = (spec.prompt_group, prompt, [spec.version])
                if r.multi_turn:
                    self.turns.begin(rid, prompt)
            reqs.append(r)
        for rid in over:
            self._ended.append(self._conversation_over(rid, self._over.pop(rid)))
        for rid in [r.id for r in reqs] + [x.requests[0].id for x in imports]:
            self.books.join(rid, group)
        if reqs:
            self.send(group, c.Submit(group, tuple(reqs)))
        if imports:
            self.send(group, c.Import(group, tuple(imports)))
            self.recovery.backup_due(group)

    def migrate(self, request_ids: list[int], src: int, dst: int) -> None:
        self._check_group(src)
        self._check_group(dst)
        if self.recovery.gone(src) or self.recovery.gone(dst):
            return  # (a process died since the plan: the next step() recovers its requests)
        check_migrate(
            request_ids,
            src,
            dst,
            self.books.versions.__getitem__,
            self.books.where.get,
            self._free_slots(dst),
        )
        for rid in request_ids:
            self.books.leave(rid)
            self.books.join(rid, dst)
        faults.point("migration")
        self.overheads.migrated_requests += len(request_ids)
        ticket, remote = self._new_ticket(), self.hosts[src] != self.hosts[dst]
        sent = self.send(src, c.SendRequests(src, tuple(request_ids), ticket, remote))
        if sent.done() and isinstance(sent.exception(), GroupDead) and self.recovery.gone(src):
            for rid in request_ids:  # its process died: recovered with the rest of its requests
                self.books.leave(rid)
                self.books.join(rid, src)
            return
        fut = self.send(dst, c.ReceiveRequests(dst, ticket, remote))
        if remote and self.hosts[src] != self.me:
            self.recovery.track_transit(ticket, self.hosts[src], request_ids, dst, fut)
        self.recovery.backup_due(dst)

    def interrupt(self, request_ids: list[int], discard: bool = False) -> list[PartialRequest]:
        by_group: dict[int, list[int]] = {}
        for rid in request_ids:
            if rid not in self.books.where:
                raise BackendError(f"request {rid} is not in flight")
            by_group.setdefault(self.books.where[rid], []).append(rid)
        out = []
        for g, ids in by_group.items():
            for rid in ids:  # those not returned below finished meanwhile: their event comes
                self.books.leave(rid)
            # (its process died: they come back with the next step's recovered)
            if self.recovery.gone(g):
                for r in ids:
                    self.recovery.restart(r, self.books.versions[g])
                continue
            for r in self.send(g, c.Interrupt(g, tuple(ids))).result(WAIT_S):
                pg, prompt, versions = self.books.meta[r.id]
                out.append(
                    PartialRequest(r.id, pg, len(prompt.tokens), len(r.tokens), tuple(versions), r)
                )
        if discard:  # never resubmitted: forget them (and end their episodes)
            for p in out:
                self.books.meta.pop(p.request_id, None)
                self.forget_conversation(p.request_id)
        return out

    # -- conversations ---------------------------------------------------------------------------
    def _turn_ended(self, rec: EngineFinished) -> None:
        """A conversation ended a model turn: it waits while its environment answers."""
        if rec.id not in self.books.meta:  # discarded while its turn ended (wall clock)
            return
        self._last_turn[rec.id] = rec
        self._waiting.add(rec.id)
        self.turns.turn_ended(rec.id, rec.tokens, rec.logprobs, rec.turn_start)

    def _take_outcomes(self, wait: bool) -> None:
        """Apply the environment's answers: extend each request where it is now (or hold the
        turn until an interrupted one is resubmitted), or end its conversation."""
        extend: dict[int, list] = {}
        end: dict[int, list[int]] = {}
        for o in self.turns.outcomes(wait):
            rid = o.request_id
            self._waiting.discard(rid)
            g = self.books.where.get(rid)
            if not o.over:
                if g is None:
                    self._held_turns.setdefault(rid, []).append(o.observation)
                else:
                    extend.setdefault(g, []).append((rid, o.observation))
            elif g is None:
                self._over[rid] = o  # it finishes when resubmitted
            else:
                end.setdefault(g, []).append(rid)
                self._ended.append(self._conversation_over(rid, o))
        for g, items in extend.items():
            self.send(g, c.Extend(g, tuple(items)))
        for g, ids in end.items():
            self.send(g, c.End(g, tuple(ids)))

    def _conversation_over(self, rid: int, o: TurnOutcome) -> FinishedRequest:
        rec = self._last_turn.pop(rid)
        if len(o.loss_mask) != len(rec.tokens):
            raise BackendError(
                f"request {rid}: the driver's loss mask covers {len(o.loss_mask)} tokens, the "
                f"engine's conversation has {len(rec.tokens)}"
            )
        figures = dict(o.figures or {})
        return self.finish(
            rec,
            str(figures.get("end_reason") or "env"),
            loss_mask=o.loss_mask,
            env_reward=o.reward if self.turns.env_rewards else None,
            conversation=figures,
        )

    def forget_conversation(self, rid: int) -> None:
        if self.turns is not None:
            self.turns.drop(rid)
        for d in (self._last_turn, self._held_turns, self._over):
            d.pop(rid, None)
        self._waiting.discard(rid)

    def waiting_requests(self) -> int:
        """Conversations waiting on their environment (in a group or interrupted)."""
        return len(self._waiting)

    # -- progress --------------------------------------------------------------------------------
    def step(self) -> StepEvents:
        """Logical clock: one engine step of every group. Wall clock: every report since the last
        call (waiting at most ``WAIT_S`` for the first)."""
        self.recovery.take_backups()  # (before the engines step: what was admitted or moved in too)
        # (kept: groups on the caller's thread step now; worker threads have reported already)
        events = self._step_groups() if self.transport.sync else self._reports()
        ticks, finished, self._ended = [], self._ended, []
        for e in events:
            if e.error is not None:
                if self.hosts[e.group] != self.me:
                    raise BackendError(f"group {e.group}'s worker failed:\n{e.error}")
                self.recovery.engine_failed(e.group, e.error)
                continue
            if e.span is not None:
                self._account(e.span)
                ticks.append(e.span)
                if e.span.activity in ("prefill", "decode"):
                    self.recovery.stepped(e.group)
            finished += [
                self.finish(f, f.finish_reason) for f in e.finished if f.id in self.books.meta
            ]
            for rec in e.turn_ends:
                self._turn_ended(rec)
        if self.cluster is not None:  # hosts lost or back (those lost mid-round are out already)
            self.recovery.hosts_changed()
        recovered, health = self.recovery.take_events()
        out = StepEvents(self._tick, tuple(finished), tuple(ticks), recovered, health)
        self._tick += 1
        return out

    def _step_groups(self) -> list[GroupEvent]:
        """One engine step of every group, in group order, then every answer to the turns of
        earlier rounds (an environment call takes one round; its answer is fed the next). One
        record per group and round: a weight load's or KV move's span counts in the overheads
        only."""
        if self.cluster is not None:
            self.cluster.flush()  # this round's calls to other processes, one message each
        events = []
        for g in range(len(self.handles)):
            try:
                if self.recovery.gone(g):  # (out of the run: its record says it did nothing)
                    raise GroupDead(f"group {g} is out of the run")
                events += self.send(g, c.Step(g)).result(WAIT_S)
            except Exception as e:  # noqa: BLE001 - its engine failed: recovered by step()
                if self.hosts[g] != self.me and not self.recovery.gone(g):
                    raise
                t = self.clock.now()
                idle = GroupTick(g, self.books.versions[g], "idle", 0, 0, 0, 0, 0.0, t, t)
                events.append(GroupEvent(g, span=idle))
                if self.hosts[g] == self.me:
                    events.append(GroupEvent(g, error=error_text(e)))
        if self.turns is not None:
            self._take_outcomes(wait=True)
        for i, e in enumerate(events):
            if e.span is not None and e.span.activity in ("transfer", "migrate"):
                self._account(e.span)
                events[i] = replace(e, span=None)
        return events

    def _reports(self) -> list[GroupEvent]:
        """What the workers reported since the last round, after applying the environment's
        answers that have come. A group out of the run on another process that has gone: only
        the requests it finished before its host's handover paused it count (the rest are
        recovered)."""
        if self.turns is not None:
            self._take_outcomes(wait=False)
        if self.cluster is not None:
            self.cluster.flush()  # this round's calls to other processes, one message each
        events, self._held = self._held + self._pull(0 if self._held else self.WAIT_S), []
        out = []
        for e in events:
            if self.hosts[e.group] != self.me and self.recovery.gone(e.group):
                self._ended += self.recovery.finished_before_leaving(e)
            else:
                out.append(e)
        return out

    def pause(self, timeout: float = 600.0) -> None:
        """Wall clock: stop every worker once it has carried out every call made so far (moves
        included; their reports wait for the next :meth:`step`). Groups on the caller's thread
        (the logical clock) are still between two calls already."""
        self._paused = [self.send(g, c.Pause(g)) for g in range(len(self.handles))]
        if self.cluster is not None:
            self.cluster.flush()
        deadline = time.monotonic() + timeout
        while not self.paused():
            if time.monotonic() > deadline:
                raise BackendError(f"groups did not quiesce within {timeout:.0f} s")
            self._held += self._pull(0.01)

    def paused(self) -> bool:
        """Whether every group has applied the last :meth:`pause` (and steps no more)."""
        return all(f.done() for f in self._paused)

    def resume(self) -> None:
        self._paused = []
        for g in range(len(self.handles)):
            self.send(g, c.Resume(g))
        if self.cluster is not None:
            self.cluster.flush()

    def close(self) -> None:
        """Stop the worker threads (wall clock) and the other processes' groups; the backend is
        unusable afterwards."""
        if not self._closed:
            for h in self.handles:
                h.stop()
            if self.cluster is not None:
                self.cluster.stop_hosts()
        self._closed = True

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything in flight as plain data plus engine snapshots (KV of running requests as
        host arrays). Only at a tick boundary (logical) or while paused (wall)."""
        # (kept: worker threads must be paused; sync groups are still between two calls)
        if not self.transport.sync and not (self._paused and self.paused()):
            raise BackendError("state_dict needs the groups paused (call pause() first)")
        return {
            "published": self.published,
            "tick": self._tick,
            "versions": list(self.books.versions),
            "orphaned": sorted(self.recovery.orphaned),
            "members": [list(m) for m in self.books.members],
            "meta": {rid: (pg, p, list(v)) for rid, (pg, p, v) in self.books.meta.items()},
            "overheads": self.overheads,
            "recovered": list(
                self.recovery.recovered
            ),  # (requests of a failed group, not yet handed on)
            "engines": [  # (None: a group out of the run, its process dead or rejoining)
                None if self.recovery.gone(g) else self.send(g, c.Snapshot(g)).result(WAIT_S)
                for g in range(len(self.handles))
            ],
            "conversations": self._conversations_state(),
        }

    def load_state_dict(self, state: dict[str, Any], params_for: Callable[[int], Params]) -> None:
        """Continue from :meth:`state_dict` on a freshly built backend (same groups)."""
        if len(state["engines"]) != len(self.handles):
            raise BackendError(
                f"the state has {len(state['engines'])} groups, this backend {len(self.handles)}"
            )
        self.published, self._tick = state["published"], state["tick"]
        self.overheads = state["overheads"]
        self.books.meta = {rid: (pg, p, list(v)) for rid, (pg, p, v) in state["meta"].items()}
        self.books.members = [dict.fromkeys(m) for m in state["members"]]
        self.books.where = {rid: g for g, m in enumerate(self.books.members) for rid in m}
        self.books.versions = list(state["versions"])
        self.recovery.orphaned = set(state.get("orphaned", ()))
        self.recovery.recovered = list(state.get("recovered", ()))
        self._load_conversations_state(state.get("conversations"))
        for g, snap in enumerate(state["engines"]):
            if snap is None:  # out of the run when saved: back now, with the newest version
                self.recovery.orphan(g)
                self.books.versions[g] = v = self.published
                src = self.trainer_source(g, v, params_for(v))
                self.send(g, c.Load(g, v, **src)).result(WAIT_S)
                self.loads[g] = done()
                continue
            if snap.version != self.books.versions[g]:
                raise BackendError(
                    f"group {g}: snapshot of v{snap.version}, state v{self.books.versions[g]}"
                )
            source = self.trainer_source(g, snap.version, params_for(snap.version))
            self.send(g, c.Restore(g, snap, **source)).result(WAIT_S)  # on the group's thread
            self.loads[g] = done()

    def _conversations_state(self) -> dict[str, Any] | None:
        """The conversations part of the state (None without a driver): the driver's state, the
        requests waiting on their environment, each one's last turn end, answers held for
        interrupted requests, and conversations ended and not yet handed on."""
        if self.turns is None:
            return None
        return {
            "driver": self.turns.state_dict(),
            "waiting": sorted(self._waiting),
            "last_turn": dict(self._last_turn),
            "held_turns": {r: [list(o) for o in obs] for r, obs in self._held_turns.items()},
            "over": {rid: asdict(o) for rid, o in self._over.items()},
            "ended": list(self._ended),
        }

    def _load_conversations_state(self, conv: dict[str, Any] | None) -> None:
        if (conv is None) != (self.turns is None):
            raise BackendError(
                "the checkpoint's conversations and this run's env section disagree (a run "
                "with multi-turn environments resumes with the same env.spec)"
            )
        if conv is None:
            return
        self.turns.load_state_dict(conv["driver"])
        self._waiting = set(conv["waiting"])
        self._last_turn = dict(conv["last_turn"])
        self._held_turns = {r: [tuple(o) for o in obs] for r, obs in conv["held_turns"].items()}
        self._over = {rid: TurnOutcome.from_state(o) for rid, o in conv["over"].items()}
        self._ended = list(conv["ended"])

    # -- internals -------------------------------------------------------------------------------
    def _check_group(self, group) -> None:
        if not isinstance(group, int) or not 0 <= group < len(self.handles):
            raise BackendError(f"no group {group!r}")

    def _pull(self, timeout: float) -> list[GroupEvent]:
        """The workers' reports from the bus (wake-ups from other senders dropped)."""
        return [e for e in self.bus.collect(timeout) if isinstance(e, GroupEvent)]

    def _account(self, span: GroupTick) -> None:
        o = self.overheads
        if span.activity == "transfer":
            o.weight_transfer_s += span.time_s
            o.weight_transfers += 1
        elif span.activity == "migrate":
            o.migration_s += span.time_s
        else:
            return
        o.log.append((span.activity, span.group, span.t0, span.time_s))

    def finish(self, f: EngineFinished, reason: str, **extra: Any) -> FinishedRequest:
        """Request ``f.id`` is over: out of its group, its :class:`Completion` told to
        :attr:`on_finished`."""
        self.books.leave(f.id)
        pg, prompt, versions = self.books.meta.pop(f.id)
        comp = Completion(
            prompt, f.tokens, f.logprobs, reason, f.prefill_tokens, f.migrations, f.routes, **extra
        )
        if self.on_finished is not None:
            self.on_finished(f.id, comp)
        return FinishedRequest(f.id, pg, len(prompt.tokens), len(f.tokens), tuple(versions), comp)
