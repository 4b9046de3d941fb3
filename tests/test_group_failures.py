"""A rollout group whose engine fails mid-run costs its work, not the run (docs/reliability.md,
"A rollout group that fails"): real engines, 4 groups, ``dora`` K=2, a fault injected into one
engine step (``DORA_FAULT=engine_step@N:raise``).

- Logical clock, three fault points: the run finishes; the control plane's invariants hold
  (every prompt group consumed once, version span 1, staleness within K, no re-prefill with a
  host copy taken every engine step); every request the failed group held is recovered, counted
  by source; and each recovered request consumed gives exactly the tokens and logprobs of the
  same request in the run without the fault, a request continued from its KV copy without being
  prefilled again.
- Without host copies the requests go on from their tokens so far (re-prefilled, counted) or
  their prompts.
- Wall clock: the run finishes (no hang) and counts the failure and its recoveries.
- A group that keeps failing stops the run past ``rollout.max_group_restarts``, naming it.
"""

import dataclasses

import jax
import numpy as np
import pytest
from invariants import assert_run_invariants  # tests/invariants.py
from real_engines import NO_EOS, REAL, FixedTok, LongTailPrompts, small_orchestrator

from dora_jax import faults
from dora_jax.config import load_config
from dora_jax.execution import EngineBackend, PromptPayload, ThreadedTrainer
from dora_jax.mesh import build_meshes
from dora_jax.model import init_params
from dora_jax.orchestrator import BackendError, RequestSpec, Runtime
from dora_jax.orchestrator.clock import Bus, LogicalClock, WallClock
from dora_jax.pipeline.grpo import GRPOTrainer
from dora_jax.train import Trainer

G = 4  # samples per prompt (REAL's train.group_size)
ORCH = small_orchestrator("dora")


@pytest.fixture(scope="module")
def base():
    cfg = load_config(None, REAL)
    return cfg, build_meshes(cfg.mesh), init_params(cfg.model, jax.random.key(0))


def run(base, *, wall: bool = False, backup_every: int = 1, steps: int = 3):
    """One run to its drain: (result, backend, {request id: completion} of what was consumed,
    the trainer's batches)."""
    cfg, meshes, params = base
    rollout = dataclasses.replace(
        cfg.rollout, backup_every_steps=backup_every, max_group_restarts=2
    )
    clock, bus = (WallClock() if wall else LogicalClock()), Bus()
    grpo = GRPOTrainer(
        Trainer(cfg.model, cfg.train, mesh=meshes.trainer, params=params),
        FixedTok(),
        lambda response, answer: float(len(response) % 3),
        train_ticks=3,
    )
    consumed = {}
    grpo.on_consume.append(lambda rid, version, comp: consumed.setdefault(rid, (version, comp)))
    backend = EngineBackend(
        cfg.model,
        rollout,
        meshes.groups,
        NO_EOS,
        params,
        lambda v: grpo.params_for(v) if v in grpo.params else params,
        seed=cfg.seed,
        clock=clock,
        bus=bus,
    )
    trainer = ThreadedTrainer(grpo, clock.now, bus.post) if wall else grpo
    runtime = Runtime(ORCH, G, backend, trainer, LongTailPrompts(0), clock=clock)
    try:
        result = runtime.run(steps, drain=True, max_ticks=100_000, stall_s=ORCH.stall_s)
    finally:
        backend.close()
        if wall:
            trainer.close()
    batches = [(s.version - 1, tuple(s.trajectories)) for s in grpo.log]
    return result, backend, runtime, consumed, batches


@pytest.fixture(scope="module")
def no_fault(base):
    faults.reset()
    return run(base)


def _with_fault(monkeypatch, visit: int):
    monkeypatch.setenv(faults.ENV, f"engine_step@{visit}:raise")
    faults.reset()


