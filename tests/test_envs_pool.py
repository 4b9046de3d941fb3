"""Environment episodes in worker processes: a raising, hanging (past its timeout), junk-returning
and dying environment each end their own episode, counted once by kind, while the pool and the
other episodes go on, including episodes that shared the killed worker (rebuilt by replay)."""

import json
import os
import textwrap
import time

import pytest

from dora_jax.envs import EnvPool, EnvPoolError

FLAKY = textwrap.dedent("""
    import os, time

    class Flaky:
        stop_strings = ("</call>",)

        def __init__(self, greeting="start"):
            self.greeting = greeting

        def reset(self, seed, task):
            self.n = 0
            self.noise = os.urandom(4).hex() if task.get("random") else ""
            if task.get("fail"):
                raise LookupError("no such task")
            return f"{self.greeting} {seed}{self.noise}", {"pid": os.getpid()}

        def step(self, action_text):
            self.n += 1
            if action_text == "hang":
                time.sleep(60)
            if action_text == "nap":
                time.sleep(1.0)
            if action_text == "raise":
                raise RuntimeError("the tool broke")
            if action_text == "junk":
                return "obs", float("nan"), False, False, {}
            if action_text == "die":
                os._exit(3)
            return f"{action_text} {self.n}", 1.0, self.n >= 3, False, {"pid": os.getpid()}

    class Broken:
        def __init__(self):
            raise OSError("the game server is down")

        def reset(self, seed, task):
            return "", {}

        def step(self, action_text):
            return "", 0.0, True, False, {}
""")


@pytest.fixture
def flaky(tmp_path):
    path = tmp_path / "flaky_env.py"
    path.write_text(FLAKY)
    return f"{path}:Flaky"


def test_every_failure_ends_only_its_episode_and_is_counted_once(flaky):
    pool = EnvPool(flaky, {"greeting": "hello"}, workers=2, timeout_s=1.0)
    try:
        assert pool.stop_strings == ("</call>",)
        eps = {}
        for name in ("a", "hang", "raise", "junk", "die", "f"):
            eid, fut = pool.reset(5, {})
            first = fut.result(timeout=30)
            assert first.error is None and first.step.observation == "hello 5"
            eps[name] = eid
        t0 = time.monotonic()
        futs = {name: pool.step(eid, "ok" if name in "af" else name) for name, eid in eps.items()}
        assert time.monotonic() - t0 < 0.5, "submitting a call waited for the environment"
        outs = {name: f.result(timeout=30) for name, f in futs.items()}
        assert {n: o.error for n, o in outs.items()} == {
            "a": None,
            "hang": "timeout",
            "raise": "exception",
            "junk": "invalid",
            "die": "crash",
            "f": None,
        }
        assert "the tool broke" in outs["raise"].message and "nan" in outs["junk"].message
        assert outs["hang"].seconds >= 1.0 and outs["a"].step.observation == "ok 1"
        assert outs["a"].step.info["pid"] != os.getpid()
        assert dict(pool.errors) == {"timeout": 1, "exception": 1, "invalid": 1, "crash": 1}
        for name in ("hang", "raise", "junk", "die"):
            with pytest.raises(EnvPoolError, match=r"has ended \("):
                pool.step(eps[name], "ok")
        # "a" and "f" shared the workers that were killed: their state comes back by replay
        for step_no in (2, 3):
            again = [pool.step(eps[n], "ok").result(timeout=30) for n in ("a", "f")]
            assert [o.error for o in again] == [None, None]
            assert [o.step.observation for o in again] == [f"ok {step_no}"] * 2
        assert again[0].step.terminated
        assert dict(pool.errors) == {"timeout": 1, "exception": 1, "invalid": 1, "crash": 1}
        kinds = [(op, kind) for op, kind, _, _ in pool.spans]
        assert kinds.count(("step", "timeout")) == 1 and kinds.count(("reset", "ok")) == 6
        assert all(t1 >= t0 for _, _, t0, t1 in pool.spans)
    finally:
        pool.close()
        pool.close()  # twice is fine


def test_a_hanging_call_does_not_hold_up_episodes_on_other_workers(flaky):
    pool = EnvPool(flaky, None, workers=2, timeout_s=3.0)
    try:
        slow, fut = pool.reset(0, {})
        fast, fut2 = pool.reset(0, {})
        fut.result(timeout=30), fut2.result(timeout=30)
        hung = pool.step(slow, "hang")
        t0 = time.monotonic()
        quick = pool.step(fast, "ok").result(timeout=30)
        assert quick.error is None and time.monotonic() - t0 < 2.0 and not hung.done()
        assert hung.result(timeout=30).error == "timeout"
    finally:
        pool.close()


