"""staleness_k: auto (orchestrator/staleness.py): the controller's reaction to a scripted drift
signal, the window that takes a new K safely, the run invariants with K changing under them, and
a drift stress on the fake backend (K shrinks within a few steps, grows back after)."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from invariants import assert_run_invariants  # tests/invariants.py

from dora_jax.config import load_config
from dora_jax.config.schema import ConfigError, OrchestratorConfig
from dora_jax.orchestrator import FakeBackendConfig, VersionWindow, run_fake
from dora_jax.orchestrator.fake_trainer import FakeTrainer
from dora_jax.orchestrator.staleness import DriftK, DriftModel, lag_tokens_of

ROOT = Path(__file__).resolve().parents[1]


def signal(c: float, k: int, floor: float = 1.0, tokens: int = 500):
    """A step's (tokens, ESS) per lag 0..k under drift coefficient ``c``: ``floor (1 - c j^2)``."""
    return [tokens] * (k + 1), [floor * (1 - c * j * j) for j in range(k + 1)]


def test_a_scripted_signal_moves_k_in_the_right_direction():
    ctl = DriftK(k_min=1, k_max=4, ess_min=0.9, warmup=2, patience=2)
    k, trail = 1, []
    for step in range(40):
        if step < 12:  # calm, the trainer waits for the oldest version: K grows
            c, wait = 0.001, 0.3
        elif step < 20:  # a drift burst (a learning rate 10x: c x 100)
            c, wait = 0.1, 0.3
        else:  # calm again
            c, wait = 0.001, 0.3
        tokens, ess = signal(c, k)
        d = ctl.step(step + 1, k, tokens, ess, wait)
        trail.append((step, d.k, d.reason))
        assert ctl.k_min <= d.k <= ctl.k_max
        if d.k > k:
            assert d.k == k + 1 and d.reason in ("waiting", "probe")  # one at a time
        k = d.k
    by_step = {s: (kk, r) for s, kk, r in trail}
    assert [by_step[s][1] for s in range(2)] == ["warmup", "warmup"]
    assert by_step[11][0] == 4  # calm and waiting: up to k_max, one step at a time
    assert all(r != "drift" for s, (_, r) in by_step.items() if s < 12)
    # the burst: down to k_min within two steps (the moving average needs one more), held there
    assert min(s for s, (kk, _) in by_step.items() if s >= 12 and kk == 1) <= 13
    assert all(kk == 1 for s, (kk, _) in by_step.items() if 14 <= s < 20)
    assert any(r == "drift" for s, (_, r) in by_step.items() if 12 <= s < 14)
    assert by_step[39][0] == 4  # after it: back up
    assert any(r == "waiting" for s, (_, r) in by_step.items() if s >= 20)


def test_no_waiting_no_growth_and_lag_0_is_the_floor():
    ctl = DriftK(k_min=1, k_max=4, warmup=0, patience=1)
    for step in range(10):  # tiny drift, but the trainer never waited: K stays
        tokens, ess = signal(0.0001, 1)
        assert ctl.step(step, 1, tokens, ess, 0.0).k == 1
    # numerics alone (lag 0 at 0.95, every lag at 0.95): no drift at all
    ctl = DriftK(k_min=0, k_max=3, warmup=0)
    ctl.step(0, 2, [400, 400, 400], [0.95, 0.95, 0.95], 0.5)
    assert ctl.drift == pytest.approx(0.0)
    # the same ESS without lag 0's floor would read as drift
    ctl2 = DriftK(k_min=0, k_max=3, warmup=0)
    ctl2.step(0, 2, [0, 400, 400], [0.0, 0.95, 0.95], 0.5)
    assert ctl2.drift > 0.01


def test_the_shrink_goes_straight_to_the_budget_and_a_blind_stretch_probes():
    ctl = DriftK(k_min=0, k_max=4, ess_min=0.9, warmup=0, alpha=1.0)
    tokens, ess = signal(0.02, 4)  # predicted loss at K=4: 0.32 > 0.1; at K=2: 0.08
    d = ctl.step(1, 4, tokens, ess, 0.0)
    assert (d.k, d.reason) == (2, "drift") and d.ess_at_k == pytest.approx(1 - 0.02 * 4)
    ctl = DriftK(k_min=0, k_max=2, warmup=0, patience=1)
    ks = [ctl.step(v, 0, [100], [1.0], 0.0).reason for v in range(4)]
    assert ks == ["hold", "hold", "hold", "probe"]  # no lag >= 1 for 4 x patience steps


