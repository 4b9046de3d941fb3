"""Adaptive staleness: the rule that re-chooses K, the window that takes a new K safely, and the
run invariants with K changing under them (staleness never above the user's bound)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from invariants import assert_run_invariants  # tests/invariants.py

from dora_jax.config.schema import ConfigError, OrchestratorConfig
from dora_jax.orchestrator import FakeBackendConfig, VersionWindow, run_fake
from dora_jax.orchestrator.staleness import AdaptiveK


def test_the_rule_tries_a_neighbour_then_keeps_the_cheapest():
    a = AdaptiveK(k_min=1, k_max=4, warmup=0)
    a.observe(3, wait_share=0.4, staleness=2.0, staleness_cost=0.05)  # cost 0.5
    assert a.choose(3, wait_share=0.4, staleness_cost=0.05) == 4  # it waited: try K + 1
    a.observe(4, wait_share=0.0, staleness=3.0, staleness_cost=0.05)  # cost 0.15
    assert a.choose(4, wait_share=0.0, staleness_cost=0.05) == 4  # cheaper than K = 3: kept
    for _ in range(6):
        a.observe(4, wait_share=0.0, staleness=3.0, staleness_cost=0.05)
    assert a.choose(4, wait_share=0.0, staleness_cost=0.05) == 3  # K = 3's cost has aged: retry
    b = AdaptiveK(k_min=1, k_max=4, warmup=0)
    b.observe(3, wait_share=0.0, staleness=2.0, staleness_cost=0.05)
    assert b.choose(3, wait_share=0.0, staleness_cost=0.05) == 2  # no waiting: try K - 1
    assert AdaptiveK(1, 4).choose(4, 1.0, 0.05) == 4  # during the warm-up steps: unchanged


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


def test_adaptive_k_config_is_validated():
    import pytest

    with pytest.raises(ConfigError, match="adaptive_k_min"):
        OrchestratorConfig(staleness_k=2, adaptive_k=True, adaptive_k_min=3)
    with pytest.raises(ConfigError, match="staleness_cost"):
        OrchestratorConfig(staleness_cost=-1.0)


@given(
    k=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    cost=st.sampled_from([0.0, 0.05, 1.0]),
    slots=st.integers(1, 4),
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_run_invariants_with_k_changing(k, seed, cost, slots):
    cfg = OrchestratorConfig(
        mode="dora",
        clock="logical",
        staleness_k=k,
        train_batch_prompts=2,
        rollout_batch_prompts=4,
        plan_period_ticks=4,
        adaptive_k=True,
        adaptive_k_min=0,
        staleness_cost=cost,
    )
    backend = FakeBackendConfig(
        num_groups=3,
        max_slots=slots,
        max_new_tokens=64,
        length_median=6,
        length_p99_ratio=10.0,
        weight_transfer_ticks=1,
        seed=seed,
    )
    out = run_fake(cfg, 2, backend, num_steps=10, step_ticks=2, drain=True, max_ticks=200_000)
    rec = out.result.records
    assert_run_invariants(
        mode="dora",
        k=k,
        group_size=2,
        num_groups=3,
        plan_period_ticks=4,
        runtime=out.runtime,
        records=rec,
        ledger=out.result.ledger,
        trainer_batches=out.trainer.batches,
        live_requests=out.backend.live_requests(),
    )
    assert len(rec.k_log) == len(rec.steps) and all(0 <= x <= k for _, x, _ in rec.k_log)
