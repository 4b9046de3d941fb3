"""The pure planner: allocation, reassignment, weight sources, migrations, supplements."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.orchestrator import TRAINER, GroupInfo, PlanPolicy, Snapshot, allocate, plan
from dora_jax.orchestrator.planner import idle_group_waiting, plan_trigger, trigger_key

_next_rid = [0]


def grp(gid, version, n, slots=8, busy=0, pages=4, kv_total=100) -> GroupInfo:
    ids = tuple(range(_next_rid[0], _next_rid[0] + n))
    _next_rid[0] += n
    pg = (pages,) * n if isinstance(pages, int) else tuple(pages)
    return GroupInfo(gid, version, busy, slots, slots - n, sum(pg), kv_total, ids, pg)


def snap(groups, latest, *, oldest=None, pending=None, in_flight=0, room=None, G=4, trig="t"):
    oldest = latest - 2 if oldest is None else oldest
    room = room if room is not None else {v: 100 for v in range(oldest, latest + 1)}
    return Snapshot(0, latest, oldest, tuple(groups), pending or {}, in_flight, room, G, trig)


POLICY = PlanPolicy(rollout_batch_prompts=0)  # no latest supplement unless a test asks for one


def _ready(s: Snapshot) -> Snapshot:
    """``s`` with a train batch ready: the trainer waits only for the window's gate."""
    return dataclasses.replace(s, ready=4, train_batch=4)


# -- allocation ----------------------------------------------------------------------------------


def test_allocate_is_proportional():
    assert allocate(8, {0: 10, 1: 30}, {}) == {0: 2, 1: 6}
    assert allocate(10, {3: 5, 4: 5, 5: 10}, {}) == {3: 2, 4: 3, 5: 5}  # ties: the newer


def test_allocate_min_one_and_none_without_work():
    assert allocate(8, {0: 1, 1: 1000}, {}) == {0: 1, 1: 7}
    assert allocate(8, {0: 0, 1: 5}, {}) == {1: 8}
    assert allocate(4, {}, {}) == {}


def test_allocate_more_versions_than_groups_favours_the_oldest():
    assert allocate(2, {5: 1, 6: 100, 7: 100}, {}) == {5: 1, 6: 1}


def test_allocate_respects_caps_and_gives_leftovers_to_who_can_use_them():
    assert allocate(8, {0: 10, 1: 30}, {1: 3}) == {0: 5, 1: 3}
    assert allocate(8, {0: 2, 1: 3}, {0: 1, 1: 2}) == {0: 1, 1: 2}  # the rest stay unassigned


@given(
    n=st.integers(1, 64),
    work=st.dictionaries(st.integers(0, 6), st.integers(0, 500), max_size=6),
    caps=st.dictionaries(st.integers(0, 6), st.integers(1, 64), max_size=6),
)
@settings(max_examples=200, deadline=None)
def test_allocate_properties(n, work, caps):
    out = allocate(n, work, caps)
    live = [v for v, w in work.items() if w > 0]
    assert sum(out.values()) <= n
    assert all(work.get(v, 0) > 0 for v in out)  # none for a version without work
    if len(live) <= n:
        assert set(out) == set(live) and all(c >= 1 for c in out.values())
        assert all(out[v] <= max(1, caps.get(v, n)) for v in out)
        total = sum(work[v] for v in live)
        if not caps and all(n * work[v] / total >= 1 for v in live):
            assert all(abs(out[v] - n * work[v] / total) < 1 for v in live)


# -- plan ----------------------------------------------------------------------------------------


