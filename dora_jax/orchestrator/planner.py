"""The load-balancing planner (v2): a pure function ``plan(snapshot, policy) -> Plan``.

From a snapshot of the cluster (groups, the version each holds, the requests each runs and the KV
pages each request holds, pending requests per version, the window's dispatch room) it decides,
in this order:

1. **Latest supplement**: prompt groups to dispatch at the newest version until ``RBS`` prompt
   groups are in flight (within the window's room). Their requests count as pending work below.
2. **Targets**, in KV pages, not slot counts. Each version with running requests first gets the
   groups its requests need: at most the groups that hold requests of it now, shrunk to
   ``ceil(pages / (CONSOLIDATE_FILL * pages per group))`` (*consolidation*: the tail of an older
   version is packed onto as few groups as its KV needs, so the freed groups switch to the
   newest version sooner); a version whose requests still wait for a slot has no tail yet and
   is not packed. The **gate**, the oldest version with running requests (the trainer
   cannot take its next step before it has drained), is not packed tighter while enough is
   ready for that step (the trainer would only be waiting for the gate), and grows past the
   groups it holds when they cannot hold its pages (requests parked in host memory). The groups
   left are shared in proportion to pending work (at least one for every version with pending
   requests). Groups still left are *spare*: while the trainer waits only for the gate (enough
   is ready for its next step), they go to the gate, spread over up to
   ``ceil(pages / (SPREAD_FILL * pages per group))`` groups so that its requests decode in
   smaller, faster batches. Idle groups of versions without work pre-warm the newest version.
3. **Reassignments** with the least weight traffic: only ``target - current`` groups change
   version; the cheapest to empty go first (idle ones, then the fewest pages), and a group is
   released only if its requests fit into the groups its version keeps, in free slots *and* in
   KV pages under the pressure threshold (checked by packing them). The last holder of an older
   version with work is never released (nobody else could load that version).
4. **Weight sources**: the trainer for the newest version, else a group that keeps that version
   (a ready one first, then one on the receiver's own host: a copy within a host is cheaper).
5. **Migrations** (same version only, never across versions; no destination is ever filled past
   ``kv_pressure_threshold`` of its pages): the requests of every released group to the kept
   groups of its version (most KV room first; in a multi-process run, groups on the released
   group's own host before the others); then, per version, relief of groups over the
   threshold (biggest requests first, to the group with the least KV in use while that evens the
   load), and, while the trainer waits only for the gate, an even share of the gate's pages for
   each of its ready groups.
6. **Legacy supplement**: prompt groups at older versions only to fill their groups' idle slots
   (after migrations), newest legacy version first, only at versions that stay consumable for
   ``legacy_fill_margin`` more train steps (by default never the oldest version of the window
   nor the next one: a request started that close to its deadline holds the window up), within
   the window's room.

Triggers (``plan_trigger``) have hysteresis: a KV-pressure or idle trigger whose last plan moved
nothing is *muted* until what it looks at (``trigger_key``) changes; the runtime keeps the muted
keys. An idle, ready group whose version has nothing pending, while work waits elsewhere or
another group could share its load (``idle_group_waiting``), fires the idle trigger at once.

The planner never calls the backend; the runtime carries the plan out. Planning time is measured
by the runtime (``records``) and by ``benchmarks/bench_planner.py``.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from itertools import accumulate

from dora_jax.config.schema import PlannerConfig
from dora_jax.orchestrator.backend import TRAINER, GroupInfo, Source

MUTABLE_TRIGGERS = ("kv_pressure", "idle")  # the others fire on events or on a clock


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
    ready: int = 0  # prompt groups finished and not consumed yet
    train_batch: int = 0  # TBS: prompt groups one train step takes (0: unknown)
    # older versions the trainer still sends: only groups out of the run held them (their
    # recovered requests need a group of that version)
    sendable: frozenset[int] = frozenset()


CONSOLIDATE_FILL = 0.9  # KV share an older version's groups are packed to
SPREAD_FILL = 0.15  # the gate version is spread until its groups hold this share of KV


@dataclass(frozen=True)
class PlanPolicy(PlannerConfig):
    """What ``plan`` follows: the config's switches (``orchestrator.planner``: ``kv_aware``,
    ``consolidate``, ``spread``, ``prewarm``, ``legacy_fill_margin``, keyword-only) and these."""

    rollout_batch_prompts: int  # RBS
    kv_pressure_threshold: float = 0.9  # no move fills a destination past this share of its KV
    legacy_fill: bool = True
    # several processes: moves within a host first (migration destinations, weight sources)
    prefer_local: bool = True


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
    notes: tuple[str, ...] = ()

    @property
    def migrated_requests(self) -> int:
        return sum(len(m.request_ids) for m in self.migrations)

    @property
    def moves(self) -> bool:
        """Whether the plan changes where anything runs (weights or requests)."""
        return bool(self.transfers or self.migrations)


# -- triggers --------------------------------------------------------------------------------------


def idle_group_waiting(groups: list[GroupInfo], pending: Mapping[int, int]) -> bool:
    """A ready group holds nothing and nothing waits for its version, while requests of another
    version wait for a slot or another group holds more than one request (it could take some
    over once it holds that version)."""
    idle = [g for g in groups if not g.requests and not g.busy_ticks and not pending.get(g.version)]
    if not idle:
        return False
    if any(n for n in pending.values()):
        return True
    return any(len(g.requests) > 1 for g in groups)


def trigger_key(
    trigger: str, groups: list[GroupInfo], pending: Mapping[int, int], threshold: float
) -> Hashable:
    """What must change before a ``trigger`` whose last plan moved nothing may fire again: the
    versions groups hold, which groups are idle, which are over the KV threshold, which versions
    have pending requests, and (KV pressure) how much room each version's ready groups have, in
    steps of a twentieth of a group's pages."""
    versions = tuple(g.version for g in groups)
    idle = tuple(g.group for g in groups if not g.requests and not g.busy_ticks)
    if trigger == "idle":
        return (versions, idle, tuple(sorted(v for v, n in pending.items() if n)))
    hot = tuple(g.group for g in groups if g.kv_fraction > threshold)
    room: dict[int, int] = {}
    for g in groups:
        if not g.busy_ticks and g.kv_pages_total and g.kv_fraction <= threshold:
            r = int(20 * (threshold - g.kv_fraction))
            room[g.version] = max(room.get(g.version, 0), r)
    return (versions, idle, hot, tuple(sorted(room.items())))


