"""The simulator's multi-turn (agentic) conversations: the workload, the backend's turn
boundaries (slot freed, KV kept, extend-only prefill, migration and interrupts with their turn
state), every mode's invariants with conversations, the figures and the timeline, and that a
config without a ``turns`` section runs exactly as before conversations existed."""

import hashlib
import math
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from invariants import assert_run_invariants  # tests/invariants.py

from dora_jax.config.schema import ConfigError, OrchestratorConfig
from dora_jax.orchestrator import MODES, Runtime, mode_for
from dora_jax.orchestrator.backend import TRAINER, RequestSpec
from dora_jax.sim import report
from dora_jax.sim.backend import SimBackend
from dora_jax.sim.config import (
    EfficiencyConfig,
    LatencyConfig,
    ObservationConfig,
    PromptConfig,
    ResponseConfig,
    TurnsConfig,
    load_sim_config,
)
from dora_jax.sim.conversations import (
    US,
    Conversations,
    conversation_stats,
    load_seconds,
    load_turns,
)
from dora_jax.sim.cost_model import CostModel
from dora_jax.sim.hardware import get_hardware
from dora_jax.sim.models import ModelSpec, get_model
from dora_jax.sim.requests import FIELDS
from dora_jax.sim.run import build, simulate
from dora_jax.sim.trainer import SimTrainer
from dora_jax.sim.workload import ResponseLengths, SimPrompts

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "sim" / "tiny_qwen7b_h100.yaml"
AGENTIC = ROOT / "configs" / "sim" / "qwen32b_h800_64_agentic.yaml"
# the tiny config with conversations: ~3 turns of ~200 tokens, tools of ~1 s (p99 20 s)
TURNS = [
    "turns.median=3",
    "turns.p99_ratio=8",
    "turns.max_turns=16",
    "turns.max_total_tokens=8192",
    "turns.observation.median=100",
    "turns.latency.median_s=1.0",
    "turns.latency.p99_ratio=20",
    "response.median=200",
    "run.steps=6",
    "run.warmup_steps=1",
]
COST = CostModel(get_model("qwen2.5-7b"), get_hardware("h100"), 2, EfficiencyConfig())


def tiny(*extra: str):
    return load_sim_config(TINY, [*TURNS, *extra])


@pytest.fixture(scope="module")
def runs():
    cfg = tiny()
    return {m: simulate(cfg, m) for m in ("sync", "partial", "dora")}


def consumed_plan(run):
    """The plan of every consumed trajectory of ``run`` and its conversation log, row by row."""
    rec = run.result.records
    conv = run.backend.conversations
    pg = np.array([c.prompt_group for c in rec.consumed])
    rid = np.array([c.request_id for c in rec.consumed])
    log = run.backend.waiting.conversation_log()
    rows = np.searchsorted(log["rid"], rid)
    assert np.array_equal(log["rid"][rows], rid)
    return conv.plan(pg, rid % conv.group_size), {k: v[rows] for k, v in log.items()}


# -- the workload ------------------------------------------------------------------------------


