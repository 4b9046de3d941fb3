"""The control plane's invariants (tests/test_orchestrator_properties.py) on the simulated backend.

``check_invariants`` there drives the fake backend, so the checks are re-expressed here over a
:class:`~dora_jax.sim.backend.SimBackend` run (random small clusters, workloads and cost
parameters, every mode, both placements where a mode allows colocation), each run drained:

1. every dispatched request ends exactly once (consumed; or discarded in ``oversample``) and the
   trainer saw each consumed one once; the backend holds nothing at the end;
2. staleness <= K for every consumed trajectory; at most K + 1 versions coexist;
3. version span 1 outside ``partial`` (<= K + 1 there);
4. no re-prefilled tokens outside ``partial``;
5. ``dora``: no group idles longer than a planning period while requests wait;

and, specific to the simulator:

6. every consumed trajectory has the response length the workload drew for it (interrupts,
   re-prefills and migrations never change it), and outside ``oversample`` the tokens sampled
   equal the tokens consumed;
7. modeled time is conserved: the group-seconds spent per tick sum to ``tick_s`` per group, up to
   what a group carries into the next tick (less than one step).
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from invariants import assert_run_invariants  # tests/invariants.py

from dora_jax.config.schema import OrchestratorConfig
from dora_jax.orchestrator import MODES, Runtime, mode_for
from dora_jax.sim.backend import SimBackend
from dora_jax.sim.config import EfficiencyConfig, PromptConfig, ResponseConfig
from dora_jax.sim.cost_model import CostModel
from dora_jax.sim.hardware import get_hardware
from dora_jax.sim.models import ModelSpec
from dora_jax.sim.trainer import SimTrainer
from dora_jax.sim.workload import ResponseLengths, SimPrompts

# a 0.2B-parameter toy: a decode step is ~2 ms on an H100, a weight transfer ~10 ms
TOY = ModelSpec(
    "toy",
    2e8,
    2e8,
    num_layers=4,
    hidden=512,
    kv_bytes_per_token=4096,
    attn_flops_per_pair=8192.0,
    allreduces_per_forward=8,
)
MAX_PROMPT = 32


@st.composite
def sim_workloads(draw, modes=MODES):
    mode = draw(st.sampled_from(modes))
    tbs = draw(st.integers(1, 4))
    orch = OrchestratorConfig(
        mode=mode,
        staleness_k=draw(st.integers(int(mode == "one_step"), 3)),  # one_step: K >= 1
        train_batch_prompts=tbs,
        rollout_batch_prompts=draw(st.integers(tbs, 3 * tbs)),
        plan_period_ticks=draw(st.integers(1, 12)),
        kv_pressure_threshold=draw(st.sampled_from([0.3, 0.9, 1.0])),
        legacy_fill=draw(st.booleans()),
        plan_on_idle=draw(st.booleans()),
    )
    median = draw(st.integers(2, 12))
    max_new = draw(st.integers(median, 20 * median))
    response = ResponseConfig(
        median=float(median),
        p99_ratio=draw(st.sampled_from([1.0, 4.0, 10.0, 20.0])),
        max_tokens=max_new,
        prompt_corr=draw(st.sampled_from([0.0, 0.5])),
    )
    kv_requests = draw(st.sampled_from([None, 1, 2, 3]))
    sim = dict(
        placement=draw(st.sampled_from(["disaggregated", "colocated"]))
        if mode in ("sync", "partial", "oversample")
        else "disaggregated",
        num_groups=draw(st.integers(1, 6)),
        max_slots=draw(st.integers(1, 6)),
        kv_capacity=None if kv_requests is None else kv_requests * (MAX_PROMPT + max_new),
        admit_reserve=draw(st.sampled_from([8, 32, 64])),
        tick_s=draw(st.sampled_from([0.002, 0.005, 0.02])),
        tp=draw(st.sampled_from([1, 2])),
        weight_latency=draw(st.sampled_from([0.0, 0.02])),
        train_overhead=draw(st.sampled_from([0.0, 0.01, 0.05])),
        group_size=draw(st.integers(2, 4)),
        num_steps=draw(st.integers(2, 6)),
        seed=draw(st.integers(0, 2**16)),
    )
    return orch, response, sim


def run_sim(orch: OrchestratorConfig, response: ResponseConfig, sim: dict):
    eff = EfficiencyConfig(
        weight_sync_latency_s=sim["weight_latency"], train_step_overhead_s=sim["train_overhead"]
    )
    cost = CostModel(TOY, get_hardware("h100"), sim["tp"], eff)
    lengths = ResponseLengths(response, sim["group_size"], sim["seed"])
    backend = SimBackend(
        cost,
        sim["num_groups"],
        lengths,
        tick_s=sim["tick_s"],
        max_slots=sim["max_slots"],
        max_prompt_len=MAX_PROMPT,
        admit_reserve_tokens=sim["admit_reserve"],
        kv_capacity_tokens=sim["kv_capacity"],
    )
    colocated = backend if sim["placement"] == "colocated" else None
    trainer = SimTrainer(cost, 8, sim["tick_s"], colocated_with=colocated, clock=backend)
    prompts = SimPrompts(
        PromptConfig(median=12, p99_ratio=2, min_tokens=1, max_tokens=MAX_PROMPT), sim["seed"]
    )
    runtime = Runtime(orch, sim["group_size"], backend, trainer, prompts)
    result = runtime.run(sim["num_steps"], drain=True, max_ticks=300_000)
    return runtime, result, backend, trainer, lengths


def check_sim_invariants(orch: OrchestratorConfig, response: ResponseConfig, sim: dict) -> None:
    k, G = mode_for(orch).k, sim["group_size"]
    rt, result, backend, trainer, lengths = run_sim(orch, response, sim)
    rec, ledger = result.records, result.ledger

    assert_run_invariants(
        mode=orch.mode,
        k=k,
        group_size=G,
        num_groups=sim["num_groups"],
        plan_period_ticks=orch.plan_period_ticks,
        runtime=rt,
        records=rec,
        ledger=ledger,
        trainer_batches=trainer.batches,
        live_requests=backend.live_requests(),
    )
    assert int(backend.requests.count.sum()) == 0

    # 6. response lengths are the workload's; tokens sampled == tokens consumed
    if rec.consumed:
        pg = np.array([c.prompt_group for c in rec.consumed])
        rid = np.array([c.request_id for c in rec.consumed])
        want = lengths.lengths(pg, rid % G)
        assert [c.response_len for c in rec.consumed] == want.tolist()
    sampled = sum(g.tokens for row in rec.groups for g in row)
    consumed = sum(c.response_len for c in rec.consumed)
    assert sampled >= consumed if orch.mode == "oversample" else sampled == consumed

    # 7. modeled time is conserved (up to the carry, < one step, per group)
    spent = np.sum(backend.seconds, axis=0).sum()
    budget = len(rec.groups) * sim["num_groups"] * sim["tick_s"]
    ctx = sim["max_slots"] * (MAX_PROMPT + response.max_tokens)
    slack = sim["num_groups"] * float(backend.cost.decode_step_s(sim["max_slots"], ctx))
    assert budget - slack - 1e-9 <= spent <= budget + 1e-9, (spent, budget)
    assert all(np.all(s >= -1e-12) for s in backend.seconds)


@given(sim_workloads())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_sim_invariants_every_mode(w):
    check_sim_invariants(*w)


@given(sim_workloads(modes=("dora",)))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# found by a random draw: a group kept idle at the gate's version for a growth that could not
# happen (a request's pages above the KV pressure limit), past the planning period
@example(
    (
        OrchestratorConfig(
            mode="dora",
            staleness_k=2,
            train_batch_prompts=1,
            rollout_batch_prompts=3,
            plan_period_ticks=1,
            kv_pressure_threshold=0.3,
            legacy_fill=False,
            plan_on_idle=False,
        ),
        ResponseConfig(median=4.0, p99_ratio=4.0, max_tokens=6, prompt_corr=0.0),
        dict(
            placement="disaggregated",
            num_groups=2,
            max_slots=2,
            kv_capacity=38,
            admit_reserve=8,
            tick_s=0.002,
            tp=1,
            weight_latency=0.0,
            train_overhead=0.0,
            group_size=2,
            num_steps=6,
            seed=0,
        ),
    )
)
def test_sim_invariants_dora(w):
    check_sim_invariants(*w)


@pytest.mark.slow
@given(sim_workloads())
@settings(
    max_examples=3000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=False,
)
def test_sim_invariants_every_mode_big_sweep(w):
    check_sim_invariants(*w)


def test_sim_same_seed_same_run():
    orch = OrchestratorConfig(
        mode="dora",
        staleness_k=2,
        train_batch_prompts=2,
        rollout_batch_prompts=4,
        plan_period_ticks=4,
    )
    response = ResponseConfig(median=6.0, p99_ratio=12.0, max_tokens=80)
    sim = dict(
        placement="disaggregated",
        num_groups=3,
        max_slots=4,
        kv_capacity=None,
        admit_reserve=32,
        tick_s=0.005,
        tp=1,
        weight_latency=0.0,
        train_overhead=0.01,
        group_size=3,
        num_steps=5,
        seed=7,
    )
    a = run_sim(orch, response, sim)
    b = run_sim(orch, response, sim)
    assert a[3].batches == b[3].batches
    assert a[1].records.groups == b[1].records.groups
    assert np.array_equal(np.array(a[2].seconds), np.array(b[2].seconds))