def test_the_controller_state_round_trips():
    a = DriftK(k_min=1, k_max=4, warmup=1)
    for v in range(5):
        a.step(v, 2, *signal(0.01, 2), 0.2)
    b = DriftK(k_min=1, k_max=4, warmup=1)
    b.load_state_dict(a.state_dict())
    assert b.step(9, 2, *signal(0.03, 2), 0.1) == a.step(9, 2, *signal(0.03, 2), 0.1)


def test_a_lower_k_binds_dispatch_at_once_and_consumption_when_the_open_groups_fit():
    w = VersionWindow(k=3, per_step=2)
    w.add(0, 8)  # (K + 1) * TBS: the whole room of v0 under K = 3
    assert w.min_k() == 3 and w.set_k(1) == 3  # consumption keeps K = 3 for them ...
    assert w.target_k == 1 and w.room(0) == 0  # ... dispatch follows K = 1 at once
    for v in range(3):  # the v0 groups, dispatched under K = 3, are consumed by steps 0..3
        w.begin_step([0, 0])
        w.publish(v + 1)
        assert w.set_k(1) == 3
    w.begin_step([0, 0])
    w.publish(4)
    assert w.min_k() == 0 and w.set_k(1) == 1 and w.k == 1  # nothing open: K = 1 binds
    assert w.room(4) == 4  # (4 + 1 - 4 + 1) * 2
    assert w.set_k(3) == 3 and w.room(4) == 8  # raising is immediate
    w2 = VersionWindow(k=2, per_step=2)
    state = w2.state_dict()
    w2.set_k(1)
    w2.load_state_dict(state)
    assert (w2.k, w2.target_k) == (2, 2)


def test_auto_k_config_is_validated():
    with pytest.raises(ConfigError, match="k_max"):
        OrchestratorConfig(staleness_k="auto", k_min=3, k_max=2)
    with pytest.raises(ConfigError, match="ess_min"):
        OrchestratorConfig(staleness_k="auto", ess_min=1.0)
    with pytest.raises(ConfigError, match="staleness_k.*mode dora"):
        OrchestratorConfig(mode="partial", staleness_k="auto")
    with pytest.raises(ConfigError, match="orchestrator.staleness_k"):
        load_config(None, ["orchestrator.staleness_k=often"])
    cfg = load_config(None, ["orchestrator.staleness_k=auto", "orchestrator.k_max=3"])
    assert cfg.orchestrator.auto_k and cfg.orchestrator.k_bound == 3
    with pytest.raises(ConfigError, match="adaptive_k"):  # the earlier knob is gone, by name
        load_config(None, ["orchestrator.adaptive_k=true"])


def _fake(k_max, seed, model, steps=40, slots=4, p99=10.0):
    cfg = OrchestratorConfig(
        mode="dora",
        clock="logical",
        staleness_k="auto",
        k_min=1,
        k_max=k_max,
        train_batch_prompts=2,
        rollout_batch_prompts=6,
        plan_period_ticks=4,
    )
    backend = FakeBackendConfig(
        num_groups=3,
        max_slots=slots,
        max_new_tokens=64,
        length_median=6,
        length_p99_ratio=p99,
        weight_transfer_ticks=1,
        seed=seed,
    )
    trainer = FakeTrainer(step_ticks=2, drift=model)
    return cfg, run_fake(
        cfg, 2, backend, num_steps=steps, trainer=trainer, drain=True, max_ticks=400_000
    )


@given(k_max=st.integers(1, 3), seed=st.integers(0, 2**16), c=st.sampled_from([0.0, 0.01, 0.2]))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_run_invariants_with_k_changing(k_max, seed, c):
    cfg, out = _fake(k_max, seed, DriftModel(c), steps=12)
    rec = out.result.records
    assert_run_invariants(
        mode="dora",
        k=k_max,
        group_size=2,
        num_groups=3,
        plan_period_ticks=4,
        runtime=out.runtime,
        records=rec,
        ledger=out.result.ledger,
        trainer_batches=out.trainer.batches,
        live_requests=out.backend.live_requests(),
    )
    assert len(rec.k_log) == len(rec.steps)
    assert all(1 <= row[2] <= k_max for row in rec.k_log)