def test_hanging_calls_on_several_workers_time_out_together(flaky):
    """A round of calls that all hang, one per worker, takes about one timeout, not their sum:
    the dispatcher waits on every deadline at once, and a call that first replays its episode
    on a worker that does not hold it (a prompt group's conversations forked from one reset, or
    episodes that lived on a killed worker) gets its own full timeout after the replay, not one
    stretched by a timeout per replayed action (it was ``timeout x (2 + actions)``)."""
    timeout, n = 1.0, 4
    pool = EnvPool(flaky, None, workers=n, timeout_s=timeout)
    try:
        eid, fut = pool.reset(0, {})
        fut.result(timeout=60)
        for _ in range(2):  # two actions to replay
            assert pool.step(eid, "ok").result(timeout=60).error is None
        state = pool.episode_state(eid)
        pool.finish(eid)
        forks = [pool.adopt(state) for _ in range(n)]  # one per worker, none held yet
        t0 = time.monotonic()
        outs = [f.result(timeout=120) for f in [pool.step(e, "hang") for e in forks]]
        elapsed = time.monotonic() - t0
        assert [o.error for o in outs] == ["timeout"] * n
        # serialised: n x timeout = 4 s or more (stretched: 4 s each); together: about 1 s
        assert elapsed < 0.5 * n * timeout, elapsed
        assert all(o.seconds < 2 * timeout for o in outs), [o.seconds for o in outs]
    finally:
        pool.close()


def test_hanging_calls_queued_on_one_worker_time_out_together(flaky):
    """Episodes that live on one worker: their hanging calls do not wait in its queue one
    timeout each (they did: n x timeout), they move to workers started for them and time out
    together; with ``max_workers`` 0 the pool keeps to its one worker and they do queue."""
    timeout, n = 2.0, 4
    for max_workers, bound in ((n, 2.0 * timeout), (0, None)):
        pool = EnvPool(flaky, None, workers=1, timeout_s=timeout, max_workers=max_workers)
        try:
            eps = [pool.reset(0, {}) for _ in range(n)]
            assert [f.result(timeout=60).error for _, f in eps] == [None] * n
            t0 = time.monotonic()
            outs = [f.result(timeout=120) for f in [pool.step(e, "hang") for e, _ in eps]]
            elapsed = time.monotonic() - t0
            assert [o.error for o in outs] == ["timeout"] * n
            if bound is not None:
                assert elapsed < bound, elapsed
                assert len(pool._workers) == n and pool.moved == n - 1
            else:
                assert elapsed >= n * timeout and len(pool._workers) == 1 and pool.moved == 0
        finally:
            pool.close()


def test_a_call_moved_off_a_busy_worker_goes_on_from_its_episode(flaky):
    """A call waiting behind another episode's hanging call moves to a worker started for it,
    which rebuilds its episode by replay: its results go on as if it had stayed, and the worker
    it left no longer holds it (a later call there would replay it, never reuse the stale
    instance)."""
    pool = EnvPool(flaky, None, workers=1, timeout_s=4.0, max_workers=2)  # moves after 1 s
    try:
        stuck, f1 = pool.reset(0, {})
        moved, f2 = pool.reset(0, {})
        f1.result(timeout=60), f2.result(timeout=60)
        assert pool.step(moved, "ok").result(timeout=30).step.observation == "ok 1"
        hung = pool.step(stuck, "hang")
        t0 = time.monotonic()
        out = pool.step(moved, "ok").result(timeout=30)
        assert out.step.observation == "ok 2" and time.monotonic() - t0 < 3.5
        assert not hung.done() and pool.moved == 1 and pool._episodes[moved].worker == 1
        with pool._lock:  # its instance on worker 0 is freed as soon as that worker is free
            left = pool._workers[0].queue
            assert [(j.op, j.episode) for j in left] == [("close", moved)]
        assert hung.result(timeout=30).error == "timeout"
        assert pool.step(moved, "ok").result(timeout=30).step.terminated  # "ok 3"
    finally:
        pool.close()


def test_an_episode_that_cannot_be_replayed_ends_crash(flaky):
    pool = EnvPool(flaky, None, workers=1, timeout_s=1.0)
    try:
        noisy, f1 = pool.reset(0, {"random": True})
        steady, f2 = pool.reset(0, {})
        hang, f3 = pool.reset(0, {})
        assert [f.result(timeout=30).error for f in (f1, f2, f3)] == [None] * 3
        assert pool.step(hang, "hang").result(timeout=30).error == "timeout"
        lost = pool.step(noisy, "ok").result(timeout=30)
        assert lost.error == "crash" and "not a pure function" in lost.message
        assert pool.step(steady, "ok").result(timeout=30).step.observation == "ok 1"
        failed_reset = pool.reset(0, {"fail": True})[1].result(timeout=30)
        assert failed_reset.error == "exception" and "no such task" in failed_reset.message
        assert dict(pool.errors) == {"timeout": 1, "crash": 1, "exception": 1}
        pool.finish(steady)
        assert pool.live_episodes() == 0
    finally:
        pool.close()


