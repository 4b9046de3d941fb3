"""The load-balancing planner: a pure function ``plan(snapshot, policy) -> Plan``.

From a snapshot of the cluster (groups, the version each holds, the requests each runs, pending
requests per version, the window's dispatch room) it decides, in this order:

1. **Latest supplement**: prompt groups to dispatch at the newest version until ``RBS`` prompt
   groups are in flight (within the window's room). Their requests count as pending work below.
2. **Targets**: groups per version in proportion to its work (running + pending requests), at
   least one for every version with work, none for a version without; a version never gets
   more groups than it can use: those running its requests plus ``ceil(pending / capacity)``,
   capacity being the requests a group can hold (slots and KV reservation, the smallest).
3. **Reassignments** with the least weight traffic: only as many groups change version as the
   targets need; the cheapest to empty go first (idle ones, then the fewest requests), and a
   group is released only if its requests fit in the free slots of the groups its version keeps.
   Idle groups of versions without work move to the newest version (pre-warming it).
4. **Weight sources**: the trainer for the newest version, else a group that keeps that version.
5. **Migrations** (same version only, never across versions): the requests of every released
   group to the kept groups of its version (most free slots first); then, per version, the
   biggest requests of a group whose KV use is over the pressure threshold to the group of that
   version with the least KV in use.
6. **Legacy supplement**: prompt groups at older versions only to fill their groups' idle slots
   (after migrations), newest legacy version first, never at the oldest version of the window
   (the trainer is waiting for that one to drain), within the window's room.

The planner never calls the backend; the runtime carries the plan out. Planning time is measured
by the runtime (``records``) and by ``benchmarks/bench_planner.py``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from dora_jax.orchestrator.backend import TRAINER, GroupInfo, Source


@dataclass(frozen=True)
class Snapshot:
    """What the planner sees; built by the runtime at the start of a tick."""

    tick: int
    latest: int  # newest published version (the only one the trainer can send)
    oldest: int  # oldest version of the window (consume version - K)
    groups: tuple[GroupInfo, ...]
    pending: Mapping[int, int]  # version -> requests dispatched but not admitted to a group
    in_flight: int  # prompt groups dispatched and not ready
    room: Mapping[int, int]  # version -> prompt groups the window still lets us dispatch there
    group_size: int  # G
    trigger: str = "manual"


@dataclass(frozen=True)
class PlanPolicy:
    rollout_batch_prompts: int  # RBS
    kv_pressure_threshold: float = 0.9
    legacy_fill: bool = True
    rebalance: bool = True
    prewarm: bool = True  # move idle groups of versions without work to the newest version


@dataclass(frozen=True)
class WeightTransfer:
    group: int
    version: int
    source: Source  # TRAINER or a group id holding `version`


@dataclass(frozen=True)
class Migration:
    request_ids: tuple[int, ...]
    src: int
    dst: int


@dataclass(frozen=True)
class Plan:
    trigger: str
    targets: Mapping[int, int]  # version -> groups it will hold once the plan is carried out
    transfers: tuple[WeightTransfer, ...] = ()
    migrations: tuple[Migration, ...] = ()
    supplements: tuple[tuple[int, int], ...] = ()  # (version, prompt groups), in dispatch order
    notes: tuple[str, ...] = field(default=())

    @property
    def migrated_requests(self) -> int:
        return sum(len(m.request_ids) for m in self.migrations)


def plan_trigger(
    *,
    new_version: bool,
    groups: list[GroupInfo],
    kv_pressure_threshold: float,
    ticks_since_plan: int,
    period: int,
    idle_waiting: bool = False,
) -> str | None:
    """Which trigger fires now, if any: a new version (mandatory), KV pressure over the
    threshold, the period, or (optional) a ready group idling while other versions' requests
    wait for a slot."""
    if new_version:
        return "new_version"
    if any(g.kv_fraction > kv_pressure_threshold for g in groups):
        return "kv_pressure"
    if ticks_since_plan >= period:
        return "period"
    if idle_waiting:
        return "idle"
    return None


def latest_supplement(in_flight: int, rollout_batch_prompts: int, room_latest: int) -> int:
    """Prompt groups to dispatch at the newest version: up to RBS in flight, within the room."""
    return max(0, min(room_latest, rollout_batch_prompts - in_flight))


def allocate(num_groups: int, work: Mapping[int, int], cap: Mapping[int, int]) -> dict[int, int]:
    """Groups per version in proportion to ``work``: >= 1 for work > 0, <= ``cap``, 0 without.

    Largest-remainder rounding (ties favour the newer version). When more versions have work
    than there are groups, the oldest versions get one each (the trainer waits for them first).
    The total may fall short of ``num_groups`` when the caps bind; the caller decides what the
    rest do.
    """
    live = sorted(v for v, w in work.items() if w > 0)
    if not live or num_groups <= 0:
        return {}
    if len(live) >= num_groups:
        return {v: 1 for v in live[:num_groups]}
    total = sum(work[v] for v in live)
    quota = {v: num_groups * work[v] / total for v in live}
    caps = {v: max(1, cap.get(v, num_groups)) for v in live}
    out = {v: min(caps[v], max(1, int(quota[v]))) for v in live}
    while sum(out.values()) > num_groups:  # the minimum of one pushed us over
        v = max((v for v in live if out[v] > 1), key=lambda v: (out[v] - quota[v], v))
        out[v] -= 1
    order = sorted(live, key=lambda v: (-(quota[v] - out[v]), -v))
    left = num_groups - sum(out.values())
    for v in order:  # largest remainders first, up to each version's rounded-up quota
        if left and out[v] < caps[v] and out[v] < math.ceil(quota[v]):
            out[v] += 1
            left -= 1
    while left > 0:  # then groups nobody's quota claims go to versions that can still use them
        room = [v for v in order if out[v] < caps[v]]
        if not room:
            break
        for v in room[:left]:
            out[v] += 1
            left -= 1
    return out


class _Load:
    """Mutable per-group load while a plan is being built."""

    __slots__ = ("info", "free", "kv", "reqs")

    def __init__(self, g: GroupInfo):
        self.info = g
        self.free = g.free_slots
        self.kv = g.kv_pages_used
        self.reqs: dict[int, int] | None = None  # request id -> pages, materialised on demand

    def requests(self) -> dict[int, int]:
        if self.reqs is None:
            self.reqs = dict(zip(self.info.requests, self.info.request_pages, strict=True))
        return self.reqs


def plan(snapshot: Snapshot, policy: PlanPolicy) -> Plan:
    """Decide reassignments, weight sources, migrations and supplements (see module docstring)."""
    s, G = snapshot, snapshot.group_size
    # requests a group can hold (slots and KV reservation): what pending work needs per group
    slots = max(1, min((len(g.requests) + g.free_slots for g in s.groups), default=1))
    s_latest = latest_supplement(s.in_flight, policy.rollout_batch_prompts, s.room.get(s.latest, 0))
    pending = {v: n for v, n in s.pending.items() if n > 0}
    if s_latest:
        pending[s.latest] = pending.get(s.latest, 0) + s_latest * G

    loads = {g.group: _Load(g) for g in s.groups}
    holders: dict[int, list[int]] = {}
    active: dict[int, int] = {}
    busy: dict[int, int] = {}
    free: dict[int, int] = {}  # free slots over the groups a version keeps
    for g in s.groups:
        v, n = g.version, len(g.requests)
        holders.setdefault(v, []).append(g.group)
        active[v] = active.get(v, 0) + n
        busy[v] = busy.get(v, 0) + (n > 0)
        free[v] = free.get(v, 0) + g.free_slots
    work = {v: active.get(v, 0) + pending.get(v, 0) for v in set(active) | set(pending)}
    cap = {v: min(w, max(1, busy.get(v, 0) + math.ceil(pending.get(v, 0) / slots)))
           for v, w in work.items()}  # fmt: skip
    targets = allocate(len(s.groups), work, cap)

    # -- reassignments: surplus groups (cheapest to empty first) go to versions short of groups
    current = {v: len(ids) for v, ids in holders.items()}
    deficit = {v: t - current.get(v, 0) for v, t in targets.items() if t > current.get(v, 0)}
    candidates: list[tuple[int, int, int, int]] = []  # (requests, kv, group, version)
    for v, ids in holders.items():
        surplus = current[v] - targets.get(v, 0)
        if surplus > 0:
            ranked = sorted((len(loads[i].info.requests), loads[i].kv, i, v) for i in ids)
            candidates += ranked[:surplus]
    candidates.sort()
    used = [False] * len(candidates)
    kept = {v: set(ids) for v, ids in holders.items()}
    released: dict[int, list[int]] = {}  # version -> its groups that go elsewhere, in order
    transfers: list[WeightTransfer] = []
    for v in sorted(deficit, key=lambda v: (current.get(v, 0) > 0, -v)):
        if v == s.latest:
            source: Source = TRAINER
        else:
            src = min(kept.get(v, ()), key=lambda i: (loads[i].info.busy_ticks, i), default=None)
            if src is None:
                continue
            source = src
        need = deficit[v]
        for j, (n_req, _, gid, u) in enumerate(candidates):
            if need == 0:
                break
            if used[j] or (u != s.latest and work.get(u) and len(kept[u]) == 1):
                continue  # taken, or the last holder of an older version with work
            g_free = loads[gid].free
            if n_req and free[u] - g_free < n_req:
                continue  # its requests would not fit in the groups its version keeps
            free[u] -= g_free + n_req
            used[j] = True
            kept[u].discard(gid)
            released.setdefault(u, []).append(gid)
            kept.setdefault(v, set()).add(gid)
            transfers.append(WeightTransfer(gid, v, source))
            need -= 1
    if policy.prewarm and (work.get(s.latest) or s.room.get(s.latest)):
        for j, (n_req, _, gid, u) in enumerate(candidates):  # idle groups, versions without work
            if not used[j] and n_req == 0 and not work.get(u) and u != s.latest:
                kept[u].discard(gid)
                kept.setdefault(s.latest, set()).add(gid)
                transfers.append(WeightTransfer(gid, s.latest, TRAINER))
    moved = {t.group for t in transfers}

    # -- migrations: empty released groups into the groups their version keeps (same version)
    migrations: list[Migration] = []
    for u, gids in released.items():
        srcs = [loads[i] for i in gids if loads[i].info.requests]
        if srcs:
            dsts = sorted((loads[i] for i in kept[u] if i not in moved and loads[i].free > 0),
                          key=lambda x: (-x.free, x.info.group))  # fmt: skip
            _fill(srcs, dsts, migrations)
    if policy.rebalance:
        for ids in kept.values():
            group_loads = [loads[i] for i in sorted(ids) if i not in moved]
            if len(group_loads) > 1:
                _rebalance(group_loads, policy.kv_pressure_threshold, migrations)

    # -- legacy supplement: fill idle slots of older versions, newest first
    supplements = [(s.latest, s_latest)] if s_latest else []
    planned = s_latest
    if policy.legacy_fill:
        for v in sorted(kept, reverse=True):
            if not s.oldest < v < s.latest:
                continue
            idle = sum(loads[i].free for i in kept[v] if i not in moved) - pending.get(v, 0)
            n = min(s.room.get(v, 0) - planned, idle // G)
            if n > 0:
                supplements.append((v, n))
                planned += n
    final = {v: len(ids) for v, ids in kept.items() if ids}
    return Plan(s.trigger, final, tuple(transfers), tuple(migrations), tuple(supplements))


def _fill(srcs: list[_Load], dsts: list[_Load], out: list[Migration]) -> None:
    """Move every request of ``srcs`` into ``dsts`` (most free slots first), in bulk."""
    k = 0
    for src in srcs:
        ids, pages = src.info.requests, src.info.request_pages
        i = 0
        while i < len(ids):
            dst = dsts[k]
            n = min(dst.free, len(ids) - i)
            moved_pages = sum(pages[i : i + n])
            out.append(Migration(ids[i : i + n], src.info.group, dst.info.group))
            dst.free -= n
            dst.kv += moved_pages
            src.kv -= moved_pages
            if dst.reqs is not None:
                dst.reqs.update(zip(ids[i : i + n], pages[i : i + n], strict=True))
            i += n
            if dst.free == 0:
                k += 1
        src.free += len(ids)
        src.reqs = {}


def _rebalance(group_loads: list[_Load], threshold: float, out: list[Migration]) -> None:
    """Same-version moves off groups whose KV use is over ``threshold``: biggest requests first,
    each to the (ready) group with the least KV in use, while that evens the load out."""
    limit = threshold * (group_loads[0].info.kv_pages_total or 1)
    over = sorted((x for x in group_loads if x.kv > limit), key=lambda x: -x.kv)
    if not over:
        return
    heap = [(x.kv, x.info.group, x) for x in group_loads
            if x.kv <= limit and x.free > 0 and not x.info.busy_ticks]  # fmt: skip
    heapq.heapify(heap)
    for src in over:
        moves: dict[int, list[int]] = {}
        reqs = src.requests()
        for rid, pages in sorted(reqs.items(), key=lambda kv: -kv[1]):
            if src.kv <= limit or not heap:
                break
            _, gid, dst = heap[0]
            if dst.kv + pages >= src.kv:
                break
            heapq.heappop(heap)
            del reqs[rid]
            dst.requests()[rid] = pages
            src.kv, dst.kv = src.kv - pages, dst.kv + pages
            src.free, dst.free = src.free + 1, dst.free - 1
            if dst.free > 0:
                heapq.heappush(heap, (dst.kv, gid, dst))
            moves.setdefault(gid, []).append(rid)
        out += [Migration(tuple(r), src.info.group, d) for d, r in moves.items()]