def plan_trigger(
    *,
    new_version: bool,
    groups: list[GroupInfo],
    kv_pressure_threshold: float,
    ticks_since_plan: int,
    period: int,
    idle_waiting: bool = False,
    muted: Mapping[str, Hashable] | None = None,
    pending: Mapping[int, int] | None = None,
) -> str | None:
    """Which trigger fires now, if any: a new version (mandatory), KV pressure over the
    threshold, the period, or a ready group idling with nothing admissible (``idle_waiting``).
    A trigger in ``muted`` fires only once its :func:`trigger_key` differs from the muted one."""
    muted = muted or {}

    def live(name: str) -> bool:
        if name not in muted:
            return True
        return trigger_key(name, groups, pending or {}, kv_pressure_threshold) != muted[name]

    if new_version:
        return "new_version"
    if any(g.kv_fraction > kv_pressure_threshold for g in groups) and live("kv_pressure"):
        return "kv_pressure"
    if ticks_since_plan >= period:
        return "period"
    if idle_waiting and live("idle"):
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


# -- the plan --------------------------------------------------------------------------------------


class _Load:
    """Mutable per-group load while a plan is being built."""

    __slots__ = ("info", "free", "kv", "gone")

    def __init__(self, g: GroupInfo):
        self.info = g
        self.free = g.free_slots
        self.kv = g.kv_pages_used
        self.gone: set[int] = set()  # its requests this plan moves away


