"""The simulated backend: its contract errors and its time model against the cost model."""

import math
from pathlib import Path

import numpy as np
import pytest

from dora_jax.orchestrator.backend import TRAINER, BackendError, PartialRequest, RequestSpec
from dora_jax.sim.backend import CATEGORIES, DECODE, IDLE, SimBackend
from dora_jax.sim.config import EfficiencyConfig, ResponseConfig
from dora_jax.sim.cost_model import CostModel
from dora_jax.sim.hardware import get_hardware
from dora_jax.sim.models import get_model

COST = CostModel(get_model("qwen2.5-7b"), get_hardware("h100"), 2, EfficiencyConfig())
G = 4


class FixedLengths:
    """Response length = scale * (request id % 10 + 1) (a ResponseLengths stand-in)."""

    group_size = G
    cfg = ResponseConfig()

    def __init__(self, scale: int = 100):
        self.scale = scale

    def lengths(self, pg, members):
        return self.scale * ((np.asarray(pg) * G + np.asarray(members)) % 10 + 1)


def backend(groups=2, slots=8, tick_s=0.5, scale=100, **kw) -> SimBackend:
    lengths = FixedLengths(scale)
    return SimBackend(COST, groups, lengths, tick_s=tick_s, max_slots=slots, **kw)


def spec(rid: int, version: int = 0, plen: int = 64, resume=None) -> RequestSpec:
    return RequestSpec(rid, rid // G, version, plen, resume=resume)


def run_until_done(b: SimBackend, limit: int = 10_000) -> dict[int, tuple[int, int]]:
    out = {}
    while b.live_requests() and b.tick < limit:
        ev = b.step()
        for f in ev.finished:
            out[f.request_id] = (ev.tick, f.response_len)
    return out


def test_contract_errors_change_nothing():
    b = backend()
    b.submit(0, [spec(0)])
    with pytest.raises(BackendError, match="already submitted"):
        b.submit(1, [spec(0)])
    with pytest.raises(BackendError, match="version"):
        b.submit(1, [spec(1, version=1)])
    with pytest.raises(BackendError, match="prompt_len"):
        b.submit(1, [spec(1, plen=5000)])
    with pytest.raises(BackendError, match="slots"):
        b.submit(1, [spec(i) for i in range(10, 19)])
    with pytest.raises(BackendError, match="still holds"):
        b.set_version(0, 1, TRAINER)
    with pytest.raises(BackendError, match="trainer only holds"):
        b.set_version(1, 1, TRAINER)
    with pytest.raises(BackendError, match="not on group"):
        b.migrate([0], 1, 0)
    with pytest.raises(BackendError, match="not running"):
        b.interrupt([7])
    with pytest.raises(BackendError, match="not interrupted"):
        b.submit(1, [spec(0, resume=PartialRequest(0, 0, 64, 0, ()))])
    assert b.live_requests() == 1 and b.requests.count.tolist() == [1, 0]
    b.publish(1)
    b.set_version(1, 1, TRAINER)
    with pytest.raises(BackendError, match="holds v0"):
        b.migrate([0], 0, 1)
    with pytest.raises(BackendError, match="publish"):
        b.publish(3)


def test_a_lone_request_decodes_at_the_cost_model_rate():
    b = backend(tick_s=0.25)
    b.submit(0, [spec(0)])  # 100 tokens
    done = run_until_done(b)
    ctx = np.arange(64, 64 + 100)
    want = float(COST.prefill_s(64, 64 * 64 / 2)) + float(COST.decode_step_s(1, ctx).sum())
    tick, n = done[0]
    assert n == 100
    assert (tick + 1) * 0.25 == pytest.approx(want, abs=0.25 + 1e-9)
    secs = np.sum(b.seconds, axis=0)
    assert secs[DECODE] == pytest.approx(float(COST.decode_step_s(1, ctx).sum()), rel=0.02)


def test_batched_decode_rate_and_time_conservation():
    b = backend(groups=1, slots=64, tick_s=1.0, scale=10_000)
    b.submit(0, [spec(i) for i in range(64)])
    ev = b.step()  # prefill, then decode in the rest of the tick
    tokens = [ev.groups[0].tokens]
    for _ in range(3):
        tokens.append(b.step().groups[0].tokens)
    ctx = float(b.requests.context(64)[0].sum())
    rate = 64 / float(COST.decode_step_s(64, ctx))
    assert tokens[-1] == pytest.approx(rate, rel=0.05)
    spent = np.sum(b.seconds, axis=0).sum()
    assert spent == pytest.approx(4.0 - b.carry[0], abs=1e-9)
    assert set(CATEGORIES) >= {"decode", "prefill", "idle", "transfer", "migrate"}


def test_weight_transfer_takes_its_time_and_requests_wait():
    b = backend(tick_s=0.25)
    b.publish(1)
    b.set_version(1, 1, TRAINER)
    need = math.ceil(COST.weight_transfer_s() / 0.25 - 1e-9)
    assert b.groups()[1].busy_ticks == need
    b.submit(1, [spec(0, version=1)])
    for _ in range(need - 1):
        assert b.step().groups[1].activity == "transfer"
        q = b.requests
        assert q.generated[1, 0] == 0 and q.prefill_left[1, 0] == 64  # the request waits
    b.step()
    assert b.busy[1] == 0
    b.set_version(0, 1, 1)  # from a peer: after its own transfer ends
    assert b.busy[0] == pytest.approx(b.busy[1] + COST.weight_transfer_s())


def test_migration_keeps_progress_and_charges_the_destination():
    b = backend(tick_s=0.02)
    b.submit(0, [spec(i) for i in range(4)])
    for _ in range(3):
        b.step()
    q = b.requests
    gen = dict(zip(q.ids(0), q.generated[0, :4].tolist(), strict=True))
    cached = int(q.context(2)[0].sum())
    ids = q.ids(0)[:2]
    b.migrate(ids, 0, 1)
    assert q.count.tolist() == [2, 2] and q.ids(1) == ids
    assert q.generated[1, :2].tolist() == [gen[i] for i in ids]
    assert b.mig[1] == pytest.approx(COST.kv_transfer_s(cached))
    assert b.migrated_requests == 2 and b.migrated_tokens == cached
    done = run_until_done(b)
    assert {r: n for r, (_, n) in done.items()} == {r: 100 * (r + 1) for r in range(4)}
    assert sum(g.reprefill_tokens for g in b.step().groups) == 0


def test_interrupt_and_resume_reprefills_and_records_versions():
    b = backend(tick_s=0.25)
    b.submit(0, [spec(1)])  # 200 tokens
    for _ in range(4):
        b.step()
    (p,) = b.interrupt([1])
    assert p.generated > 0 and p.versions == (0,) and b.live_requests() == 0
    b.publish(1)
    b.set_version(0, 1, TRAINER)
    b.submit(0, [RequestSpec(1, 0, 1, 64, resume=p)])
    reprefill = 0
    done = {}
    while b.live_requests():
        ev = b.step()
        reprefill += sum(g.reprefill_tokens for g in ev.groups)
        done.update({f.request_id: f for f in ev.finished})
    assert reprefill == 64 + p.generated  # everything it had cached is computed again
    assert done[1].response_len == 200 and done[1].versions == (0, 1)


def test_kv_overflow_parks_the_newest_and_admission_uses_the_watermark():
    b = backend(groups=1, slots=8, tick_s=0.02, kv_capacity_tokens=500, admit_reserve_tokens=100)
    assert b.groups()[0].free_slots == 4  # floor(0.85 * 500 / 100)
    b.submit(0, [spec(i) for i in (5, 6, 7)])  # 600, 700, 800 tokens: they outgrow 500
    assert b.groups()[0].free_slots == 0  # 3 x (64 + 100) reserved > 425
    for _ in range(30):
        b.step()
    info = b.groups()[0]
    assert info.kv_pages_used > info.kv_pages_total  # held pages include parked ones
    assert b.requests.generated[0, 0] > b.requests.generated[0, 2]  # the newest waits
    assert info.free_slots == 0
    done = run_until_done(b)
    assert sorted(done) == [5, 6, 7]


def test_freeze_stops_rollout_and_counts_training():
    b = backend(tick_s=0.5)
    b.submit(0, [spec(3)])
    b.step()
    q = b.requests
    g0 = int(q.generated[0, 0])
    b.freeze(b.tick + 3)
    for _ in range(3):
        ev = b.step()
    assert int(q.generated[0, 0]) == g0 and ev.groups[0].tokens == 0
    assert np.sum(b.seconds, axis=0)[CATEGORIES.index("train")] == pytest.approx(3 * 2 * 0.5)
    b.step()
    assert int(q.generated[0, 0]) > g0
    assert np.sum(b.seconds, axis=0)[IDLE] > 0  # group 1 idled when not frozen


def test_a_shared_device_divides_each_tick_among_the_groups_with_work():
    def run(shared: bool, both: bool):
        b = backend(groups=3, tick_s=0.25, scale=1000, shared_device=shared)
        b.submit(0, [spec(0)])  # 1,000 tokens
        if both:
            b.submit(1, [spec(10)])  # 1,000 tokens too; group 2 stays empty
        done = run_until_done(b)
        busy = np.sum([t[:IDLE] for t in b.seconds], axis=1)  # all but idle and train
        return b, done, busy

    alone, done_a, busy_a = run(True, False)
    free, done_f, _ = run(False, True)
    shared, done_s, busy_s = run(True, True)
    # a group alone has the whole device; two busy ones half each; the same tokens either way
    assert done_a[0] == done_f[0] == done_f[10]
    assert done_s[0][1] == done_s[10][1] == 1000
    assert 1.9 <= (done_s[0][0] + 1) / (done_a[0][0] + 1) <= 2.1
    # the device's seconds: one tick of work per tick (give or take the fraction of a step a
    # group carries to the next), all groups' time conserved
    for busy in (busy_s, busy_a):
        assert (np.cumsum(busy) <= 0.25 * np.arange(1, len(busy) + 1) + 0.01).all()
    assert busy_s.sum() == pytest.approx(busy_a.sum() * 2, rel=0.01)
    spent = np.sum(shared.seconds, axis=0).sum()
    assert spent == pytest.approx(len(shared.seconds) * 3 * 0.25 - shared.carry.sum(), abs=1e-9)


def test_a_run_on_a_shared_device():
    from dora_jax.sim.config import load_sim_config
    from dora_jax.sim.run import simulate

    tiny = Path(__file__).resolve().parents[1] / "configs" / "sim" / "tiny_qwen7b_h100.yaml"
    base = ["run.steps=4", "run.warmup_steps=1"]
    cfg = load_sim_config(tiny, [*base, "cluster.shared_rollout_device=true"])
    run = simulate(cfg, "dora")
    busy = np.sum([t[:IDLE] for t in run.backend.seconds], axis=1)
    assert (np.cumsum(busy) <= cfg.run.tick_s * np.arange(1, len(busy) + 1) + 0.05).all()
    assert busy.max() > 0.9 * cfg.run.tick_s
    apart = simulate(load_sim_config(tiny, base), "dora")
    assert run.metrics.tokens_per_s < 0.5 * apart.metrics.tokens_per_s  # 4 groups, one device
    with pytest.raises(ValueError, match="shared_rollout_device"):
        simulate(cfg, "partial", "colocated")


def test_a_shared_device_with_measured_calls_longer_than_a_share():
    # the CPU preset's costs: a prefill is one call of 8 ms whatever it holds; four busy groups
    # get 2.5 ms of each 10 ms tick, so a group's share adds up over ticks until a call fits
    from dora_jax.sim.cost_model import MeasuredCost

    cost = MeasuredCost(
        decode_call_s=0.004,
        decode_steps=4,
        prefill_call_s=0.008,
        prefill_chunk_tokens=64,
        max_slots=8,
        weight_load_s=0.0015,
        kv_move_s=0.001,
        train_step_fixed_s=1.0,
        kv_capacity=1584,
    )

    def run(shared: bool):
        b = SimBackend(
            cost,
            4,
            FixedLengths(10),
            tick_s=0.01,
            max_slots=8,
            max_prompt_len=16,
            admit_watermark=1.0,
            admit_reserve_tokens=16,
            shared_device=shared,
        )
        for g in range(4):
            b.submit(g, [spec(10 * g + i, plen=8) for i in range(2)])
        done = run_until_done(b)
        return done, np.sum([t[:IDLE] for t in b.seconds], axis=1)

    (done, busy), (alone, busy_apart) = run(True), run(False)
    assert {r: n for r, (_, n) in done.items()} == {r: n for r, (_, n) in alone.items()}
    # the same work (each group's prefill call and decode calls), on one device
    assert busy.sum() == pytest.approx(busy_apart.sum(), rel=1e-9)
    assert (np.cumsum(busy) <= 0.01 * np.arange(1, len(busy) + 1) + 0.002).all()
    assert max(t for t, _ in done.values()) >= 3 * max(t for t, _ in alone.values())


def test_a_weight_trip_waits_without_holding_the_shared_device():
    # a load from the trainer across processes: the group waits its trip (whole ticks), then
    # does the load's own work; meanwhile the other group has the whole device (as a group
    # waiting on the same seconds of load work would not); a load from a peer waits for the
    # source's trip and load and has no trip of its own
    from dora_jax.sim.cost_model import MeasuredCost

    def run(trip_s: float, load_s: float):
        cost = MeasuredCost(
            decode_call_s=0.004,
            decode_steps=4,
            prefill_call_s=0.008,
            prefill_chunk_tokens=64,
            max_slots=8,
            weight_load_s=load_s,
            kv_move_s=0.001,
            train_step_fixed_s=1.0,
            kv_capacity=1584,
            trip_s=trip_s,
        )
        b = SimBackend(
            cost,
            3,
            FixedLengths(100),
            tick_s=0.01,
            max_slots=8,
            max_prompt_len=16,
            admit_watermark=1.0,
            admit_reserve_tokens=16,
            shared_device=True,
        )
        b.submit(0, [spec(0, plen=8)])
        b.step()  # group 0 prefills
        b.publish(1)
        b.set_version(1, 1, TRAINER)
        b.submit(1, [spec(100, version=1, plen=8)])
        return b

    b = run(0.035, 0.002)
    assert b.groups()[1].busy_ticks == math.ceil((0.035 + 0.002) / 0.01)
    tokens = 0
    for _ in range(4):  # ceil(0.035 / 0.01) ticks of the trip
        ev = b.step()
        assert ev.groups[1].activity == "transfer" and ev.groups[1].time_s == pytest.approx(0.01)
        assert b.requests.generated[1, 0] == 0  # the load's work waits
        assert b.busy[1] == pytest.approx(0.002)
        tokens += ev.groups[0].tokens
    assert b.trip[1] == 0
    b.step()
    assert b.busy[1] == 0  # then its work, in its share
    # the same seconds as the load's own work: group 1 takes half the device meanwhile
    slow = run(0.0, 0.037)
    assert sum(slow.step().groups[0].tokens for _ in range(4)) < 0.7 * tokens
    # from a peer: after the source's trip and load, no trip of its own
    b = run(0.035, 0.002)
    b.set_version(2, 1, 1)
    assert b.trip[2] == 0 and b.busy[2] == pytest.approx(0.035 + 0.002 + 0.002)
