"""The RolloutBackend contract, checked on the in-memory fake backend."""

import math
import statistics

import pytest

from dora_jax.orchestrator import (
    TRAINER,
    BackendError,
    FakeBackend,
    FakeBackendConfig,
    RequestSpec,
    RolloutBackend,
)
from dora_jax.orchestrator.fake_backend import response_length


def _cfg(**kw) -> FakeBackendConfig:
    base = dict(
        num_groups=2,
        max_slots=4,
        max_prompt_len=64,
        max_new_tokens=64,
        length_median=8,
        length_p99_ratio=1.0,
        prefill_tokens_per_tick=16,
        weight_transfer_ticks=3,
        migrate_ticks=2,
    )
    base.update(kw)
    return FakeBackendConfig(**base)


def _req(rid: int, version: int = 0, prompt_len: int = 16, pg: int | None = None) -> RequestSpec:
    return RequestSpec(rid, rid if pg is None else pg, version, prompt_len)


def _run_until_done(be: FakeBackend, limit: int = 1000) -> dict[int, tuple[int, object]]:
    done = {}
    for _ in range(limit):
        ev = be.step()
        for fr in ev.finished:
            done[fr.request_id] = (ev.tick, fr)
        if be.live_requests() == 0:
            return done
    raise AssertionError("requests never finished")


def test_fake_is_a_rollout_backend():
    assert isinstance(FakeBackend(_cfg()), RolloutBackend)


def test_prefill_then_one_token_per_tick():
    be = FakeBackend(_cfg())
    be.submit(0, [_req(1, prompt_len=32)])  # 32 prompt tokens at 16 per tick: 2 prefill ticks
    acts = []
    for _ in range(2 + 8):
        ev = be.step()
        acts.append(ev.groups[0].activity)
        assert ev.groups[1].activity == "idle"
    assert acts == ["prefill"] * 2 + ["decode"] * 8
    assert ev.finished and ev.finished[0].response_len == 8 and ev.finished[0].versions == (0,)
    assert be.live_requests() == 0


def test_submit_contract_errors():
    be = FakeBackend(_cfg())
    with pytest.raises(BackendError, match="version"):
        be.submit(0, [_req(1, version=1)])  # the group holds version 0
    with pytest.raises(BackendError, match="slots"):
        be.submit(0, [_req(i) for i in range(5)])
    be.submit(0, [_req(1)])
    with pytest.raises(BackendError, match="already submitted"):
        be.submit(1, [_req(1)])
    with pytest.raises(BackendError, match="no group"):
        be.submit(7, [_req(2)])


def test_set_version_contract():
    be = FakeBackend(_cfg(num_groups=3))
    with pytest.raises(BackendError, match="trainer only holds"):
        be.set_version(0, 1, TRAINER)  # version 1 not published yet
    be.publish(1)
    with pytest.raises(BackendError, match="publish"):
        be.publish(3)
    be.submit(0, [_req(1)])
    with pytest.raises(BackendError, match="still holds"):
        be.set_version(0, 1, TRAINER)  # a group must be empty to change version
    be.set_version(1, 1, TRAINER)
    info = be.groups()[1]
    assert info.version == 1 and info.busy_ticks == 3
    be.set_version(1, 1, TRAINER)  # already holds it: no-op, no extra cost
    assert be.groups()[1].busy_ticks == 3
    with pytest.raises(BackendError, match="does not hold"):
        be.set_version(2, 1, 0)  # group 0 holds version 0, cannot be the source of version 1
    # requests submitted during the transfer wait for it
    be.submit(1, [_req(2, version=1)])
    acts = [be.step().groups[1].activity for _ in range(5)]
    assert acts == ["transfer"] * 3 + ["prefill", "decode"]


def test_peer_transfer_waits_for_a_busy_source():
    be = FakeBackend(_cfg(num_groups=3))
    be.publish(1)
    be.set_version(0, 1, TRAINER)  # 3 ticks
    be.step()
    be.set_version(1, 1, 0)  # source still receiving: 2 left + 3 of its own
    assert be.groups()[1].busy_ticks == 5