class _Pool:
    """The groups a version keeps, as destinations for requests: the most KV room first (groups
    on the source's own host before the others, when the groups span several hosts), with the
    version's free slots and KV room in total (a quick refusal when they do not suffice)."""

    def __init__(self, dsts: list[_Load], limit: float, prefer_local: bool = True):
        self.limit = limit
        ok = [d for d in dsts if d.free > 0 and d.kv < limit]
        self.heap = [(d.kv - limit, d.info.group, d) for d in ok]
        heapq.heapify(self.heap)
        self.free = sum(d.free for d in ok)
        self.room = sum(limit - d.kv for d in ok)
        self.hosts = len({d.info.host for d in ok}) if prefer_local else 1

    def _queues(self, host: int) -> list[list]:
        """Heaps to take destinations from, in order: the source's host first (a move within a
        host is cheaper than one across hosts), then the rest."""
        if self.hosts < 2:
            return [self.heap]
        same = [e for e in self.heap if e[2].info.host == host]
        other = [e for e in self.heap if e[2].info.host != host]
        heapq.heapify(same)
        heapq.heapify(other)
        return [same, other]

    def take(self, src: _Load) -> list[Migration] | None:
        """Migrations moving every request of ``src`` here (each destination takes a contiguous
        run that fits its free slots and its room under ``limit``); None, and nothing changed,
        if they do not all fit."""
        ids, pages = src.info.requests, src.info.request_pages
        cum = list(accumulate(pages, initial=0))
        if len(ids) > self.free or cum[-1] > self.room:
            return None
        popped: list[_Load] = []
        runs: list[tuple[int, int, _Load]] = []
        queues = self._queues(src.info.host)
        i = 0
        while i < len(ids):
            q = next((q for q in queues if q), None)
            if q is None:
                break
            d = heapq.heappop(q)[2]
            popped.append(d)
            j = min(bisect_right(cum, cum[i] + self.limit - d.kv) - 1, i + d.free, len(ids))
            if j > i:
                runs.append((i, j, d))
                i = j
        if i < len(ids):
            runs = []
        if len(queues) > 1:
            self.heap = queues[0] + queues[1]
            heapq.heapify(self.heap)
        out = []
        for a, b, d in runs:
            d.free -= b - a
            d.kv += cum[b] - cum[a]
            self.free -= b - a
            self.room -= cum[b] - cum[a]
            out.append(Migration(tuple(ids[a:b]), src.info.group, d.info.group))
        for d in popped:
            if d.free > 0 and d.kv < self.limit:
                heapq.heappush(self.heap, (d.kv - self.limit, d.info.group, d))
        if not runs:
            return None
        src.kv, src.free = 0, src.free + len(ids)
        src.gone.update(ids)
        return out


