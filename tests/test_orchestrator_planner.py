"""The pure planner: allocation, reassignment, weight sources, migrations, supplements."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.orchestrator import TRAINER, GroupInfo, PlanPolicy, Snapshot, allocate, plan
from dora_jax.orchestrator.planner import plan_trigger

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
    assert p.migrations == () and p.targets == {4: 3, 5: 1}


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
    p = plan(s, PlanPolicy(rollout_batch_prompts=3))
    # the newest version until RBS, then v5 fills its 7 idle slots (3 prompt groups of 2),
    # never v4: the oldest version, the trainer is waiting for it to drain
    assert p.supplements == ((6, 2), (5, 3))
    p = plan(snap(groups, 6, in_flight=1, G=2, room={4: 9, 5: 4, 6: 3}), PlanPolicy(3))
    assert p.supplements == ((6, 2), (5, 2))  # v5's room shrinks by what v6 took
    p = plan(s, PlanPolicy(rollout_batch_prompts=3, legacy_fill=False))
    assert p.supplements == ((6, 2),)


def test_kv_pressure_moves_the_biggest_requests_within_the_version():
    groups = [
        grp(0, 3, 5, pages=[30, 25, 20, 10, 10]),  # 95 of 100 pages
        grp(1, 3, 1, pages=[10]),
        grp(2, 3, 2, pages=[10, 10]),
        grp(3, 4, 0),
    ]
    p = plan(snap(groups, 4, pending={}), PlanPolicy(rollout_batch_prompts=0, prewarm=False))
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
    return snap(groups, latest, oldest=oldest, pending=pend, in_flight=draw(st.integers(0, 6)),
                room=room, G=draw(st.integers(1, 4)))  # fmt: skip


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


def test_plan_is_pure():
    groups = [grp(0, 4, 1), grp(1, 4, 1), grp(2, 4, 6), grp(3, 4, 7)]
    s = snap(groups, 5, pending={5: 16})
    assert plan(s, POLICY) == plan(s, POLICY)
    assert s.groups == tuple(groups)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