def test_new_version_moves_the_idle_group_first_from_the_trainer():
    groups = [grp(0, 4, 8), grp(1, 4, 2), grp(2, 4, 1), grp(3, 4, 0)]
    p = plan(snap(groups, 5, in_flight=0), PlanPolicy(rollout_batch_prompts=2))
    assert p.supplements[0] == (5, 2)  # latest version first: RBS - in flight
    assert [(t.group, t.version, t.source) for t in p.transfers] == [(3, 5, TRAINER)]
    assert p.targets == {4: 3, 5: 1} and p.migrations == ()
    # enough is ready for the next step, so the trainer waits only for v4 (the gate): the spare
    # group is kept on v4 and v4's load is evened out over its three groups
    waiting = snap(groups, 5, in_flight=0)
    waiting = _ready(waiting)
    p = plan(waiting, PlanPolicy(rollout_batch_prompts=2))
    assert p.targets == {4: 3, 5: 1}
    assert {(m.src, m.dst) for m in p.migrations} == {(0, 1), (0, 2)}
    # without spreading, v4 would fit two groups, but nothing else needs its third: it stays
    p = plan(snap(groups, 5, in_flight=0), PlanPolicy(rollout_batch_prompts=2, spread=False))
    assert [(t.group, t.version) for t in p.transfers] == [(3, 5)] and p.migrations == ()
    # with more work at v5, it is emptied (into the group with the most KV room) for v5
    p = plan(snap(groups, 5, in_flight=0, pending={5: 8}), PlanPolicy(2, spread=False))
    assert [(t.group, t.version) for t in p.transfers] == [(3, 5), (2, 5)]
    assert [(m.src, m.dst) for m in p.migrations] == [(2, 1)] and p.targets == {4: 2, 5: 2}


def test_released_groups_are_emptied_into_same_version_groups():
    groups = [grp(0, 4, 1), grp(1, 4, 1), grp(2, 4, 6), grp(3, 4, 7)]
    p = plan(snap(groups, 5, pending={5: 16}), POLICY)
    assert {(t.group, t.version, t.source) for t in p.transfers} == {
        (0, 5, TRAINER),
        (1, 5, TRAINER),
    }
    moved = {rid: (m.src, m.dst) for m in p.migrations for rid in m.request_ids}
    assert set(moved) == set(groups[0].requests) | set(groups[1].requests)
    assert all(dst in (2, 3) for _, dst in moved.values())
    assert p.targets == {4: 2, 5: 2}


def test_a_release_that_does_not_fit_is_skipped():
    groups = [grp(0, 4, 7), grp(1, 4, 7)]  # 1 free slot each: neither can be emptied
    p = plan(snap(groups, 5, pending={5: 16}), POLICY)
    assert p.transfers == () and p.migrations == ()


def test_legacy_version_gets_weights_from_a_group_holding_it():
    groups = [grp(0, 4, 8), grp(1, 5, 1), grp(2, 3, 0)]  # v3 has no work left
    p = plan(snap(groups, 5, oldest=3, pending={4: 8}), POLICY)
    assert [(t.group, t.version, t.source) for t in p.transfers] == [(2, 4, 0)]


def test_moves_prefer_the_source_host_across_processes():
    # v4's tail (110 pages) needs two groups: group 0 (host 1, the fewest pages) is emptied.
    # Destinations: group 1 (host 0) with the most KV room, group 2 (host 1) with less. Within
    # one host the most room wins; across hosts the released group's own host does, as long as
    # its requests fit there.
    def on(g, host):
        return g._replace(host=host)

    g0, g1, g5 = on(grp(0, 4, 1, pages=15), 1), on(grp(1, 4, 1, pages=20), 0), grp(3, 5, 8)
    groups = [g0, g1, on(grp(2, 4, 3, pages=25), 1), g5]
    p = plan(snap(groups, 5, pending={5: 16}), POLICY)
    assert p.targets == {4: 2, 5: 2}
    assert [(m.request_ids, m.src, m.dst) for m in p.migrations] == [(g0.requests, 0, 2)]
    p = plan(snap([g._replace(host=0) for g in groups], 5, pending={5: 16}), POLICY)
    assert [(m.src, m.dst) for m in p.migrations] == [(0, 1)]  # one host: the most room
    off = dataclasses.replace(POLICY, prefer_local=False)  # hosts ignored: as on one host
    assert [(m.src, m.dst) for m in plan(snap(groups, 5, pending={5: 16}), off).migrations] == [
        (0, 1)
    ]
    # no room on its own host (80 pages + 15 > 90): the requests cross to host 0
    full = [g0, g1, on(grp(2, 4, 3, pages=[30, 25, 25]), 1), g5]
    p = plan(snap(full, 5, pending={5: 16}), POLICY)
    assert [(m.src, m.dst) for m in p.migrations] == [(0, 1)]