def plan(snapshot: Snapshot, policy: PlanPolicy) -> Plan:
    """Decide reassignments, weight sources, migrations and supplements (see module docstring)."""
    s, G = snapshot, snapshot.group_size
    if not s.groups:
        return Plan(s.trigger, {})
    pages_total = max(g.kv_pages_total for g in s.groups)
    kv = policy.kv_aware and pages_total > 0
    level = policy.kv_pressure_threshold * pages_total if pages_total else math.inf
    limit = level if kv else math.inf  # no move fills a destination past this many pages
    fill = min(CONSOLIDATE_FILL, policy.kv_pressure_threshold) * pages_total
    max_slots = max(g.max_slots for g in s.groups)
    # requests a fresh group admits (slots and KV reservation): what pending work needs per group
    per_group = max(1, min((len(g.requests) + g.free_slots for g in s.groups), default=1))
    s_latest = latest_supplement(s.in_flight, policy.rollout_batch_prompts, s.room.get(s.latest, 0))
    pending = {v: n for v, n in s.pending.items() if n > 0}
    if s_latest:
        pending[s.latest] = pending.get(s.latest, 0) + s_latest * G

    loads = {g.group: _Load(g) for g in s.groups}
    holders: dict[int, list[int]] = {}
    running: dict[int, int] = {}
    pages: dict[int, int] = {}
    busy: dict[int, int] = {}  # groups of a version holding requests
    smallest: dict[int, int] = {}  # the fewest pages one of a version's requests holds
    for g in s.groups:
        v, n = g.version, len(g.requests)
        holders.setdefault(v, []).append(g.group)
        running[v] = running.get(v, 0) + n
        pages[v] = pages.get(v, 0) + g.kv_pages_used
        busy[v] = busy.get(v, 0) + (n > 0)
        if g.request_pages:
            smallest[v] = min(smallest.get(v, math.inf), min(g.request_pages))
    work = {v for v, n in running.items() if n} | set(pending)
    gate = min((v for v, n in running.items() if n), default=None)
    # enough is ready for the next step: what holds the trainer up is the gate draining
    critical = gate is not None and 0 < s.train_batch <= s.ready

    # -- targets: what running requests need (KV pages), then pending work, then spare groups
    hard: dict[int, int] = {}
    for v, n in running.items():
        if not n:
            continue
        want = max(1, math.ceil(n / max_slots), math.ceil(pages[v] / fill) if kv else 1)
        # only the gate grows past the groups it holds, when they cannot hold its pages (its
        # parked requests hold the trainer up); the others wait in host memory, as in the paper.
        # A new group helps only if a request can move there: one fits under the limit.
        grow = kv and v == gate and pages[v] > busy[v] * pages_total and n > busy[v]
        grow = grow and smallest.get(v, math.inf) <= limit
        if grow:
            hard[v] = max(busy[v], min(n, math.ceil(pages[v] / limit)))
        elif v == s.latest or (v == gate and critical) or not policy.consolidate or v in pending:
            # a gate the trainer waits for is never packed tighter, nor a version whose requests
            # still wait for a slot (no tail yet: its groups are still being filled)
            hard[v] = busy[v]
        else:
            hard[v] = min(want, busy[v])
    targets = allocate(len(s.groups), hard, hard)
    soft = {v: math.ceil(n / per_group) for v, n in pending.items()}
    left = len(s.groups) - sum(targets.values())
    for v, extra in allocate(left, soft, soft).items():
        targets[v] = targets.get(v, 0) + extra
    spare = len(s.groups) - sum(targets.values())
    notes: list[str] = []
    # with spare groups the trainer's wait for the gate is the cost to cut: spread it
    spreading = bool(spare and policy.spread and kv and critical and gate != s.latest)
    if spreading and gate in targets:
        spread = min(running[gate], math.ceil(pages[gate] / (SPREAD_FILL * pages_total)))
        extra = min(spare, max(0, spread - targets[gate]))
        if extra:
            targets[gate] += extra
            spare -= extra
            notes.append(f"spread v{gate} over {targets[gate]} groups")

    # -- reassignments: surplus groups (cheapest to empty first) go to versions short of groups
    current = {v: len(ids) for v, ids in holders.items()}
    deficit = {v: t - current.get(v, 0) for v, t in targets.items() if t > current.get(v, 0)}
    candidates: list[tuple[int, int, int, int]] = []  # (requests, kv, group, version)
    for v, ids in holders.items():
        surplus = current[v] - targets.get(v, 0)
        if surplus > 0:
            ranked = sorted((len(loads[i].info.requests), loads[i].kv, i, v) for i in ids)
            candidates += ranked[:surplus]
    candidates.sort(key=lambda c: (c[0] > 0, c[1], c[0], c[2]))  # idle first, then fewest pages
    used = [False] * len(candidates)
    kept = {v: set(ids) for v, ids in holders.items()}
    leaving = {gid for _, _, gid, _ in candidates}  # never a destination while it may be emptied
    transfers: list[WeightTransfer] = []
    migrations: list[Migration] = []
    moved: set[int] = set()
    pools: dict[int, _Pool] = {}
    for v in sorted(deficit, key=lambda v: (current.get(v, 0) > 0, -v)):
        holding = sorted(kept.get(v, ()))  # groups that can send version v's weights
        if v != s.latest and not holding and v not in s.sendable:
            continue
        need = deficit[v]
        for j, (n_req, _, gid, u) in enumerate(candidates):
            if need == 0:
                break
            if used[j] or (u != s.latest and u in work and len(kept[u]) == 1):
                continue  # taken, or the last holder of an older version with work
            if n_req:
                if u not in pools:
                    dsts = [loads[i] for i in kept[u] if i not in leaving and i not in moved]
                    pools[u] = _Pool(dsts, limit, policy.prefer_local)
                out = pools[u].take(loads[gid])
                if out is None:
                    continue  # its requests would not fit in the groups its version keeps
                migrations += out
            used[j] = True
            kept[u].discard(gid)
            kept.setdefault(v, set()).add(gid)
            moved.add(gid)
            source: Source = TRAINER
            if v != s.latest and holding:  # a ready holder first, then one on the receiver's host
                host = loads[gid].info.host
                local = policy.prefer_local
                source = min(
                    holding,
                    key=lambda i: (
                        loads[i].info.busy_ticks,
                        local and loads[i].info.host != host,
                        i,
                    ),
                )
            transfers.append(WeightTransfer(gid, v, source))
            need -= 1
    if policy.prewarm and (s.latest in work or s.room.get(s.latest)):
        for j, (n_req, _, gid, u) in enumerate(candidates):  # idle groups, versions without work
            if not used[j] and n_req == 0 and u not in work and u != s.latest:
                kept[u].discard(gid)
                kept.setdefault(s.latest, set()).add(gid)
                moved.add(gid)
                transfers.append(WeightTransfer(gid, s.latest, TRAINER))

    # -- migrations inside a version: relieve KV pressure; spread the gate evenly
    for v, ids in kept.items():
        ready = [loads[i] for i in sorted(ids) if i not in moved]
        if len(ready) > 1:
            even = policy.spread and kv and critical and v == gate and v != s.latest
            _rebalance(ready, level, limit, pages_total, even, migrations)

    # -- legacy supplement: fill idle slots of older versions, newest first
    supplements = [(s.latest, s_latest)] if s_latest else []
    planned = s_latest
    if policy.legacy_fill:
        for v in sorted(kept, reverse=True):
            if not s.oldest + policy.legacy_fill_margin <= v < s.latest:
                continue
            idle = sum(loads[i].free for i in kept[v] if i not in moved) - pending.get(v, 0)
            n = min(s.room.get(v, 0) - planned, idle // G)
            if n > 0:
                supplements.append((v, n))
                planned += n
    final = {v: len(ids) for v, ids in kept.items() if ids}
    return Plan(
        s.trigger, final, tuple(transfers), tuple(migrations), tuple(supplements), tuple(notes)
    )


def _rebalance(
    group_loads: list[_Load],
    pressure: float,
    limit: float,
    pages_total: int,
    even: bool,
    out: list[Migration],
) -> None:
    """Same-version moves between ready groups: off groups over ``pressure`` pages (and, with
    ``even``, off groups above the version's mean by more than a twentieth of a group), biggest
    requests first, each to the group with the least KV in use, while that evens the load and the
    destination stays within ``limit`` pages."""
    level = pressure
    if even:
        mean = sum(x.kv for x in group_loads) / len(group_loads)
        level = min(pressure, mean + 0.05 * pages_total)
    over = sorted((x for x in group_loads if x.kv > level), key=lambda x: -x.kv)
    if not over:
        return
    heap = [
        (x.kv, x.info.group, x)
        for x in group_loads
        if x.kv <= level and x.free > 0 and not x.info.busy_ticks
    ]
    heapq.heapify(heap)
    for src in over:
        if not heap:
            break
        moves: dict[int, list[int]] = {}
        ids, pages = src.info.requests, src.info.request_pages
        for i in _biggest_first(pages, src.kv - level):
            if src.kv <= level or not heap:
                break
            rid, p = ids[i], pages[i]
            _, gid, dst = heap[0]
            if rid in src.gone or dst.kv + p >= src.kv or dst.kv + p > limit:
                continue  # moved already, or too big to even anything out here: a smaller one
            heapq.heappop(heap)
            src.gone.add(rid)
            src.kv, dst.kv = src.kv - p, dst.kv + p
            src.free, dst.free = src.free + 1, dst.free - 1
            if dst.free > 0 and dst.kv <= level:
                heapq.heappush(heap, (dst.kv, gid, dst))
            moves.setdefault(gid, []).append(rid)
        out += [Migration(tuple(r), src.info.group, d) for d, r in moves.items()]


def _biggest_first(pages: tuple[int, ...], need: float) -> list[int]:
    """Indices of the biggest entries of ``pages``, biggest first: enough of them to add up to
    twice ``need`` and a few more (room to skip some), without sorting indices of them all."""
    srt = sorted(pages, reverse=True)
    total, k = 0, 0
    while k < len(srt) and total < 2 * need:
        total += srt[k]
        k += 1
    k = min(len(srt), k + 8)
    if k == len(srt):
        return sorted(range(len(pages)), key=pages.__getitem__, reverse=True)
    cut = srt[k - 1]
    out = [i for i, p in enumerate(pages) if p >= cut]
    out.sort(key=pages.__getitem__, reverse=True)
    return out
