"""One contract suite for every RolloutBackend: the in-memory fake, the simulator, and the real
JAX engines on the logical and on the wall clock.

- The same bad calls raise ``BackendError`` on every backend and change nothing.
- The same run invariants (``tests/invariants.py``) hold after a short run that drains, in the
  modes each backend is run in here.
- On the real engines (logical clock), migrated requests continue bit-identically: each one is
  generated again alone, never moved, under the params of its version, and gives the same tokens
  and logprobs. The wall clock's migrations are checked the same way in ``test_wall_clock.py``.
- The real engines end a response at the first of several EOS ids, on both clocks.
"""

import jax
import pytest
from invariants import assert_run_invariants  # tests/invariants.py
from real_engines import NO_EOS, REAL, FixedTok, LongTailPrompts, small_orchestrator

from dora_jax.config import load_config
from dora_jax.config.schema import OrchestratorConfig
from dora_jax.execution import EngineBackend, PromptPayload, ThreadedTrainer
from dora_jax.mesh import build_meshes, make_mesh
from dora_jax.model import init_params
from dora_jax.orchestrator import (
    TRAINER,
    BackendError,
    FakeBackend,
    FakeBackendConfig,
    FakeTrainer,
    RequestSpec,
    RolloutBackend,
    Runtime,
)
from dora_jax.orchestrator.clock import Bus, LogicalClock, WallClock
from dora_jax.pipeline.grpo import GRPOTrainer
from dora_jax.rollout import Engine, Request, request_key
from dora_jax.sim.backend import SimBackend
from dora_jax.sim.config import EfficiencyConfig, PromptConfig, ResponseConfig
from dora_jax.sim.cost_model import CostModel
from dora_jax.sim.hardware import get_hardware
from dora_jax.sim.models import ModelSpec
from dora_jax.sim.trainer import SimTrainer
from dora_jax.sim.workload import ResponseLengths, SimPrompts
from dora_jax.train import Trainer

BACKENDS = ("fake", "sim", "real-logical", "real-wall")
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


@pytest.fixture(scope="module")
def real_setup():
    cfg = load_config(None, REAL)
    meshes = build_meshes(cfg.mesh)
    return cfg, meshes, init_params(cfg.model, jax.random.key(0))


class Setup:
    """A backend of one kind, and (for runs) its runtime and what its trainer received."""

    def __init__(self, kind: str, real_setup, orch: OrchestratorConfig | None = None):
        self.kind, self.closers = kind, []
        G = 4
        if kind == "fake":
            fake = FakeBackendConfig(
                num_groups=4,
                max_slots=4,
                max_prompt_len=16,
                max_new_tokens=96,
                length_median=8,
                length_p99_ratio=12.0,
                weight_transfer_ticks=1,
                seed=3,
            )
            self.backend = FakeBackend(fake)
            trainer, prompts, clock = FakeTrainer(step_ticks=3), LongTailPrompts(0), None
            self.batches = lambda: trainer.batches
        elif kind == "sim":
            # train steps of a few ticks, so updates find requests in flight (partial re-prefills)
            cost = CostModel(
                TOY, get_hardware("h100"), 1, EfficiencyConfig(train_step_overhead_s=0.01)
            )
            lengths = ResponseLengths(
                ResponseConfig(median=8.0, p99_ratio=12.0, max_tokens=96), G, 3
            )
            self.backend = SimBackend(
                cost, 4, lengths, tick_s=0.005, max_slots=4, max_prompt_len=16
            )
            trainer = SimTrainer(cost, 8, 0.005, clock=self.backend)
            prompts = SimPrompts(
                PromptConfig(median=8, p99_ratio=2, min_tokens=1, max_tokens=16), 3
            )
            clock = None
            self.batches = lambda: trainer.batches
        else:
            cfg, meshes, params = real_setup
            wall = kind == "real-wall"
            clock, bus = (WallClock() if wall else LogicalClock()), Bus()
            grpo = GRPOTrainer(
                Trainer(cfg.model, cfg.train, mesh=meshes.trainer, params=params),
                FixedTok(),
                lambda response, answer: float(len(response) % 3),
                train_ticks=3,
            )
            self.grpo = grpo
            self.consumed = []  # (request id, version, completion) of every consumed trajectory
            grpo.on_consume.append(lambda *c: self.consumed.append(c))
            self.backend = EngineBackend(
                cfg.model,
                cfg.rollout,
                meshes.groups,
                NO_EOS,
                params,
                lambda v: grpo.params_for(v) if v in grpo.params else params,
                seed=cfg.seed,
                clock=clock,
                bus=bus,
            )
            self.closers.append(self.backend.close)
            trainer = ThreadedTrainer(grpo, clock.now, bus.post) if wall else grpo
            if wall:
                self.closers.append(trainer.close)
            prompts = LongTailPrompts(0)
            self.batches = lambda: [(s.version - 1, tuple(s.trajectories)) for s in grpo.log]
        if orch is not None:
            self.orch = orch
            self.runtime = Runtime(orch, G, self.backend, trainer, prompts, clock=clock)

    def close(self):
        for c in self.closers:
            c()


def _spec(rid: int, version: int = 0) -> RequestSpec:
    return RequestSpec(rid, rid, version, 4, PromptPayload(rid, (3, 4, 5, 6), "", 40))


def _view(backend):
    return [(g.version, g.requests, g.free_slots, g.max_slots) for g in backend.groups()]


