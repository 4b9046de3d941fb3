"""A mode written outside the package, registered, runs through the runtime unchanged.

``restart`` streams like ``partial`` (K from the config, RBS prompt groups in flight), but at a
weight update it neither lets in-flight requests finish under their version (``dora``) nor
re-prefills them under the new one (``partial``): every prompt group still in flight is
discarded whole, running members interrupted and finished ones dropped, and its prompt is
sampled again from scratch under the new version. No trajectory spans two versions, none is
re-prefilled, and the work thrown away is counted as discarded.
"""

from collections import deque

import pytest
from invariants import assert_run_invariants  # tests/invariants.py

from dora_jax.config import load_config, schema
from dora_jax.config.schema import ConfigError, OrchestratorConfig
from dora_jax.orchestrator import FakeBackendConfig, Mode, modes, register_mode, run_fake
from dora_jax.orchestrator.rollout_manager import PromptSpec

# a small long-tailed workload (p99 / median = 12) whose long requests outlast a train step
BACKEND = FakeBackendConfig(
    num_groups=4,
    max_slots=4,
    max_prompt_len=64,
    max_new_tokens=400,
    length_median=20,
    length_p99_ratio=12,
    prefill_tokens_per_tick=32,
    weight_transfer_ticks=3,
    migrate_ticks=1,
    seed=1,
)


class Replay:
    """A prompt source that remembers the prompt of every prompt group it fed (the runtime
    numbers them in dispatch order) and hands restarted prompts out again before new ones."""

    def __init__(self, inner, first_prompt_group: int):
        self.inner, self.next_pg = inner, first_prompt_group
        self.prompt_of: dict[int, PromptSpec] = {}
        self.again: deque[PromptSpec] = deque()
        self.replayed = 0

    def next_prompt(self) -> PromptSpec:
        if self.again:
            prompt, self.replayed = self.again.popleft(), self.replayed + 1
        else:
            prompt = self.inner.next_prompt()
        self.prompt_of[self.next_pg], self.next_pg = prompt, self.next_pg + 1
        return prompt


class Restart(Mode):
    name = "restart"

    def __init__(self, cfg: OrchestratorConfig):
        super().__init__(cfg)
        self.restarted = 0  # prompt groups discarded at an update, their prompts queued again

    def route(self, rt, t, infos):
        if not isinstance(rt.manager.prompts, Replay):
            rt.manager.prompts = Replay(rt.manager.prompts, rt.manager.dispatched_prompt_groups)
        return super().route(rt, t, infos)

    def on_publish(self, rt, t, version):
        open_groups = rt.queue.open_groups()
        replay = rt.manager.prompts
        replay.again.extend(replay.prompt_of[pg] for pg in open_groups)
        self.restarted += len(open_groups)
        rt.discard(t, open_groups)  # the emptied groups switch to `version` in route


@pytest.fixture
def restart(monkeypatch):
    """``restart`` registered for one test; the (process-wide) registry is left as found."""
    monkeypatch.setattr(modes, "_FACTORIES", dict(modes._FACTORIES))
    monkeypatch.setattr(schema, "Mode", schema.Mode)
    register_mode("restart", Restart)
    return Restart


def _run(k=2, steps=8, drain=False, seed=1):
    cfg = OrchestratorConfig(
        mode="restart",
        staleness_k=k,
        train_batch_prompts=2,
        rollout_batch_prompts=4,
        plan_period_ticks=8,
    )
    backend = FakeBackendConfig(**{**BACKEND.__dict__, "seed": seed})
    return cfg, run_fake(
        cfg, 4, backend, num_steps=steps, step_ticks=10, prompt_len=(8, 64), drain=drain
    )


def test_restart_mode_runs_through_the_runtime(restart):
    cfg, run = _run()
    rt, rec, s = run.runtime, run.result.records, run.result.summary
    assert isinstance(rt.mode, Restart) and rec.mode == "restart" and s.mode == "restart"
    # every step published, each on TBS whole prompt groups
    assert rt.steps_done == 8 and [v for v, _ in run.trainer.batches] == list(range(8))
    assert all(len(ids) == 2 * 4 for _, ids in run.trainer.batches)
    assert [st.version for st in rec.steps] == list(range(1, 9))
    # what makes it differ from partial: nothing re-prefilled, one version per trajectory ...
    assert s.reprefill_tokens == 0 and s.max_version_span == 1
    assert all(c.version_span == 1 for c in rec.consumed)
    assert 0 < s.staleness_max <= 2 and s.migrated == 0 and s.plans == 0
    # ... and from dora: what was in flight at an update is thrown away, at the update only
    assert s.discarded > 0 and {t for t, _ in rec.discards} <= {st.end for st in rec.steps}
    # the discarded prompts are sampled again, before any new prompt
    mode, replay = rt.mode, rt.manager.prompts
    assert mode.restarted * 4 == sum(n for _, n in rec.discards) == run.result.states["discarded"]
    assert replay.replayed + len(replay.again) == mode.restarted > 0


@pytest.mark.parametrize("k, seed", [(1, 1), (2, 3), (3, 5)])
def test_restart_mode_keeps_the_invariants(restart, k, seed):
    cfg, run = _run(k=k, steps=6, drain=True, seed=seed)
    assert_run_invariants(
        mode=cfg.mode,
        k=k,
        group_size=4,
        num_groups=BACKEND.num_groups,
        plan_period_ticks=cfg.plan_period_ticks,
        runtime=run.runtime,
        records=run.result.records,
        ledger=run.result.ledger,
        trainer_batches=run.trainer.batches,
        live_requests=run.backend.live_requests(),
        discards=True,
    )
    assert run.runtime.steps_done >= 6


def test_a_registered_mode_passes_config_validation(restart):
    cfg = load_config(None, ["orchestrator.mode=restart", "orchestrator.staleness_k=1"])
    assert cfg.orchestrator.mode == "restart"
    assert isinstance(modes.mode_for(cfg.orchestrator), Restart)
    from dora_jax.main import parse_args  # --mode takes the registered names

    assert parse_args(["--mode", "restart"]).mode == "restart"
    from dora_jax.sim.config import load_sim_config
    from dora_jax.sim.run import simulate

    sim = load_sim_config(None, ["run.modes=[restart]", "run.steps=4", "run.warmup_steps=1"])
    m = simulate(sim, "restart").metrics  # the simulator runs it too
    assert m.discarded > 0 and m.max_version_span == 1 and m.reprefill_frac == 0


def test_an_unknown_mode_is_refused_early():
    known = r"'sync', 'one_step', 'partial', 'oversample', 'dora'"
    with pytest.raises(
        ConfigError,
        match=rf"^orchestrator\.mode: expected one of {known}, got "
        r"'restart' \(from the command line",
    ):
        load_config(None, ["orchestrator.mode=restart"])  # (not registered here)
    with pytest.raises(ConfigError, match=r"^mode: expected one of .*'dora', got 'rsync'"):
        OrchestratorConfig(mode="rsync")


def test_an_unknown_mode_is_refused_with_the_registered_ones_listed(restart):
    with pytest.raises(ConfigError, match=r"^orchestrator\.mode: .*'dora', 'restart', got 'x'"):
        load_config(None, ["orchestrator.mode=x"])