def test_workload_is_a_pure_function_with_the_configured_shape():
    cfg = TurnsConfig(median=4, p99_ratio=10, max_turns=1000, max_total_tokens=10**9)
    resp = ResponseConfig(median=300, p99_ratio=8, max_tokens=10**6)
    a = Conversations(cfg, ResponseLengths(resp, 16, seed=3), seed=3)
    b = Conversations(cfg, ResponseLengths(resp, 16, seed=3), seed=3)
    pg, j = np.array([7, 90_000, 7, 3]), np.array([0, 15, 4, 2])
    b.plan(np.array([123_456]), np.array([1]))  # touch other prompt groups first
    pa, pb = a.plan(pg, j), b.plan(pg, j)
    for f in ("turns", "model_tokens", "observation_tokens", "env_s"):
        assert np.array_equal(getattr(pa, f), getattr(pb, f))
    assert np.array_equal(a.plan(pg[[3, 1]], j[[3, 1]]).turns, pa.turns[[3, 1]])
    other = Conversations(cfg, ResponseLengths(resp, 16, seed=4), seed=4).sample(64)
    assert not np.array_equal(a.sample(64).turns, other.turns)
    # shapes: turns median / p99, observations, latency; turn 0 is the single-turn length
    s = a.sample(2000)
    assert abs(np.median(s.turns) / 4 - 1) < 0.15
    assert 7 < np.percentile(s.turns, 99) / np.median(s.turns) < 14
    first = a.model_tokens(np.arange(50), np.zeros(50, int), 0)
    assert np.array_equal(first, a.lengths.lengths(np.arange(50), np.zeros(50, int)))
    n = 20_000
    obs = a.observation_tokens(np.arange(n) // 16, np.arange(n) % 16, 1)
    assert abs(np.median(obs) / 200 - 1) < 0.05
    lat = a.latency_us(np.arange(n) // 16, np.arange(n) % 16, 2) / US
    assert abs(np.median(lat) - 1.0) < 0.05
    assert abs(np.percentile(lat, 99) / np.median(lat) / 30 - 1) < 0.25
    # hard prompts get more turns: turns correlate with the prompt's response lengths
    pgs = np.arange(3000)
    zp = a.lengths.difficulty(pgs)
    assert np.corrcoef(zp, np.log(a.turns(pgs, np.zeros(3000, int))))[0, 1] > 0.5


def test_token_cap_and_measured_latencies(tmp_path):
    cfg = TurnsConfig(median=30, p99_ratio=2, max_turns=64, max_total_tokens=2000)
    resp = ResponseConfig(median=300, p99_ratio=4, max_tokens=4000)
    p = Conversations(cfg, ResponseLengths(resp, 4, seed=0)).sample(200)
    assert p.response_tokens.max() <= 2000 and (p.response_tokens == 2000).mean() > 0.5
    f = tmp_path / "lat.txt"
    f.write_text("# seconds\n0.5\n2\n\n8\n")
    lat = LatencyConfig(kind="file", path=str(f), max_s=5.0)
    c = Conversations(TurnsConfig(latency=lat), ResponseLengths(resp, 4))
    x = c.latency_us(np.arange(4000) // 4, np.arange(4000) % 4, 0) / US
    assert x.min() >= 0.5 and x.max() == 5.0 and abs(np.median(x) - 2.0) < 0.1
    f.write_text("0.5\n-1\n")
    with pytest.raises(ValueError, match=r"lat\.txt:2: seconds must be finite and > 0"):
        load_seconds(f)
    assert conversation_stats(c, 4, 2)["turns"]["median"] >= 1


def test_measured_turn_counts_and_latencies_per_prompt(tmp_path):
    f = tmp_path / "turns.txt"
    f.write_text("# turns\n" + "1\n" * 50 + "2\n" * 30 + "3\n" * 15 + "9\n" * 5)
    resp = ResponseConfig(median=20, p99_ratio=2, max_tokens=100)
    lat = LatencyConfig(median_s=0.1, p99_ratio=10, per_prompt=True)
    cfg = TurnsConfig(
        kind="file", path=str(f), max_turns=8, prompt_corr=0.0, max_total_tokens=10**6, latency=lat
    )
    c = Conversations(cfg, ResponseLengths(resp, 8, seed=1), seed=1)
    n = 40_000
    turns = c.turns(np.arange(n) // 8, np.arange(n) % 8)
    # the measured distribution, by quantile (9 capped at max_turns)
    for v, share in ((1, 0.5), (2, 0.3), (3, 0.15), (8, 0.05)):
        assert abs(np.mean(turns == v) - share) < 0.015, v
    assert set(np.unique(turns)) == {1, 2, 3, 8}
    assert np.array_equal(c.turns(np.arange(n) // 8, np.arange(n) % 8), turns)  # pure
    # prompt_corr: the members of a prompt group share their turns' draw
    same = Conversations(replace(cfg, prompt_corr=1.0), ResponseLengths(resp, 8, seed=1), seed=1)
    t1 = same.turns(np.arange(8000) // 8, np.arange(8000) % 8).reshape(-1, 8)
    assert np.all(t1 == t1[:, :1]) and len(np.unique(t1)) == 4
    # per_prompt: call t takes the same time in every member, another at another call
    pg, j = np.repeat(np.arange(50), 8), np.tile(np.arange(8), 50)
    x = c.latency_us(pg, j, 1).reshape(50, 8)
    assert np.all(x == x[:, :1]) and len(np.unique(x[:, 0])) == 50
    assert not np.array_equal(x, c.latency_us(pg, j, 2).reshape(50, 8))
    own = Conversations(replace(cfg, latency=replace(lat, per_prompt=False)), c.lengths, seed=1)
    assert len(np.unique(own.latency_us(pg, j, 1))) == 400
    with pytest.raises(FileNotFoundError, match="turn count file"):
        load_turns(tmp_path / "none.txt")
    f.write_text("2\n0\n")
    with pytest.raises(ValueError, match=r"turns\.txt:2: turns must be >= 1"):
        load_turns(f)
    f.write_text("2\nx\n")
    with pytest.raises(ValueError, match=r"turns\.txt:2: expected a number of turns"):
        load_turns(f)


def test_config_errors_name_the_turns_fields():
    with pytest.raises(ConfigError, match=r"^turns\.latency\.p99_ratio: must be >= 1"):
        load_sim_config(overrides=["turns.latency.p99_ratio=0.5"])
    with pytest.raises(ConfigError, match=r"^turns\.latency\.path: kind 'file' needs a path"):
        load_sim_config(overrides=["turns.latency.kind=file"])
    with pytest.raises(ConfigError, match=r"^turns\.observation\.median: must be > 0"):
        load_sim_config(overrides=["turns.observation.median=0"])
    with pytest.raises(ConfigError, match=r"^turns\.max_turns: must be >= 1"):
        load_sim_config(overrides=["turns.max_turns=0"])
    with pytest.raises(ConfigError, match=r"^turns\.path: kind 'file' needs a path"):
        load_sim_config(overrides=["turns.kind=file"])
    with pytest.raises(ConfigError, match=r"^turns\.latency\.workers: must be >= 0"):
        load_sim_config(overrides=["turns.latency.workers=-1"])
    with pytest.raises(ConfigError, match=r"^turns\.medain: unknown key; did you mean 'median'"):
        load_sim_config(overrides=["turns.medain=3"])
    assert load_sim_config().turns is None


# -- the backend at a turn boundary --------------------------------------------------------------


class FixedConversations:
    """Two turns of ``model`` tokens, ``obs`` observation tokens, ``latency_s`` between them (a
    :class:`Conversations` stand-in with round numbers)."""

    group_size = 4

    def __init__(self, model=40, obs=24, latency_s=2.0, turns=2, workers=0):
        self.model, self.obs, self.lat, self.turns = model, obs, latency_s, turns
        self.cfg = TurnsConfig(latency=LatencyConfig(workers=workers))  # (only workers is read)

    def first_target(self, pg, members):
        return np.full(np.shape(pg), self.model, np.int64)

    def after_turn(self, pg, members, turn, gen):
        turn, gen = np.asarray(turn), np.asarray(gen)
        shape = turn.shape
        goes = turn + 1 < self.turns
        obs = np.full(shape, self.obs, np.int64)
        return goes, obs, np.full(shape, int(self.lat * US)), gen + obs + self.model


def conv_backend(groups=1, slots=1, tick_s=0.1, **kw) -> SimBackend:
    lengths = ResponseLengths(ResponseConfig(), 4)
    conv = FixedConversations(**kw)
    return SimBackend(COST, groups, lengths, tick_s=tick_s, max_slots=slots, conversations=conv)


def spec(rid, version=0, plen=64, resume=None):
    return RequestSpec(rid, rid // 4, version, plen, resume=resume)


def step_until(b: SimBackend, cond, limit=2000):
    events = []
    while not cond() and b.tick < limit:
        events.append(b.step())
    assert cond(), "condition never held"
    return events


def test_env_wait_frees_the_slot_keeps_the_kv_and_prefills_only_the_observation():
    b = conv_backend(slots=1)
    q = b.requests
    b.submit(0, [spec(0)])
    assert b.groups()[0].free_slots == 0
    ev = step_until(b, lambda: q.wake_us[0, 0] > 0)  # turn 0 ends: A waits on its environment
    ended = len(ev) - 1
    info = b.groups()[0]
    assert info.requests == (0,) and info.free_slots == 1  # its slot is free, it is still held
    assert info.kv_pages_used == math.ceil((64 + 40) / 16)  # its KV stays counted
    assert q.wake_us[0, 0] == pytest.approx((ended * 0.1 + 2.0) * US, abs=0.1 * US)
    b.submit(0, [spec(1)])  # B takes the slot and decodes while A waits
    *during, woke = step_until(b, lambda: q.wake_us[0, 0] == 0)
    assert sum(e.groups[0].tokens for e in during) > 0 and q.generated[0, 1] > 0
    assert q.generated[0, 0] >= 40 + 24  # the observation joined A's context
    assert q.observation_tokens[0, 0] == 24
    assert woke.groups[0].prefill_tokens == 24  # and only it was prefilled
    assert b.waiting.waiting_requests[ended][0] == 1 and b.waiting.waiting_kv[ended][0] == 64 + 40
    assert all(w[0] >= 1 for w in b.waiting.waiting_requests[ended : ended + len(during)])
    waited = (len(during) + 1) * 0.1
    assert abs(waited - 2.0) <= 0.2
    rest = [woke, *step_until(b, lambda: not b.live_requests())]
    prefill = sum(e.groups[0].prefill_tokens for e in ev + during + rest)
    assert prefill == 64 + 64 + 24 + 24  # both prompts, both observations: no re-prefill
    assert sum(e.groups[0].reprefill_tokens for e in ev + during + rest) == 0
    done = {f.request_id: f for e in ev + during + rest for f in e.finished}
    assert done[0].response_len == 40 + 24 + 40 and done[0].versions == (0,)
    log = b.waiting.conversation_log()
    assert log["turns"].tolist() == [2, 2] and log["observation_tokens"].tolist() == [24, 24]
    assert log["model_tokens"].tolist() == [80, 80] and log["env_us"].tolist() == [2 * US] * 2


def test_a_group_decodes_at_most_max_slots_and_wakes_the_oldest_first():
    b = conv_backend(slots=1, latency_s=0.3)
    q = b.requests
    b.submit(0, [spec(0)])
    step_until(b, lambda: q.wake_us[0, 0] > 0)
    b.submit(0, [spec(1)])
    step_until(b, lambda: q.wake_us[0, 0] == 0)  # A is back: 2 held, 1 slot
    assert b.groups()[0].free_slots == 0
    g1 = int(q.generated[0, 1])
    b.step()
    assert int(q.generated[0, 1]) == g1  # the newer one waits for the slot (A prefills, decodes)


def test_environment_workers_take_one_call_at_a_time_in_turn_order():
    def calls(workers):
        b = conv_backend(slots=3, latency_s=1.0, turns=3, workers=workers)
        b.submit(0, [spec(0), spec(1), spec(2)])
        done = {}
        while b.live_requests():
            done.update({f.request_id: f for f in b.step().finished})
        return b, done

    free, done0 = calls(0)
    assert free.waiting.env_calls == [] and free.waiting.workers == 0
    one, done1 = calls(1)
    two, done2 = calls(2)
    # the same conversations whatever the workers: tokens, turns, environment seconds
    assert {r: f.response_len for r, f in done1.items()} == {
        r: f.response_len for r, f in done0.items()
    }
    for b in (one, two):
        log = b.waiting.conversation_log()
        assert log["turns"].tolist() == [3] * 3 and log["env_us"].tolist() == [2 * US] * 3
    # three conversations end each turn in the same tick: one worker runs their calls back to
    # back (in request order on ties), two workers hold 2 + 1 conversations (fewest first)
    assert [w for w, *_ in one.waiting.env_calls] == [0] * 6
    assert [w for w, *_ in two.waiting.env_calls[:3]] == [0, 1, 0]
    for b in (one, two):
        for w in range(b.waiting.workers):
            mine = [(s, e) for x, s, e, _ in b.waiting.env_calls if x == w]
            assert all(e - s == US for s, e in mine)  # a call's own second
            assert all(s2 >= e1 for (_, e1), (s2, _) in pairwise(mine))  # one at a time
    q1 = [q for *_, q in one.waiting.env_calls[:3]]
    assert q1[0] < q1[1] < q1[2] and q1[2] - q1[0] == 2 * US
    assert [q for *_, q in two.waiting.env_calls[:3]] == [0, 0, US]
    assert one.tick > two.tick > free.tick
    assert (one.waiting.live == 0).all() and (two.waiting.live == 0).all()
    assert not two.waiting.worker_of


def test_a_run_with_environment_workers_keeps_the_workload(runs):
    slow = tiny("turns.latency.workers=4")
    for mode in ("sync", "partial", "dora"):
        run = simulate(slow, mode)
        plan, log = consumed_plan(run)
        assert np.array_equal(plan.turns, log["turns"])
        assert np.array_equal(np.rint(plan.env_s * US).astype(np.int64), log["env_us"])
        for w in range(4):  # each worker runs one call at a time
            mine = [(s, e) for x, s, e, _ in run.backend.waiting.env_calls if x == w]
            assert mine and all(s2 >= e1 for (_, e1), (s2, _) in pairwise(mine))
        assert sum(q for *_, q in run.backend.waiting.env_calls) > 0
        m0 = runs[mode].metrics.conversations.model_tokens_per_s
        assert run.metrics.conversations.model_tokens_per_s < m0


def test_a_waiting_request_migrates_with_its_turn_state():
    def run(migrate: bool):
        b = conv_backend(groups=2, slots=2)
        q = b.requests
        b.submit(0, [spec(0), spec(1)])
        step_until(b, lambda: q.wake_us[0, 0] > 0 and q.wake_us[0, 1] > 0)
        if migrate:
            before = [int(getattr(q, f)[0, 0]) for f in FIELDS]
            b.migrate([0], 0, 1)
            assert [int(getattr(q, f)[1, 0]) for f in FIELDS] == before  # turn, wake_us, ...
            assert b.mig[1] == pytest.approx(COST.kv_transfer_s(64 + 40))
            assert b.groups()[1].requests == (0,) and b.groups()[0].requests == (1,)
        out = {}
        while b.live_requests():
            for f in b.step().finished:
                out[f.request_id] = (f.response_len, f.versions)
        return out, b.waiting.conversation_log()

    (moved, log_m), (stay, log_s) = run(True), run(False)
    assert moved == stay
    assert all(np.array_equal(log_m[k], log_s[k]) for k in log_s)


def test_a_waiting_request_interrupted_reprefills_its_conversation_and_keeps_its_turns():
    b = conv_backend(slots=2, latency_s=1.0)
    q = b.requests
    b.submit(0, [spec(0)])
    step_until(b, lambda: q.wake_us[0, 0] > 0)
    wake = int(q.wake_us[0, 0])
    (p,) = b.interrupt([0])
    assert p.generated == 40 and p.versions == (0,)
    b.publish(1)
    b.set_version(0, 1, TRAINER)
    b.submit(0, [spec(0, version=1, resume=p)])
    assert q.wake_us[0, 0] == wake and q.turn[0, 0] == 1  # still waiting on the same call
    reprefill = prefill = 0
    done = {}
    while b.live_requests():
        ev = b.step()
        reprefill += ev.groups[0].reprefill_tokens
        prefill += ev.groups[0].prefill_tokens
        done.update({f.request_id: f for f in ev.finished})
    assert reprefill == 64 + 40  # the whole conversation so far, under the new version
    assert prefill == 64 + 40 + 24
    assert done[0].response_len == 104 and done[0].versions == (0, 1)


# -- runs: every mode --------------------------------------------------------------------------


def test_the_workload_is_identical_across_modes(runs):
    seen = {}
    for mode, run in runs.items():
        plan, log = consumed_plan(run)
        assert len(log["rid"]) > 100
        for f in ("turns", "model_tokens", "observation_tokens"):
            assert np.array_equal(getattr(plan, f), log[f]), (mode, f)
        assert np.allclose(plan.env_s, log["env_us"] / US)
        resp = [c.response_len for c in run.result.records.consumed]
        assert resp == plan.response_tokens.tolist()
        seen[mode] = dict(zip(log["rid"].tolist(), log["model_tokens"].tolist(), strict=True))
    common = set(seen["sync"]) & set(seen["dora"]) & set(seen["partial"])
    assert len(common) > 100
    assert all(seen["sync"][r] == seen["dora"][r] == seen["partial"][r] for r in common)
    assert consumed_plan(runs["dora"])[0].turns.max() > 3  # long conversations among them


def test_one_version_per_conversation_outside_partial(runs):
    for mode in ("sync", "dora"):
        rec = runs[mode].result.records
        assert {c.version_span for c in rec.consumed} == {1}
        assert runs[mode].metrics.conversations.reprefill_tokens == 0
    live = [len({g.version for g in row if g.active}) for row in runs["dora"].result.records.groups]
    assert max(live) >= 2  # dora ran several versions side by side
    p = runs["partial"].metrics
    assert p.max_version_span >= 2 and p.conversations.reprefill_tokens > 0
    assert p.conversations.reprefill_tokens == sum(
        g.reprefill_tokens for row in runs["partial"].result.records.groups for g in row
    )


def test_figures_and_timeline(runs, tmp_path):
    for mode, run in runs.items():
        c = run.metrics.conversations
        assert 0 < c.trajectories <= len(run.result.records.consumed)
        assert 1 <= c.turns_mean <= c.turns_p99 <= c.turns_max <= 16
        assert c.env_s_mean > 0 and c.env_s_p99 >= c.env_s_mean
        assert 0 < c.waiting_mean <= c.waiting_max
        assert 0 < c.waiting_kv_tokens_mean <= c.waiting_kv_tokens_max
        assert 0 < c.waiting_kv_frac_mean < 1 and 0 <= c.env_wait_frac <= run.metrics.bubble
        assert 0 < c.model_tokens_per_s < run.metrics.tokens_per_s
        assert sum(np.sum(x) for x in run.backend.waiting.env_wait_s) > 0, mode
    text = report.conversation_table([r.metrics for r in runs.values()])
    assert "dora/dis" in text and "model tok/s" in text
    png = report.timeline_png(runs["dora"], tmp_path / "t.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    from dora_jax.report import ENV_WAIT_RGB, _tick_layout

    rec, b = runs["sync"].result.records, runs["sync"].backend
    n = len(rec.groups)  # (a column per tick)
    gold = _tick_layout(rec, None, n, None, np.asarray(b.waiting.env_wait_s) / 0.5).img
    assert np.any(np.all(np.isclose(gold, ENV_WAIT_RGB), axis=-1))  # gold where only waits
    plain = _tick_layout(rec, None, n, None, None).img
    assert not np.any(np.all(np.isclose(plain, ENV_WAIT_RGB), axis=-1))


def test_dora_migrates_waiting_conversations_and_they_keep_their_turns():
    cfg = tiny("orchestration.kv_pressure_threshold=0.3", "run.steps=8")
    runtime, backend, trainer = build(cfg, "dora")
    moved = []
    inner = backend.migrate

    def migrate(ids, src, dst):
        rows = backend.requests.rows(src, ids)
        moved.append(int((backend.requests.wake_us[src, rows] > 0).sum()))
        inner(ids, src, dst)

    backend.migrate = migrate
    result = runtime.run(cfg.run.steps, drain=True, max_ticks=200_000)
    assert sum(moved) > 0  # some requests moved while waiting on their environment
    rec = result.records
    conv = backend.conversations
    pg = np.array([c.prompt_group for c in rec.consumed])
    rid = np.array([c.request_id for c in rec.consumed])
    want = conv.plan(pg, rid % conv.group_size).response_tokens
    assert [c.response_len for c in rec.consumed] == want.tolist()
    assert {c.version_span for c in rec.consumed} == {1}


# a 0.2B-parameter toy (as in test_sim_properties): ~2 ms decode steps, ~10 ms weight loads
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


@st.composite
def conversation_runs(draw):
    mode = draw(st.sampled_from(MODES))
    tbs = draw(st.integers(1, 3))
    orch = OrchestratorConfig(
        mode=mode,
        staleness_k=draw(st.integers(1, 3)),
        train_batch_prompts=tbs,
        rollout_batch_prompts=draw(st.integers(tbs, 3 * tbs)),
        plan_period_ticks=draw(st.integers(1, 8)),
        kv_pressure_threshold=draw(st.sampled_from([0.3, 0.9])),
    )
    turns = TurnsConfig(
        median=draw(st.sampled_from([1.0, 2.0, 4.0])),
        p99_ratio=draw(st.sampled_from([1.0, 5.0])),
        max_turns=draw(st.integers(1, 8)),
        max_total_tokens=draw(st.sampled_from([40, 400])),
        observation=ObservationConfig(median=draw(st.sampled_from([2.0, 10.0])), max_tokens=20),
        latency=LatencyConfig(median_s=draw(st.sampled_from([0.001, 0.02])), p99_ratio=10),
    )
    placement = "disaggregated"
    if mode in ("sync", "partial", "oversample"):
        placement = draw(st.sampled_from(["disaggregated", "colocated"]))
    sim = dict(
        placement=placement,
        groups=draw(st.integers(1, 4)),
        slots=draw(st.integers(1, 4)),
        kv=draw(st.sampled_from([None, 200])),
        tick_s=draw(st.sampled_from([0.002, 0.01])),
        G=draw(st.integers(2, 3)),
        steps=draw(st.integers(2, 4)),
        seed=draw(st.integers(0, 2**16)),
    )
    return orch, turns, sim


@given(conversation_runs())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_invariants_hold_with_conversations_in_every_mode(w):
    orch, turns, sim = w
    cost = CostModel(TOY, get_hardware("h100"), 1, EfficiencyConfig(train_step_overhead_s=0.01))
    response = ResponseConfig(median=6.0, p99_ratio=6.0, max_tokens=60)
    lengths = ResponseLengths(response, sim["G"], sim["seed"])
    conv = Conversations(turns, lengths, sim["seed"])
    backend = SimBackend(
        cost,
        sim["groups"],
        lengths,
        tick_s=sim["tick_s"],
        max_slots=sim["slots"],
        max_prompt_len=32,
        admit_reserve_tokens=16,
        kv_capacity_tokens=sim["kv"],
        conversations=conv,
    )
    colocated = backend if sim["placement"] == "colocated" else None
    trainer = SimTrainer(cost, 8, sim["tick_s"], colocated_with=colocated, clock=backend)
    prompts = SimPrompts(PromptConfig(median=12, p99_ratio=2, min_tokens=1, max_tokens=32), 1)
    runtime = Runtime(orch, sim["G"], backend, trainer, prompts)
    result = runtime.run(sim["steps"], drain=True, max_ticks=300_000)
    rec = result.records
    assert_run_invariants(
        mode=orch.mode,
        k=mode_for(orch).k,
        group_size=sim["G"],
        num_groups=sim["groups"],
        plan_period_ticks=orch.plan_period_ticks,
        runtime=runtime,
        records=rec,
        ledger=result.ledger,
        trainer_batches=trainer.batches,
        live_requests=backend.live_requests(),
    )
    # every consumed conversation is the one the workload drew for it
    pg = np.array([c.prompt_group for c in rec.consumed])
    rid = np.array([c.request_id for c in rec.consumed])
    plan = conv.plan(pg, rid % sim["G"])
    assert [c.response_len for c in rec.consumed] == plan.response_tokens.tolist()
    # prefill = every admitted prompt and every observation once, plus what was re-prefilled
    # (partial: a request interrupted again before its re-prefill ended counts only what it had
    # cached then as re-prefill, as single-turn requests always have: hence >=)
    log = backend.waiting.conversation_log()
    prefill = sum(g.prefill_tokens for row in rec.groups for g in row)
    reprefill = sum(g.reprefill_tokens for row in rec.groups for g in row)
    once = sum(c.prompt_len for c in rec.consumed) + int(log["observation_tokens"].sum())
    if orch.mode == "partial":
        assert prefill - reprefill >= once
    elif orch.mode != "oversample":  # (aborted requests leave no conversation record)
        assert prefill == once and reprefill == 0
    sampled = sum(g.tokens for row in rec.groups for g in row)
    model = int(log["model_tokens"].sum())
    assert sampled >= model if orch.mode == "oversample" else sampled == model
    # modeled time is conserved
    spent = np.sum(backend.seconds, axis=0).sum()
    budget = len(rec.groups) * sim["groups"] * sim["tick_s"]
    assert budget - sim["groups"] * 0.05 <= spent <= budget + 1e-9


# -- without a turns section: as before --------------------------------------------------------

# Figures of the tiny config (run.steps=5, run.warmup_steps=1) made by the simulator before
# conversations existed (commit 36165c9), with a digest of every group tick and consumed record.
BEFORE = {
    ("sync", "disaggregated"): (2708.182926829268, 386, "77e8ea670db7db09"),
    ("partial", "colocated"): (6193.796178343949, 189, "bbc7be2806ab961c"),
    ("partial", "disaggregated"): (8036.578512396694, 154, "aec3e177eb2c7396"),
    ("dora", "disaggregated"): (8382.98275862069, 149, "9d5f3d012280a311"),
}


def digest(run) -> str:
    h = hashlib.sha256()
    for row in run.result.records.groups:
        h.update(repr(tuple(tuple(g) for g in row)).encode())
    for c in run.result.records.consumed:
        h.update(repr(c).encode())
    return h.hexdigest()[:16]


def test_without_turns_the_runs_are_those_of_before():
    cfg = load_sim_config(TINY, ["run.steps=5", "run.warmup_steps=1"])
    for (mode, placement), (tps, ticks, dig) in BEFORE.items():
        run = simulate(cfg, mode, placement)
        assert run.metrics.conversations is None and run.backend.conversations is None
        assert (run.metrics.tokens_per_s, run.metrics.ticks, digest(run)) == (tps, ticks, dig)
        assert run.backend.waiting.waiting_requests == []


def test_one_turn_conversations_run_exactly_as_single_turn_requests():
    base = ["run.steps=5", "run.warmup_steps=1"]
    one = [*base, "turns.max_turns=1", "turns.max_total_tokens=100000"]
    for mode, placement in (("partial", "colocated"), ("dora", "disaggregated")):
        a = simulate(load_sim_config(TINY, base), mode, placement)
        b = simulate(load_sim_config(TINY, one), mode, placement)
        assert b.backend.conversations is not None
        assert digest(a) == digest(b)
        assert b.metrics.conversations.turns_max == 1
        assert b.metrics.conversations.env_wait_frac == 0


def test_the_agentic_preset_loads():
    cfg = load_sim_config(AGENTIC)
    assert cfg.turns is not None and cfg.cluster.hardware == "h800"
    assert set(cfg.run.modes) >= {"sync", "partial", "dora"}
    stats = conversation_stats(
        Conversations(cfg.turns, ResponseLengths(cfg.response, cfg.orchestration.group_size)),
        cfg.orchestration.train_batch_prompts,
        2,
    )
    assert stats["turns"]["median"] == 4 and stats["turns"]["p99"] >= 30
