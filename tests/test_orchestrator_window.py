"""Version window (staleness bound K), transfer queue and the request ledger."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.orchestrator import FinishedRequest, TransferQueue, VersionWindow, WindowError
from dora_jax.orchestrator.rollout_manager import LedgerError, RolloutManager, SyntheticPrompts


def test_room_and_staleness_definition():
    w = VersionWindow(k=2, per_step=4)
    assert w.consume_version == 0 and w.oldest == -2
    assert w.room(0) == 12  # steps at v0, v1, v2 may take a v0 prompt group
    w.add(0, 10)
    assert w.room(0) == 2
    with pytest.raises(WindowError):
        w.add(0, 3)
    w.begin_step([0] * 4)  # the step at v0 runs: the next batch goes to the step at v1
    assert w.training and w.consume_version == 1 and w.staleness(0) == 1
    assert w.room(0) == 8 - 6
    w.publish(1)
    assert w.latest == 1 and not w.training
    assert w.room(1) == 12 - 6 and w.room(0) == 8 - 6
    assert w.room(5) == 0  # does not exist yet


def test_can_step_waits_for_the_oldest_version():
    w = VersionWindow(k=1, per_step=2)
    w.add(0, 3)
    w.begin_step([0, 0])
    w.publish(1)
    w.add(1, 2)
    # at v1 with K=1 the last v0 prompt group must be in this batch
    assert not w.can_step([1, 1])
    assert w.can_step([0, 1])
    with pytest.raises(WindowError):
        w.begin_step([1, 1])
    w.begin_step([0, 1])
    assert w.live_versions() == [1]


def test_can_step_keeps_later_steps_feasible():
    """Taking a younger ready batch may strand older prompt groups beyond later steps."""
    w = VersionWindow(k=2, per_step=2)
    w.add(0, 4)
    w.add(0, 2)  # room(0) was 6: three steps' worth of v0
    assert not w.can_step([0])  # would leave 5 v0 groups for the steps at v1, v2: room for 4
    assert w.can_step([0, 0])


@given(
    k=st.integers(0, 3),
    per_step=st.integers(1, 4),
    ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6)), min_size=1, max_size=40),
)
@settings(max_examples=60, deadline=None)
def test_window_never_deadlocks_and_bounds_staleness(k, per_step, ops):
    """Dispatch within room; the trainer always takes the oldest per_step open prompt groups as
    soon as they finish. That batch is always allowed, and staleness never exceeds K."""
    w = VersionWindow(k, per_step)
    open_groups: list[int] = []  # versions, dispatch order
    for back, n in ops:
        version = max(0, w.latest - back)
        n = min(n, w.room(version))
        if n:
            w.add(version, n)
            open_groups += [version] * n
        if len(open_groups) >= per_step:
            open_groups.sort()
            batch, open_groups = open_groups[:per_step], open_groups[per_step:]
            assert w.can_step(batch)
            assert all(w.latest - u <= k for u in batch)
            w.begin_step(batch)
            w.publish(w.latest + 1)
        assert len(w.live_versions()) <= k + 1
        assert all(u >= w.oldest for u in w.live_versions())


def _fr(rid: int, pg: int, n: int = 5) -> FinishedRequest:
    return FinishedRequest(rid, pg, 8, n, (0,))


def test_queue_ready_when_all_g_done_and_oldest_first():
    q = TransferQueue(group_size=2)
    q.open(0, 3)
    q.open(1, 2)
    q.open(2, 3)
    assert q.add(_fr(0, 0), tick=1) is None
    assert q.add(_fr(1, 0), tick=2).prompt_group == 0
    q.add(_fr(4, 2), 3)
    q.add(_fr(5, 2), 4)
    q.add(_fr(2, 1), 5)
    q.add(_fr(3, 1), 6)
    assert [rg.prompt_group for rg in q.select(3)] == [1, 0, 2]  # v2 first, then ready order
    taken = q.take(q.select(2), trainer_version=4, tick=7)
    assert [rg.version for rg in taken] == [2, 3]
    assert sorted(c.staleness for c in q.consumed) == [1, 1, 2, 2]
    with pytest.raises(ValueError):
        q.add(_fr(9, 7), 8)


def test_ledger_rejects_ending_twice():
    w = VersionWindow(k=1, per_step=1)
    q = TransferQueue(group_size=2)
    m = RolloutManager(2, SyntheticPrompts(0), w, q)
    (pg,) = m.dispatch(0, 1)
    assert m.members(pg) == (0, 1) and m.pending_count(0) == 2
    m._move(0, "running")
    with pytest.raises(LedgerError):
        m._move(0, "consumed")  # running -> consumed skips finished
    m._move(0, "finished")
    m._move(0, "consumed")
    with pytest.raises(LedgerError):
        m._move(0, "consumed")
    with pytest.raises(LedgerError):
        m._move(0, "discarded")


def test_upgrade_unstarted_retags_within_the_bound():
    w = VersionWindow(k=2, per_step=2)
    q = TransferQueue(group_size=2)
    m = RolloutManager(2, SyntheticPrompts(0), w, q)
    m.dispatch(0, 3)
    w.begin_step([])  # an empty step just to advance versions in this unit test
    w.publish(1)
    m._started.add(1)  # prompt group 1 has a request running: it stays at v0
    assert m.upgrade_unstarted(1) == 2
    assert w.open_count(0) == 1 and w.open_count(1) == 2
    assert m.pending_count(1) == 4 and all(s.version == 1 for s in m.pending[1])
