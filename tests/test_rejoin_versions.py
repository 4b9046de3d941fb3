"""A rollout host that comes back after every group holding a version was lost with it: its
groups load the newest version, and the older one stays needed (kept by the trainer, sendable to
a group) for the requests that must finish under it. Before, the rejoined groups' new version
replaced the lost one in the backend's books: no group could be given it, and a run whose every
rollout group was on that host stepped empty groups forever."""

from concurrent.futures import Future
from types import SimpleNamespace

from dora_jax.execution.books import Books
from dora_jax.execution.recovery import GroupRecovery


def done() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


def backend(versions: list[int], hosts: list[int], published: int) -> GroupRecovery:
    """The recovery of an engine backend (no engines): groups on ``hosts`` holding
    ``versions``, the trainer at ``published``; the commands sent are in ``groups.sent``."""
    n = len(versions)
    sent: list = []
    groups = SimpleNamespace(
        handles=[None] * n,
        hosts=list(hosts),
        loads=[done() for _ in range(n)],
        me=0,
        cluster=None,
        published=published,
        sent=sent,
        trainer_params=lambda v: {"v": v},
        trainer_source=lambda g, v, params: {"params": params},
        send=lambda g, cmd: (sent.append((g, cmd)), done())[1],
    )
    books = Books(n)
    books.versions[:] = versions
    rollout = SimpleNamespace(backup_every_steps=0, max_group_restarts=0)
    return GroupRecovery(groups, books, rollout)


def test_a_version_only_lost_groups_held_stays_needed_after_they_rejoin():
    # every group on host 1; v3 and v4 in flight, v5 published
    b = backend([3, 3, 4, 4], [1, 1, 1, 1], published=5)
    for g in range(4):
        b._set_state(g, "dead", "process 1 is gone")
    assert b.sendable_versions() == {3, 4} and b.versions_held() == {3, 4}
    b._rejoined(1, None)  # its engines are built again: each loads v5 from the trainer
    assert b.books.versions == [5, 5, 5, 5] and [cmd.version for _, cmd in b.groups.sent] == [
        5,
        5,
        5,
        5,
    ]
    for g in range(4):
        b._set_state(g, "healthy", "v5 loaded")
    # v3 and v4 are still the versions of their prompt groups' remaining requests
    assert b.versions_held() == {3, 4, 5}
    assert b.sendable_versions() == {3, 4}
    # a group in the run holds v4 again: v4 is no longer the trainer's to send
    b.books.versions[0] = 4
    assert b.sendable_versions() == {3} and b.versions_held() == {3, 4, 5}


def test_a_version_another_group_still_holds_is_not_orphaned():
    b = backend([3, 3, 3, 4], [0, 0, 1, 1], published=4)
    b._set_state(2, "dead", "process 1 is gone")
    b._set_state(3, "dead", "process 1 is gone")
    b._rejoined(1, None)
    for g in (2, 3):
        b._set_state(g, "healthy", "v4 loaded")
    assert b.sendable_versions() == set() and b.versions_held() == {3, 4}


class OutOfGroups:
    """The part of a backend NoRolloutGroups reads: groups in the run and those out of it."""

    def __init__(self, n: int, lost: list[int]):
        self.state, self.lost = ["healthy"] * n, lost
        self.recovery = self

    def groups(self):
        return [g for g, s in enumerate(self.state) if s == "healthy"]

    def out_of_run(self):
        return {g: s for g, s in enumerate(self.state) if s != "healthy"}

    def lost_hosts(self):
        return self.lost


def test_a_run_with_no_rollout_group_counts_down_then_stops(tmp_path):
    from dora_jax.config import load_config
    from dora_jax.pipeline.health import NoRolloutGroups

    cfg = load_config(None, ["orchestrator.no_groups_wait_s=100"])
    backend, t, said = OutOfGroups(2, [1]), [0.0], []
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "process_1.cmd").write_text("python launch/train.py ...\n")
    wait = NoRolloutGroups(
        SimpleNamespace(cfg=cfg, backend=backend), tmp_path, said.append, lambda: t[0]
    )

    def at(seconds: float) -> bool:
        t[0] = seconds
        return wait()

    assert not at(0) and not said  # groups in the run: nothing to say
    backend.state = ["dead", "dead"]
    assert not at(10) and said[-1].startswith("warning: no rollout group is left in the run")
    assert "(process 1 is gone): waiting up to 100 s for process 1 to be started again" in said[-1]
    assert str(tmp_path / "logs" / "process_1.cmd") in said[-1]
    assert not at(45) and said[-1].startswith("waiting 65 s more for process 1")
    backend.state = ["restarting", "dead"]  # it is coming back: the countdown holds
    assert not at(200) and len(said) == 2
    backend.state = ["dead", "dead"]  # (its engines failed to build): a new countdown
    assert not at(210) and not at(309) and wait.tripped is None
    assert at(310) and wait.tripped.startswith("no rollout group is left in the run")
    assert "none came back in 100 s (orchestrator.no_groups_wait_s)" in wait.tripped