def test_a_call_on_a_busy_or_unknown_episode_is_refused(flaky):
    pool = EnvPool(flaky, None, workers=1, timeout_s=5.0)
    try:
        eid, fut = pool.reset(0, {})
        fut.result(timeout=30)
        napping = pool.step(eid, "nap")
        with pytest.raises(EnvPoolError, match="already has a call running"):
            pool.step(eid, "ok")
        assert napping.result(timeout=30).step.observation == "nap 1"
        with pytest.raises(EnvPoolError, match="episode 99 is unknown"):
            pool.step(99, "ok")
    finally:
        pool.close()
    late = pool.reset(0, {})[1].result(timeout=5)
    assert late.error == "crash" and "closed" in late.message


def test_workers_that_cannot_start_fail_the_pool_with_one_line(tmp_path):
    path = tmp_path / "flaky_env.py"
    path.write_text(FLAKY)
    with pytest.raises(EnvPoolError, match=r"flaky_env\.py:Broken\(\) raised OSError: the game"):
        EnvPool(f"{path}:Broken", None, workers=1, timeout_s=1.0)


def test_episode_state_forks_an_episode_and_moves_it_to_another_pool(flaky):
    pool = EnvPool(flaky, None, workers=2, timeout_s=5.0)
    other = None
    try:
        eid, fut = pool.reset(7, {"tag": "x"})
        assert fut.result(timeout=30).step.observation == "start 7"
        assert pool.step(eid, "ok").result(timeout=30).step.observation == "ok 1"
        state = pool.episode_state(eid)
        assert set(state) == {"seed", "task", "actions", "digest"}
        assert state["seed"] == 7 and state["task"] == {"tag": "x"} and state["actions"] == ["ok"]
        assert json.loads(json.dumps(state)) == state and state["digest"]
        forks = [pool.adopt(state) for _ in range(3)]
        pool.finish(eid)
        assert pool.live_episodes() == 3 and len(set(forks)) == 3
        outs = [pool.step(f, f"go{i}").result(timeout=30) for i, f in enumerate(forks)]
        assert [o.step.observation for o in outs] == ["go0 2", "go1 2", "go2 2"]
        assert len({o.step.info["pid"] for o in outs}) == 2  # spread over both workers
        assert pool.episode_state(forks[1])["actions"] == ["ok", "go1"]
        # a checkpoint's episode, restored into a fresh pool
        moved = pool.episode_state(forks[2])
        other = EnvPool(flaky, None, workers=1, timeout_s=5.0)
        again = other.adopt(moved)
        assert other.step(again, "ok").result(timeout=30).step.observation == "ok 3"
        assert dict(pool.errors) == {} and dict(other.errors) == {}
        # an episode that does not replay to its digest ends crash on its next call
        bad = other.adopt({**moved, "digest": "0" * 40})
        lost = other.step(bad, "ok").result(timeout=30)
        assert lost.error == "crash" and "not a pure function" in lost.message
    finally:
        pool.close()
        if other is not None:
            other.close()


def test_episode_state_is_refused_while_a_call_runs_or_after_the_end(flaky):
    pool = EnvPool(flaky, None, workers=1, timeout_s=5.0)
    try:
        eid, fut = pool.reset(0, {})
        fut.result(timeout=30)
        napping = pool.step(eid, "nap")
        with pytest.raises(EnvPoolError, match="has a call running"):
            pool.episode_state(eid)
        napping.result(timeout=30)
        assert pool.episode_state(eid)["actions"] == ["nap"]
        assert pool.step(eid, "raise").result(timeout=30).error == "exception"
        with pytest.raises(EnvPoolError, match=r"has ended \(exception\)"):
            pool.episode_state(eid)
        with pytest.raises(EnvPoolError, match="episode 99 is unknown"):
            pool.episode_state(99)
        with pytest.raises(EnvPoolError, match="not an episode state"):
            pool.adopt({"seed": 0, "task": {}})
    finally:
        pool.close()


def test_an_episode_finished_while_its_call_waits_is_not_run(flaky):
    pool = EnvPool(flaky, None, workers=1, timeout_s=5.0)
    try:
        eid, fut = pool.reset(0, {})
        fut.result(timeout=30)
        fork = pool.adopt(pool.episode_state(eid))
        napping = pool.step(eid, "nap")  # the one worker is busy for a second
        queued = pool.step(fork, "ok")
        waiting, reset_fut = pool.reset(2, {})
        pool.finish(fork)
        pool.finish(waiting)
        assert napping.result(timeout=30).step.observation == "nap 1"
        assert queued.result(timeout=30).error == "crash"
        assert reset_fut.result(timeout=30).error == "crash"
        assert dict(pool.errors) == {}  # not counted: nobody waits for these
        assert pool.step(eid, "ok").result(timeout=30).step.observation == "ok 2"
        assert pool.reset(3, {})[1].result(timeout=30).error is None
    finally:
        pool.close()