SEEDS = [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_failed_engine_costs_its_work_not_the_run(base, no_fault, monkeypatch, seed):
    clean_result = no_fault[0]
    steps = sum(
        g.activity in ("prefill", "decode") for row in clean_result.records.groups for g in row
    )
    # the engine step that fails: somewhere in the first 60% of the run's engine steps
    visit = int(np.random.default_rng(seed).integers(5, int(0.6 * steps)))
    _with_fault(monkeypatch, visit)
    result, backend, runtime, consumed, batches = run(base)
    s = result.summary
    assert s.steps >= 3
    assert s.group_failures == 1
    assert backend.recovery.restarts.count(1) == 1 and sum(backend.recovery.restarts) == 1
    recovered = backend.recovery.recovered_ids
    assert recovered, "the failed group held no request: choose another fault point"
    assert s.recovered == dict(backend.recovery.recoveries) and sum(s.recovered.values()) == len(
        recovered
    )
    assert set(s.recovered) <= {"kv", "prompt"}  # a copy every step: nothing to re-prefill
    assert all(len(row) == 4 for row in result.records.groups)  # every tick records every group
    states = [h[2] for h in result.records.full().health]
    assert states == ["dead", "restarting", "healthy"]
    assert_run_invariants(
        mode="dora",
        k=runtime.mode.k,
        group_size=G,
        num_groups=4,
        plan_period_ticks=ORCH.plan_period_ticks,
        runtime=runtime,
        records=result.records,
        ledger=result.ledger,
        trainer_batches=batches,
        live_requests=backend.live_requests(),
    )
    # every recovered request that was consumed equals the same request of the run without the
    # fault, token for token and logprob for logprob
    _, _, _, clean, _ = no_fault
    checked = 0
    for rid, source in recovered.items():
        if rid not in consumed or rid not in clean:
            continue
        (version, comp), (clean_version, clean_comp) = consumed[rid], clean[rid]
        assert version == clean_version
        assert comp.tokens == clean_comp.tokens, (rid, source)
        assert comp.logprobs == clean_comp.logprobs, (rid, source)
        if source == "kv":
            assert comp.prefill_tokens == len(comp.prompt.tokens)  # never prefilled again
        checked += 1
    assert checked >= min(4, len(recovered))
    assert "kv" in s.recovered


def test_without_host_copies_requests_go_on_from_their_tokens(base, monkeypatch):
    _with_fault(monkeypatch, 60)
    result, backend, runtime, consumed, batches = run(base, backup_every=0)
    s = result.summary
    assert s.group_failures == 1
    assert "kv" not in s.recovered and s.recovered.get("tokens", 0) > 0
    assert s.reprefill_tokens > 0  # their tokens so far, prefilled again under their version
    assert all(c.version_span == 1 for c in result.records.full().consumed)
    fed = [rid for _, ids in batches for rid in ids]
    assert len(fed) == len(set(fed)) == runtime.manager.dispatched_prompt_groups * G


def test_a_failed_engine_on_the_wall_clock_does_not_hang_the_run(base, monkeypatch):
    _with_fault(monkeypatch, 40)
    result, backend, runtime, consumed, batches = run(base, wall=True, backup_every=2)
    s = result.summary
    assert s.steps >= 3 and s.group_failures == 1
    assert sum(s.recovered.values()) == len(backend.recovery.recovered_ids) > 0
    assert all(c.version_span == 1 for c in result.records.full().consumed)
    fed = [rid for _, ids in batches for rid in ids]
    assert len(fed) == len(set(fed)) == runtime.manager.dispatched_prompt_groups * G


def test_a_group_that_keeps_failing_stops_the_run_naming_it(base, monkeypatch):
    cfg, meshes, params = base
    backend = EngineBackend(
        cfg.model,
        dataclasses.replace(cfg.rollout, max_group_restarts=1),
        meshes.groups,
        NO_EOS,
        params,
        lambda v: params,
        seed=0,
    )
    backend.submit(0, [_spec(1), _spec(2)])
    monkeypatch.setenv(faults.ENV, "engine_step@1:raise")
    faults.reset()
    events = backend.step()  # the first failure: rebuilt, its two requests recovered
    assert [p.request_id for p in events.recovered] == [1, 2]
    assert [p.source for p in events.recovered] == ["prompt", "prompt"]  # none had started
    assert [h.state for h in events.health] == ["dead", "restarting", "healthy"]
    assert backend.groups()[0].requests == () and backend.live_requests() == 0
    faults.reset()
    backend.submit(0, [_spec(3)])
    with pytest.raises(BackendError, match=r"group 0's engine failed 2 times.*max_group_restarts"):
        backend.step()


def _spec(rid: int, new_tokens: int = 8):
    return RequestSpec(rid, rid, 0, 4, PromptPayload(rid, (3, 4, 5, 6), "", new_tokens))


def test_requests_recovered_from_kv_survive_a_checkpoint_and_finish_identically(base, monkeypatch):
    """Two requests decode on group 0 (a host copy every step), group 0 fails, and their
    recovered state (KV copies) goes through the checkpoint codec before group 1 takes it: they
    finish with the tokens and logprobs of the same requests on a backend that never failed,
    prefilled once."""
    from dora_jax import state_codec

    cfg, meshes, params = base

    def backend(every: int) -> EngineBackend:
        rollout = dataclasses.replace(cfg.rollout, backup_every_steps=every)
        return EngineBackend(
            cfg.model, rollout, meshes.groups, NO_EOS, params, lambda v: params, seed=0
        )

    def finish(b: EngineBackend) -> dict:
        done = {}
        for _ in range(100):
            done.update({f.request_id: f.payload for f in b.step().finished})
            if len(done) == 2:
                return done
        raise AssertionError("the requests did not finish")

    clean = backend(0)
    clean.submit(0, [_spec(1, 24), _spec(2, 24)])
    expected = finish(clean)

    b = backend(1)
    b.submit(0, [_spec(1, 24), _spec(2, 24)])
    for _ in range(5):  # prefilled and decoding, with copies
        assert not b.step().finished
    monkeypatch.setenv(faults.ENV, "engine_step@1:raise")
    faults.reset()
    events = b.step()
    assert [p.source for p in events.recovered] == ["kv", "kv"]
    assert all(p.generated > 0 for p in events.recovered)
    tree, arrays = state_codec.encode(list(events.recovered))
    restored = state_codec.decode(tree, arrays)
    monkeypatch.delenv(faults.ENV)
    b.submit(
        1,
        [
            RequestSpec(p.request_id, p.prompt_group, 0, p.prompt_len, p.payload, resume=p)
            for p in restored
        ],
    )
    got = finish(b)
    for rid in (1, 2):
        assert got[rid].tokens == expected[rid].tokens
        assert got[rid].logprobs == expected[rid].logprobs
        assert got[rid].prefill_tokens == len(got[rid].prompt.tokens)  # never prefilled again