class Link:
    """The part of the cluster link the recovery reads: hosts lost, leaving and joined."""

    def __init__(self, lost=None, joined=()):
        self.lost, self.joined = dict(lost or {}), list(joined)

    def take_leaving(self):
        return {}

    def take_joined(self):
        out, self.joined = self.joined, []
        return out


def with_requests(b: GroupRecovery, members: dict[int, list[int]], link: Link) -> GroupRecovery:
    """``b`` with requests in its groups and a cluster whose link is ``link``."""
    for g, rids in members.items():
        for rid in rids:
            b.books.join(rid, g)
    b._recover = lambda rid, version, *sources: (rid, version)
    b.started = []
    b.groups.cluster = SimpleNamespace(
        link=link, start_host=lambda host: (b.started.append(host), Future())[1]
    )
    return b


def test_a_host_lost_and_back_between_two_rounds_is_lost_first():
    """Process 1 died and was started again before the control plane looked (its loss and its
    return both waiting): its groups' requests go on elsewhere, as for a loss seen in time,
    before the groups rebuild; a group whose rejoin was cut short so is counted lost again."""
    b = with_requests(backend([3, 3, 4], [0, 1, 1], published=4), {1: [10, 11], 2: [12]}, Link())
    b.groups.cluster.link.joined = [1]
    b.hosts_changed()
    assert sorted(b.recovered) == [(10, 3), (11, 3), (12, 4)]  # from their prompts
    assert b.books.members[1] == b.books.members[2] == {}
    assert [(h.group, h.state) for h in b._health] == [
        (1, "dead"),
        (2, "dead"),
        (1, "restarting"),
        (2, "restarting"),
    ]
    assert b.host_losses == [0, 1, 1] and b._state == ["healthy", "restarting", "restarting"]
    assert b.started == [1]
    # lost again while rebuilding, and back again, unseen: a second loss, nothing to recover
    b._health, b.recovered = [], []
    b.groups.cluster.link.joined = [1]
    b.hosts_changed()
    assert b.host_losses == [0, 2, 2] and b.recovered == []
    assert [h.state for h in b._health] == ["dead", "dead", "restarting", "restarting"]
    assert b.started == [1, 1]


def test_returns_and_losses_queued_between_two_rounds_are_each_counted_once():
    """Seen lost; then back, lost, back (two returns queued): one more loss (the first return
    leaves no row of its own), one build. Then
    back and lost again before the round: restarting, then dead, and nothing to build."""
    b = with_requests(backend([3, 3], [0, 1], published=3), {1: [7]}, Link(lost={1: "killed"}))
    b.hosts_changed()  # the loss, seen
    assert b.recovered == [(7, 3)] and b._state == ["healthy", "dead"]
    b._health = []
    b.groups.cluster.link.lost, b.groups.cluster.link.joined = {}, [1, 1]
    b.hosts_changed()
    assert [h.state for h in b._health] == ["dead", "restarting"]
    assert b.host_losses == [0, 2] and b.started == [1]
    b.groups.cluster.link.lost = {1: "killed"}
    b.hosts_changed()  # lost again, seen
    b._health = []
    b.groups.cluster.link.lost, b.groups.cluster.link.joined = {1: "killed again"}, [1]
    b.hosts_changed()
    assert [(h.state, h.reason) for h in b._health] == [
        ("restarting", "process 1 is back: building its engines"),
        ("dead", "process 1 is gone: killed again"),
    ]
    assert b.host_losses == [0, 4] and b.started == [1] and 1 not in b._rejoining
    b._health = []
    b.hosts_changed()  # the same loss, already handled
    assert b._health == [] and b.host_losses == [0, 4]