def test_weights_come_from_a_holder_on_the_receivers_host():
    # v4 is kept by group 0 (host 0) and group 2 (host 1); idle group 1 (host 1) joins v4
    def on(g, host):
        return g._replace(host=host)

    groups = [on(grp(0, 4, 8), 0), on(grp(1, 3, 0), 1), on(grp(2, 4, 8), 1)]
    p = plan(snap(groups, 5, oldest=3, pending={4: 8}), POLICY)
    assert [(t.group, t.version, t.source) for t in p.transfers] == [(1, 4, 2)]
    same = [g._replace(host=0) for g in groups]
    p = plan(snap(same, 5, oldest=3, pending={4: 8}), POLICY)
    assert [(t.group, t.version, t.source) for t in p.transfers] == [(1, 4, 0)]  # lowest id
    off = dataclasses.replace(POLICY, prefer_local=False)
    p = plan(snap(groups, 5, oldest=3, pending={4: 8}), off)
    assert [(t.group, t.version, t.source) for t in p.transfers] == [(1, 4, 0)]
    busy = [groups[0], groups[1], groups[2]._replace(busy_ticks=2)]  # still loading: not first
    p = plan(snap(busy, 5, oldest=3, pending={4: 8}), POLICY)
    assert [(t.group, t.version, t.source) for t in p.transfers] == [(1, 4, 0)]


def test_last_holder_of_an_older_version_with_work_is_kept():
    groups = [grp(0, 4, 1), grp(1, 5, 8), grp(2, 5, 8)]
    p = plan(snap(groups, 5, pending={5: 64}), POLICY)
    assert all(t.group != 0 for t in p.transfers)


def test_idle_groups_of_dead_versions_prewarm_the_newest():
    groups = [grp(0, 5, 3), grp(1, 2, 0), grp(2, 3, 0)]
    p = plan(snap(groups, 5), POLICY)
    assert {(t.group, t.version, t.source) for t in p.transfers} == {
        (1, 5, TRAINER),
        (2, 5, TRAINER),
    }
    p = plan(snap(groups, 5), PlanPolicy(rollout_batch_prompts=0, prewarm=False))
    assert p.transfers == ()


def test_targets_follow_pending_work():
    groups = [grp(i, 1, n) for i, n in enumerate([1, 1, 2, 1, 0, 0, 3, 1, 1, 2])]
    p = plan(snap(groups, 2, pending={2: 60}), POLICY)
    # work: v1 12 requests on 8 busy groups, v2 60 pending (8 slots a group: 8 groups usable)
    assert p.targets == {1: 2, 2: 8}
    assert all(t.version == 2 and t.source == TRAINER for t in p.transfers)
    for m in p.migrations:
        assert groups[m.src].version == groups[m.dst].version == 1


def test_supplement_order_latest_then_legacy_idle_slots_only():
    groups = [grp(0, 6, 8), grp(1, 6, 8), grp(2, 5, 1), grp(3, 4, 1)]
    s = snap(groups, 6, in_flight=1, G=2)  # oldest = 4
    pol = PlanPolicy(rollout_batch_prompts=3, legacy_fill_margin=1)
    p = plan(s, pol)
    # the newest version until RBS, then v5 fills its 7 idle slots (3 prompt groups of 2),
    # never v4: the oldest version, the trainer is waiting for it to drain
    assert p.supplements == ((6, 2), (5, 3))
    p = plan(snap(groups, 6, in_flight=1, G=2, room={4: 9, 5: 4, 6: 3}), pol)
    assert p.supplements == ((6, 2), (5, 2))  # v5's room shrinks by what v6 took
    p = plan(s, PlanPolicy(rollout_batch_prompts=3, legacy_fill=False))
    assert p.supplements == ((6, 2),)
    # by default only versions two steps or more from the window's oldest are filled: v5 may be
    # consumed by one more step only, so a request started there now would hold the window up
    assert plan(s, PlanPolicy(rollout_batch_prompts=3)).supplements == ((6, 2),)
    p = plan(snap(groups, 6, oldest=3, in_flight=1, G=2), PlanPolicy(rollout_batch_prompts=3))
    assert p.supplements == ((6, 2), (5, 3))


def test_kv_pressure_moves_the_biggest_requests_within_the_version():
    groups = [
        grp(0, 3, 5, pages=[30, 25, 20, 10, 10]),  # 95 of 100 pages
        grp(1, 3, 1, pages=[10]),
        grp(2, 3, 2, pages=[10, 10]),
        grp(3, 4, 0),
    ]
    policy = PlanPolicy(rollout_batch_prompts=0, prewarm=False, spread=False)
    p = plan(snap(groups, 4, pending={}), policy)
    moved = [(rid, m.src, m.dst) for m in p.migrations for rid in m.request_ids]
    assert moved == [(groups[0].requests[0], 0, 1)]  # 30 pages to the emptiest v3 group