def test_a_drift_stress_shrinks_k_and_it_grows_back():
    stress = DriftModel(0.001, stress_start=15, stress_steps=10, stress_factor=10.0)
    _, out = _fake(4, 7, stress, steps=45)
    rows = out.result.records.k_log  # (time, version, K, reason, drift, ess at K, wait, avg)
    k_at = {row[1]: row[2] for row in rows}  # version published -> K from then on
    reasons = {row[1]: row[3] for row in rows}
    assert max(k_at[v] for v in range(1, 16)) >= 3  # calm: K grew (the trainer waited)
    first = min(v for v in range(16, 46) if reasons[v] == "drift")
    assert first <= 18  # within three steps of the stress (steps 15..24 publish v16..v25)
    assert all(k_at[v] == 1 for v in range(first, 26))  # held low through it
    assert max(k_at[v] for v in range(30, 46)) >= 3  # and back up after
    # the bound is strict throughout: every consumed trajectory within the K of its dispatch
    assert all(c.version_span == 1 for c in out.result.records.consumed)
    assert max(c.staleness for c in out.result.records.consumed) <= 4
    chosen = out.result.records.summary().k_chosen  # summary.json's figures
    assert chosen["min"] == 1 and chosen["max"] >= 3 and chosen["reasons"]["drift"] >= 1


def test_lag_tokens_of_a_batch():
    from types import SimpleNamespace as G

    batch = [G(version=5, response_tokens=10), G(version=3, response_tokens=7)]
    batch += [G(version=5, response_tokens=1), G(version=-9, response_tokens=4)]
    assert lag_tokens_of(batch, 5, bins=4) == [11, 0, 7, 4]


def test_a_checkpoint_while_k_changes_resumes_exactly(tmp_path):
    """The real trainer's drift signal on the tiny task, logical clock: a checkpoint taken in
    the steps where auto K moves resumes into the same decisions, params and consumption as the
    run without the stop, the controller's state restored."""
    import chex
    import jax
    from test_checkpoint import make  # tests/test_checkpoint.py

    from dora_jax.checkpoint import RunCheckpointer
    from dora_jax.pipeline.experiment import run

    auto = ("orchestrator.staleness_k=auto", "orchestrator.k_max=3")
    straight = make(tmp_path, "straight", *auto)
    run(straight, 8)
    rows = straight.runtime.records.k_log
    changes = [r[1] for prev, r in zip(rows, rows[1:], strict=False) if r[2] != prev[2]]
    assert changes and min(changes) <= 5  # K moves within the first steps (checked below at 4)

    first = make(tmp_path, "resumed", *auto)
    ck = RunCheckpointer(tmp_path / "resumed" / "ckpt", async_save=False)
    run(first, 4, checkpointer=ck)
    saved = first.runtime.adaptive.state_dict()
    assert saved["seen"] == 4 and saved["drift"] is not None

    again = make(tmp_path, "resumed", *auto)
    RunCheckpointer(tmp_path / "resumed" / "ckpt").restore_latest(again)
    assert again.runtime.adaptive.state_dict() == saved
    assert (again.runtime.window.k, again.runtime.window.target_k) == (
        first.runtime.window.k,
        first.runtime.window.target_k,
    )
    run(again, 4)
    assert again.runtime.records.k_log == rows  # every decision, its figures included
    assert again.runtime.adaptive.state_dict() == straight.runtime.adaptive.state_dict()
    chex.assert_trees_all_equal(
        jax.device_get(straight.trainer.export_params()),
        jax.device_get(again.trainer.export_params()),
    )
    ids = [c.request_id for c in straight.runtime.records.consumed]
    assert ids == [c.request_id for c in again.runtime.records.consumed]


def test_the_simulator_models_drift_and_auto_k_reacts():
    """The simulator's drift model (the drift section) feeds the same controller: K grows while
    the trainer waits, drops the step a 10x learning-rate stress begins, and grows back after."""
    from dora_jax.sim.config import load_sim_config
    from dora_jax.sim.run import simulate

    # auto is for dora alone (as in a real run): the config runs only dora
    over = ["orchestration.staleness_k=auto", "run.modes=[dora]", "run.colocated=[]"]
    over += ["run.steps=30"]
    stress = ["drift.stress_start=10", "drift.stress_steps=8", "drift.stress_factor=10"]
    preset = ROOT / "configs" / "sim" / "tiny_qwen7b_h100.yaml"
    cfg = load_sim_config(preset, overrides=over + stress)
    rows = simulate(cfg, "dora").runtime.records.k_log
    k = {r[1]: r[2] for r in rows}  # version published -> K from then on
    assert max(k[v] for v in range(1, 11)) == 4  # grew to k_max before the stress
    assert k[11] == 1 and rows[10][3] == "drift"  # step 10 publishes v11: down at once
    assert all(k[v] == 1 for v in range(11, 19))  # held through it
    assert max(k[v] for v in range(19, 31)) == 4  # back up after
    calm = load_sim_config(preset, overrides=over)  # the same without the stress: it never drops
    rows = simulate(calm, "dora").runtime.records.k_log
    assert all(r[3] != "drift" for r in rows) and rows[-1][2] == 4
