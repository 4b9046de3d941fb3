"""The simulator's rollout groups that fail (``sim/failures.py``): a failed group's requests start
again from their prompts on groups of their own version, the group is out for its restart time,
then loads the newest version and takes work; and the stop-and-resume model against it."""

from pathlib import Path

import pytest

from dora_jax.config.schema import ConfigError
from dora_jax.sim.config import FailureConfig, load_sim_config
from dora_jax.sim.failures import stop_and_resume, uptime
from dora_jax.sim.run import simulate

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "sim" / "tiny_qwen7b_h100.yaml"


@pytest.mark.parametrize("seed", [0, 1])
def test_failed_groups_recover_in_place(seed):
    over = [
        "failures.gpu_mtbf_hours=0.03",  # a group of TP 2 fails every ~54 modeled seconds
        "failures.restart_s=40",
        f"failures.seed={seed}",
        "run.modes=[dora]",
    ]
    run = simulate(load_sim_config(TINY, overrides=over), "dora")
    b, rec = run.backend, run.result.records
    assert b.failures.failed >= 2 and b.failures.recovered_requests > 0
    assert len(rec.steps) >= run.cfg.run.steps  # the run finished its steps
    ids = [c.request_id for c in rec.consumed]
    assert len(ids) == len(set(ids))  # nothing consumed twice
    assert all(c.version_span == 1 for c in rec.consumed)  # one version per trajectory
    assert [src for _, _, src in rec.recoveries] == ["prompt"] * b.failures.recovered_requests
    recovered = {r for _, r, _ in rec.recoveries}  # (one may fail again on another group)
    assert recovered & set(ids)  # recovered requests finish and are consumed
    for g in {h[1] for h in rec.health}:
        states = [h[2] for h in rec.health if h[1] == g]
        assert states[0] == "dead"
        for a, nxt in zip(states, states[1:], strict=False):  # dead -> stale -> healthy -> dead
            assert (a, nxt) in {("dead", "stale"), ("stale", "healthy"), ("healthy", "dead")}
        dead = [h[0] for h in rec.health if h[1] == g and h[2] == "dead"]
        back = [h[0] for h in rec.health if h[1] == g and h[2] == "stale"]
        for t0, t1 in zip(dead, back, strict=False):  # out for restart_s (ticks of 0.5 s)
            assert t1 - t0 == pytest.approx(40 / 0.5, abs=1)


def test_a_failed_group_takes_no_work_while_it_is_out():
    over = ["failures.gpu_mtbf_hours=0.03", "failures.restart_s=40", "run.modes=[dora]"]
    run = simulate(load_sim_config(TINY, overrides=over), "dora")
    rec = run.result.records
    (t0, g, _, _) = next(h for h in rec.health if h[2] == "dead")
    t1 = next(h[0] for h in rec.health if h[1] == g and h[2] == "stale" and h[0] > t0)
    for tick in range(int(t0) + 1, int(t1)):
        row = rec.groups[tick]
        assert row[g].activity == "idle" and row[g].active == 0 and row[g].tokens == 0


def test_stop_and_resume_against_recovery_in_place():
    cfg = FailureConfig(gpu_mtbf_hours=1000.0, job_restart_s=600.0, checkpoint_every_s=1800.0)
    # 1,000 GPUs fail once an hour together; each failure stops the job for 600 s and repeats
    # 900 s on average: of every 3,600 s between failures 1,500 are lost
    assert uptime(1000 / (1000 * 3600.0), 1500.0) == pytest.approx(3600 / (3600 + 1500))
    p = stop_and_resume(cfg, 1000, 500, 100.0, 90.0)
    assert p.stop_and_resume == pytest.approx(100.0 * 3600 / 5100)
    assert p.recover_in_place == pytest.approx(90.0 * 7200 / 8700)  # the trainer's half only
    assert p.job_failures_per_hour == pytest.approx(1.0)
    assert p.rollout_failures_per_hour == pytest.approx(0.5)


def test_failure_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"^failures\.gpu_mtbf_hours: must be > 0"):
        load_sim_config(TINY, overrides=["failures.gpu_mtbf_hours=0"])
    with pytest.raises(ConfigError, match=r"^failures\.restart_s: must be > 0"):
        load_sim_config(TINY, overrides=["failures.restart_s=-1"])