def test_plan_trigger_priorities():
    hot = [grp(0, 1, 1, pages=95)]
    cool = [grp(0, 1, 1, pages=5)]
    kw = dict(kv_pressure_threshold=0.9, period=8)
    assert plan_trigger(new_version=True, groups=cool, ticks_since_plan=0, **kw) == "new_version"
    assert plan_trigger(new_version=False, groups=hot, ticks_since_plan=0, **kw) == "kv_pressure"
    assert plan_trigger(new_version=False, groups=cool, ticks_since_plan=8, **kw) == "period"
    assert plan_trigger(new_version=False, groups=cool, ticks_since_plan=1, **kw) is None
    assert (
        plan_trigger(new_version=False, groups=cool, ticks_since_plan=1, idle_waiting=True, **kw)
        == "idle"
    )


def test_consolidation_packs_an_old_tail_onto_the_groups_its_kv_needs():
    groups = [
        grp(0, 3, 2, pages=20),  # v3: the oldest running version (the gate)
        grp(1, 4, 2, pages=[10, 10]),  # v4: a tail of 60 pages over three groups
        grp(2, 4, 2, pages=[10, 10]),
        grp(3, 4, 2, pages=[10, 10]),
        grp(4, 5, 8, pages=5),
    ]
    p = plan(snap(groups, 5, oldest=3, pending={5: 64}), PlanPolicy(rollout_batch_prompts=0))
    assert p.targets == {3: 1, 4: 1, 5: 3}  # 60 pages fit one group under 0.9 x 100
    assert {t.group for t in p.transfers} == {1, 2} and all(t.version == 5 for t in p.transfers)
    assert {m.dst for m in p.migrations} == {3}  # ties: the lowest ids are emptied first
    p = plan(
        snap(groups, 5, oldest=3, pending={5: 64}),
        PlanPolicy(rollout_batch_prompts=0, consolidate=False),
    )
    assert p.transfers == () and p.targets == {3: 1, 4: 3, 5: 1}


def test_a_version_whose_requests_wait_is_not_consolidated():
    # v1's two running requests would fit one group, but one more request of v1 waits for a
    # slot (its groups' KV reservation refuses it): v1 has no tail yet. The idle group of the
    # dead version 0 goes to v1, not to the newest version, which has nothing to run (found by
    # test_invariants_dora: the idle group waited two planning periods while the request waited)
    groups = [grp(0, 0, 0, slots=2), grp(1, 1, 1, slots=2, pages=1), grp(2, 1, 1, slots=2, pages=1)]
    p = plan(snap(groups, 2, oldest=0, pending={1: 1}), POLICY)
    assert p.targets == {1: 3}
    assert len(p.transfers) == 1 and p.migrations == ()
    t = p.transfers[0]
    assert t.group == 0 and t.version == 1 and t.source in (1, 2)
    # without the waiting request, v1 is a tail and the idle group pre-warms v2
    p = plan(snap(groups, 2, oldest=0), POLICY)
    assert p.targets == {1: 2, 2: 1} and [(t.group, t.version) for t in p.transfers] == [(0, 2)]


def test_a_release_whose_pages_do_not_fit_is_skipped():
    # slots would allow emptying group 1 into group 0, KV pages would not (v1 did it anyway)
    groups = [grp(0, 4, 2, pages=[40, 40]), grp(1, 4, 2, pages=[30, 5]), grp(2, 5, 0)]
    pol = PlanPolicy(rollout_batch_prompts=0, spread=False)
    assert plan(snap(groups, 5, oldest=3, pending={5: 64}), pol).transfers == ()
    loose = plan(snap(groups, 5, oldest=3, pending={5: 64}), PlanPolicy(0, kv_aware=False))
    assert [t.group for t in loose.transfers] == [1]  # slot counting overfills group 0