def test_migrate_keeps_kv_and_progress():
    """A migrated request is not re-prefilled; it pauses migrate_ticks and finishes as late."""
    cfg = _cfg(length_median=20)
    ref, mig = FakeBackend(cfg), FakeBackend(cfg)
    for be in (ref, mig):
        be.submit(0, [_req(1, prompt_len=16)])
        for _ in range(5):  # 1 prefill + 4 tokens
            be.step()
    before = mig.groups()[0]
    mig.migrate([1], 0, 1)
    after = mig.groups()
    assert after[0].requests == () and after[1].requests == (1,)
    assert after[1].request_pages == before.request_pages  # KV moved along
    done_ref, done_mig = _run_until_done(ref), _run_until_done(mig)
    t_ref, fr_ref = done_ref[1]
    t_mig, fr_mig = done_mig[1]
    assert fr_mig.response_len == fr_ref.response_len == 20
    assert t_mig == t_ref + cfg.migrate_ticks
    assert fr_mig.versions == (0,)


def test_migrate_contract_errors():
    be = FakeBackend(_cfg(num_groups=3))
    be.publish(1)
    be.set_version(2, 1, TRAINER)
    be.submit(0, [_req(1)])
    with pytest.raises(BackendError, match="holds v0"):
        be.migrate([1], 0, 2)  # never across versions
    with pytest.raises(BackendError, match="not on group"):
        be.migrate([1], 1, 0)
    be.submit(1, [_req(i) for i in range(10, 14)])
    with pytest.raises(BackendError, match="free slots"):
        be.migrate([1], 0, 1)


def test_interrupt_and_resume_reprefills_the_context():
    be = FakeBackend(_cfg(length_median=12))
    be.submit(0, [_req(1, prompt_len=16)])
    for _ in range(1 + 5):
        be.step()
    (part,) = be.interrupt([1])
    assert part.generated == 5 and part.versions == (0,)
    assert be.groups()[0].requests == ()
    be.publish(1)
    be.set_version(1, 1, TRAINER)
    be.submit(1, [RequestSpec(1, 1, 1, 16, resume=part)])
    reprefill = tokens = 0
    done = None
    for _ in range(100):
        ev = be.step()
        reprefill += ev.groups[1].reprefill_tokens
        tokens += ev.groups[1].tokens
        if ev.finished:
            done = ev.finished[0]
            break
    assert reprefill == 16 + 5  # the whole context computed before
    assert tokens == 12 - 5 and done.response_len == 12
    assert done.versions == (0, 1) and done.version_span == 2
    with pytest.raises(BackendError, match="not running"):
        be.interrupt([1])


def test_lengths_are_deterministic_and_long_tailed():
    cfg = _cfg(length_median=100, length_p99_ratio=15, max_new_tokens=100_000, seed=3)
    xs = sorted(response_length(cfg, rid, rid // 4) for rid in range(20_000))
    assert xs == sorted(response_length(cfg, rid, rid // 4) for rid in range(20_000))
    med, p99 = statistics.median(xs), xs[int(0.99 * len(xs))]
    assert 90 <= med <= 110
    assert 12 <= p99 / med <= 18
    other = _cfg(length_median=100, length_p99_ratio=15, max_new_tokens=100_000, seed=4)
    assert [response_length(other, r, 0) for r in range(50)] != xs[:50]
    assert all(1 <= response_length(_cfg(), r, 0) <= 64 for r in range(200))
    assert math.isclose(response_length(_cfg(length_p99_ratio=1.0), 5, 0), 8)


def test_kv_pages_and_reservation():
    cfg = _cfg(page_size=16, max_prompt_len=64, max_new_tokens=64, kv_pages=16)
    be = FakeBackend(cfg)  # 8 pages reserved per request: 2 requests fit
    assert be.groups()[0].free_slots == 2
    be.submit(0, [_req(1, prompt_len=20), _req(2, prompt_len=40)])
    info = be.groups()[0]
    assert info.free_slots == 0 and info.kv_pages_used == 0  # nothing cached before prefill
    be.step()  # 16 tokens of prefill budget per tick, oldest request first
    be.step()  # request 1 has its 20 cached, request 2 its first 12
    info = be.groups()[0]
    assert info.request_pages == (2, 1) and info.kv_pages_used == 3