@pytest.mark.parametrize("kind", BACKENDS)
def test_bad_calls_raise_and_change_nothing(kind, real_setup):
    s = Setup(kind, real_setup)
    b = s.backend
    try:
        assert isinstance(b, RolloutBackend), (
            f"{kind}: lacks a member of the RolloutBackend Protocol"
        )
        b.submit(0, [_spec(1)])
        b.publish(1)
        b.set_version(1, 1, TRAINER)  # group 1 now serves v1; groups 0 and 2 serve v0
        bad = {
            "publish out of order": lambda: b.publish(3),
            "unpublished version": lambda: b.set_version(2, 2, TRAINER),
            "set_version on a busy group": lambda: b.set_version(0, 1, TRAINER),
            "submit of another version": lambda: b.submit(2, [_spec(2, version=1)]),
            "submit over the free slots": lambda: b.submit(2, [_spec(10 + i) for i in range(9)]),
            "resubmit of a known id": lambda: b.submit(2, [_spec(1)]),
            "migrate across versions": lambda: b.migrate([1], 0, 1),
            "migrate of a request elsewhere": lambda: b.migrate([1], 2, 3),
            "interrupt of an unknown id": lambda: b.interrupt([999]),
        }
        for name, call in bad.items():
            before = _view(b)
            with pytest.raises(BackendError):
                call()
                pytest.fail(f"{kind}: {name} did not raise")
            assert _view(b) == before, f"{kind}: {name} changed the backend"
    finally:
        s.close()


# The real engines on the logical clock run sync and partial in the slow set (6 s each): the fake
# and simulated backends check those modes' invariants here, and the real ones run dora on both
# clocks and sync on the wall clock.
RUNS = [
    pytest.param(k, m, marks=pytest.mark.slow) if k == "real-logical" and m != "dora" else (k, m)
    for k in BACKENDS
    for m in ("dora", "sync", "partial")
    if not (k == "real-wall" and m == "partial")
]


@pytest.mark.parametrize(("kind", "mode"), RUNS)
def test_run_invariants(kind, mode, real_setup):
    orch = small_orchestrator(mode)
    s = Setup(kind, real_setup, orch)
    try:
        result = s.runtime.run(3, drain=True, max_ticks=100_000, stall_s=orch.stall_s)
        assert result.summary.steps >= 3
        assert_run_invariants(
            mode=mode,
            k=s.runtime.mode.k,
            group_size=4,
            num_groups=4,
            plan_period_ticks=orch.plan_period_ticks,
            runtime=s.runtime,
            records=result.records,
            ledger=result.ledger,
            trainer_batches=s.batches(),
            live_requests=s.backend.live_requests(),
        )
        if mode == "partial":
            assert result.summary.reprefill_tokens > 0  # the baseline re-prefills; dora never
        if kind == "real-logical" and mode == "dora":  # (the wall clock's: test_wall_clock.py)
            _check_migrated_requests_continue_bit_identically(s, real_setup)
    finally:
        s.close()


def _check_migrated_requests_continue_bit_identically(s: Setup, real_setup) -> None:
    cfg, _, _ = real_setup
    migrated = [(rid, v, c) for rid, v, c in s.consumed if c.migrations > 0]
    assert migrated, f"{s.kind}: the run migrated no consumed request"
    engine = Engine(cfg.model, cfg.rollout, make_mesh(jax.devices()[7:8], 1, 1), NO_EOS)
    for rid, version, comp in migrated[:3]:
        assert comp.prefill_tokens == len(comp.prompt.tokens)  # prefilled once, never again
        engine.load_params(s.grpo.params_for(version), version)
        engine.submit(
            [
                Request(
                    rid,
                    list(comp.prompt.tokens),
                    version,
                    request_key(cfg.seed, rid),
                    len(comp.tokens),
                )
            ]
        )
        (again,) = [f for _ in range(200) for f in engine.step().finished][:1]
        assert again.tokens == comp.tokens
        assert again.logprobs == comp.logprobs


@pytest.mark.parametrize("kind", ["real-logical", "real-wall"])
def test_real_backend_ends_a_response_at_any_of_several_eos_ids(kind, real_setup):
    """Several EOS ids (the tokenizer's, as Qwen2.5-Instruct's <|im_end|> and <|endoftext|>)
    reach every engine: a completion ends at the first of any of them, finish reason "eos", with
    the tokens of a run without EOS before it; the others run to their length."""
    cfg, meshes, params = real_setup
    stops = (7, 9)
    runs = {}
    for eos in (NO_EOS, stops):
        clock, bus = (WallClock() if kind == "real-wall" else LogicalClock()), Bus()
        backend = EngineBackend(
            cfg.model,
            cfg.rollout,
            meshes.groups,
            eos,
            params,
            lambda v: params,
            seed=cfg.seed,
            clock=clock,
            bus=bus,
        )
        done = {}
        try:
            for g in range(4):
                backend.submit(g, [_spec(4 * g + i) for i in range(1, 5)])
            for _ in range(10_000):
                done.update({f.request_id: f.payload for f in backend.step().finished})
                if len(done) == 16:
                    break
        finally:
            backend.close()
        assert len(done) == 16, f"{kind}: {len(done)} of 16 requests finished"
        runs[eos] = done
    ended = 0
    for rid, free in runs[NO_EOS].items():
        got = runs[stops][rid]
        cut = next((i for i, t in enumerate(free.tokens) if t in stops), None)
        if cut is None:
            assert got.tokens == free.tokens and got.finish_reason == "length"
        else:
            ended += 1
            assert got.tokens == free.tokens[: cut + 1] and got.finish_reason == "eos"
    assert ended >= 4  # several requests did stop on one of the ids