def test_spare_groups_spread_the_version_the_trainer_waits_for():
    # nothing to dispatch (no pending, no room): v3 is the gate, group 1 idles
    gate = grp(0, 3, 6, pages=[15, 12, 10, 8, 5, 5], slots=8)
    groups = [gate, grp(1, 4, 0), grp(2, 4, 1, pages=3)]
    s = _ready(snap(groups, 4, oldest=3, room={3: 0, 4: 0}))
    assert plan(dataclasses.replace(s, ready=0), PlanPolicy(0)).transfers == ()  # not waiting
    p = plan(s, PlanPolicy(rollout_batch_prompts=0))
    assert [(t.group, t.version, t.source) for t in p.transfers] == [(1, 3, 0)]  # from its peer
    assert p.targets == {3: 2, 4: 1} and p.notes
    assert plan(s, PlanPolicy(rollout_batch_prompts=0, spread=False)).transfers == ()
    # once group 1 holds v3, the next plan evens the gate's pages out over both groups
    after = _ready(snap([gate, grp(1, 3, 0), groups[2]], 4, oldest=3, room={3: 0, 4: 0}))
    p = plan(after, PlanPolicy(rollout_batch_prompts=0))
    moved = sum(
        pg
        for m in p.migrations
        for pg in (gate.request_pages[gate.requests.index(r)] for r in m.request_ids)
    )
    assert all((m.src, m.dst) == (0, 1) for m in p.migrations) and 15 <= moved <= 30


def test_idle_trigger_and_hysteresis():
    busy, idle = grp(0, 4, 3, pages=95), grp(1, 5, 0)
    assert idle_group_waiting([busy, idle], {})  # it could take over some of group 0's load
    assert idle_group_waiting([grp(0, 4, 1), idle], {4: 3})  # work waits for another version
    assert not idle_group_waiting([grp(0, 4, 1), idle], {})
    assert not idle_group_waiting([busy, idle], {5: 2})  # its own version has work: admission
    kw = dict(groups=[busy, idle], kv_pressure_threshold=0.9, ticks_since_plan=1, period=8)
    assert plan_trigger(new_version=False, **kw) == "kv_pressure"
    muted = {"kv_pressure": trigger_key("kv_pressure", [busy, idle], {}, 0.9)}
    assert plan_trigger(new_version=False, idle_waiting=True, muted=muted, **kw) == "idle"
    assert plan_trigger(new_version=True, muted=muted, **kw) == "new_version"  # never muted
    muted["idle"] = trigger_key("idle", [busy, idle], {}, 0.9)
    assert plan_trigger(new_version=False, idle_waiting=True, muted=muted, **kw) is None
    assert plan_trigger(new_version=False, muted=muted, **{**kw, "ticks_since_plan": 8}) == "period"
    # something changed (group 1 now holds v4, so v4 has room): the KV trigger fires again
    kw["groups"] = [busy, grp(1, 4, 0)]
    assert plan_trigger(new_version=False, muted=muted, **kw) == "kv_pressure"


def _apply(s: Snapshot, p):
    """Carry ``p`` out on the snapshot's bookkeeping: where every request is and how many pages
    and requests each group holds; asserts each migration finds its requests at its source."""
    where = {rid: g.group for g in s.groups for rid in g.requests}
    size = {rid: pg for g in s.groups for rid, pg in zip(g.requests, g.request_pages, strict=True)}
    kv = {g.group: g.kv_pages_used for g in s.groups}
    n = {g.group: len(g.requests) for g in s.groups}
    for m in p.migrations:
        for rid in m.request_ids:
            assert where[rid] == m.src, (rid, m)
            where[rid] = m.dst
            kv[m.src] -= size[rid]
            kv[m.dst] += size[rid]
            n[m.src] -= 1
            n[m.dst] += 1
    return where, kv, n


@st.composite
def snapshots(draw):
    k = draw(st.integers(0, 3))
    latest = draw(st.integers(k, 8))
    oldest = latest - k
    n_groups = draw(st.integers(1, 12))
    slots = draw(st.integers(1, 8))
    groups = []
    for gid in range(n_groups):
        v = draw(st.integers(max(0, oldest - 1), latest))  # oldest - 1: a dead version
        n = draw(st.integers(0, slots)) if v >= oldest else 0
        pages = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
        busy = draw(st.sampled_from([0, 0, 0, 3]))
        groups.append(grp(gid, v, n, slots=slots, pages=pages, busy=busy, kv_total=slots * 20))
    held = {g.version for g in groups}
    pend = draw(st.dictionaries(st.sampled_from(sorted(held | {latest})), st.integers(0, 40)))
    room = {v: draw(st.integers(0, 10)) for v in range(oldest, latest + 1)}
    return snap(
        groups,
        latest,
        oldest=oldest,
        pending=pend,
        in_flight=draw(st.integers(0, 6)),
        room=room,
        G=draw(st.integers(1, 4)),
    )


@given(s=snapshots(), rbs=st.integers(0, 8), thr=st.sampled_from([0.5, 0.9, 1.0]))
@settings(max_examples=250, deadline=None)
def test_plan_is_always_executable(s, rbs, thr):
    """Whatever the snapshot: migrations stay inside a version, emptied groups are empty,
    sources hold the version, no slot is overbooked, supplements respect order and room."""
    p = plan(s, PlanPolicy(rollout_batch_prompts=rbs, kv_pressure_threshold=thr))
    by_id = {g.group: g for g in s.groups}
    moved_groups = {t.group for t in p.transfers}
    where = {rid: g.group for g in s.groups for rid in g.requests}
    seen: set[int] = set()
    delta = {g.group: 0 for g in s.groups}
    for m in p.migrations:
        assert m.src != m.dst and by_id[m.src].version == by_id[m.dst].version
        assert m.dst not in moved_groups
        for rid in m.request_ids:
            assert where[rid] == m.src and rid not in seen  # each request moves once, from home
            seen.add(rid)
        delta[m.src] -= len(m.request_ids)
        delta[m.dst] += len(m.request_ids)
    assert all(delta[g] <= by_id[g].free_slots for g in delta)
    assert len(moved_groups) == len(p.transfers)
    for t in p.transfers:
        g = by_id[t.group]
        assert t.version != g.version
        assert set(g.requests) <= seen  # emptied before its version changes
        if t.source == TRAINER:
            assert t.version == s.latest
        else:
            assert by_id[t.source].version == t.version and t.source not in moved_groups
    assert sum(p.targets.values()) == len(s.groups)
    assert all(n > 0 for _, n in p.supplements)
    versions = [v for v, _ in p.supplements]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    assert all(v == s.latest or s.oldest < v < s.latest for v in versions)
    total = 0
    for v, n in p.supplements:  # dispatching at v also uses the room of every older version
        total += n
        assert total <= s.room.get(v, 0)


@given(
    s=snapshots(),
    rbs=st.integers(0, 8),
    thr=st.sampled_from([0.5, 0.9, 1.0]),
    spread=st.booleans(),
    consolidate=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_planner_v2_properties(s, rbs, thr, spread, consolidate):
    """No plan overfills a destination's KV pages, none migrates across versions, and
    consolidation never gives an old version more groups than it holds."""
    pol = PlanPolicy(rbs, kv_pressure_threshold=thr, spread=spread, consolidate=consolidate)
    p = plan(s, pol)
    by_id = {g.group: g for g in s.groups}
    where, kv, n = _apply(s, p)
    moved = {t.group for t in p.transfers}
    for t in p.transfers:
        assert n[t.group] == 0  # emptied before its version changes
    for m in p.migrations:  # never across versions, never onto a group changing version
        assert by_id[m.src].version == by_id[m.dst].version and m.dst not in moved
    for g in {m.dst for m in p.migrations}:
        limit = thr * by_id[g].kv_pages_total
        assert kv[g] <= max(limit, by_id[g].kv_pages_used), (g, kv[g], limit)
        assert n[g] <= len(by_id[g].requests) + by_id[g].free_slots
    held = {}
    for g in s.groups:
        held[g.version] = held.get(g.version, 0) + 1
    gate = min((g.version for g in s.groups if g.requests), default=None)
    for v, count in held.items():
        if v >= s.latest or s.pending.get(v):
            continue  # the newest version, or an older one with requests waiting to start
        pages = sum(g.kv_pages_used for g in s.groups if g.version == v)
        busy = sum(1 for g in s.groups if g.version == v and g.requests)
        overfull = pages > by_id[s.groups[0].group].kv_pages_total * busy
        if v == gate and (spread or overfull):
            continue  # the gate may take spare groups, or more room for its parked requests
        assert p.targets.get(v, 0) <= count, (v, p.targets, held)


def test_plan_is_pure():
    groups = [grp(0, 4, 1), grp(1, 4, 1), grp(2, 4, 6), grp(3, 4, 7)]
    s = snap(groups, 5, pending={5: 16})
    assert plan(s, POLICY) == plan(s, POLICY)
    assert s.groups == tuple(groups)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
