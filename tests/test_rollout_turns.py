"""Multi-turn conversations in the rollout engine: a model turn ends on EOS, a stop sequence or
the budget; the request waits with its KV and no slot; the environment's turn is prefilled into
the same KV (never a re-prefill of earlier turns); waiting conversations migrate, park, snapshot
and interrupt, and continue bit-identically where their KV moved."""

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.config import ModelConfig, RolloutConfig
from dora_jax.mesh import make_mesh
from dora_jax.model import forward, init_params
from dora_jax.rollout import Engine, EngineError, Request, request_key

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2
)
RCFG = RolloutConfig(
    page_size=8,
    num_pages=60,
    max_slots=4,
    max_prompt_len=16,
    max_new_tokens=96,
    prefill_chunk=8,
    temperature=1.0,
    decode_steps=2,
)
EOS = 2
STOPS = ((9,), (10, 11))  # a one-token and a two-token stop sequence
ENV = {0: [20, 21, 22], 1: [30, 31, 32, 33, 34, 35, 36, 37, 38, 39], 2: [40]}  # turn -> tokens
TURNS = 3  # model turns per conversation


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


def mesh_on(i):
    return make_mesh([jax.devices()[i]], 1, 1)


def engine_on(params, device, rcfg=RCFG, eos=EOS):
    e = Engine(CFG, rcfg, mesh_on(device), eos_id=eos)
    e.load_params(params, 0)
    return e


def conversations(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        Request(
            id=i,
            prompt=[int(t) for t in rng.integers(12, CFG.vocab_size, int(rng.integers(3, 12)))],
            version=0,
            key=request_key(seed, i),
            max_new_tokens=96,
            multi_turn=True,
            stop_seqs=STOPS,
        )
        for i in range(n)
    ]


class Script:
    """A scripted environment for several engines: after model turn ``t`` it answers
    ``ENV[t % 3]`` ``delay`` engine steps later, and it ends a conversation after ``TURNS``
    model turns (or when the answer would not fit). ``on_turn_end(engine, record, turn)`` may
    move the request and returns the engine that holds it then."""

    def __init__(self, engines, reqs, on_turn_end=None, delay=0):
        self.engines, self.on_turn_end, self.delay = engines, on_turn_end, delay
        self.where = {r.id: engines[0] for r in reqs}
        self.turns = {r.id: 0 for r in reqs}
        self.done, self.reports, self.n = {}, [], len(reqs)
        self.due: list[tuple[int, object]] = []  # (step, turn-end record)
        self.t = 0
        engines[0].submit(reqs)

    def step(self):
        for rec in [rec for t, rec in self.due if t <= self.t]:
            self.answer(rec)
        self.due = [(t, rec) for t, rec in self.due if t > self.t]
        for e in self.engines:
            rep = e.step()
            self.reports.append(rep)
            assert not rep.finished  # conversations end only when told
            for rec in rep.turn_ends:
                if self.on_turn_end is not None:
                    self.where[rec.id] = self.on_turn_end(
                        self.where[rec.id], rec, self.turns[rec.id]
                    )
                if self.delay:
                    self.due.append((self.t + self.delay, rec))
                else:
                    self.answer(rec)
        self.t += 1

    def answer(self, rec):
        t = self.turns[rec.id]
        self.turns[rec.id] += 1
        obs = ENV[t % len(ENV)]
        if t + 1 >= TURNS or 96 - len(rec.tokens) - len(obs) < 1:
            self.where[rec.id].end([rec.id])
            self.done[rec.id] = rec
        else:
            self.where[rec.id].extend(rec.id, obs)

    def run(self, limit=3000):
        for _ in range(limit):
            if len(self.done) == self.n:
                return self.done, self.reports
            self.step()
        raise AssertionError("conversations did not end")


def play(engines, reqs, on_turn_end=None):
    return Script(engines, reqs, on_turn_end).run()


def test_stop_sequences_and_turn_ends_unit():
    r = Request(0, [5, 6], 0, request_key(0, 0), 10, multi_turn=True, stop_seqs=STOPS)
    r.tokens = [7, 10, 11]
    assert r.model_turn_ended((EOS,)) == "stop"  # the two-token stop sequence
    r.append_env_turn([20, 21])
    assert r.env_spans == [(3, 5)] and r.turn_start == 5 and r.needs_sample
    r.tokens.append(11)  # "11" alone after the environment's turn is not the stop sequence
    assert r.model_turn_ended((EOS,)) is None
    r.tokens.append(EOS)
    assert r.model_turn_ended((EOS,)) == "eos"
    single = Request(1, [5], 0, request_key(0, 1), 3, stop_seqs=STOPS)
    single.tokens = [9]
    assert single.model_turn_ended((EOS,)) is None  # stop sequences apply to conversations only
    single.tokens = [9, 4, 4]
    assert single.model_turn_ended((EOS,)) == "length"


def test_conversation_logprobs_match_the_full_forward_pass(params):
    """Every model token's behavior logprob (temperature 1) equals the full forward pass over the
    whole conversation, environment turns included: the environment's tokens went into the same
    KV at the right positions. Earlier turns are never prefilled again."""
    e = engine_on(params, 0)
    reqs = conversations(4, seed=1)
    done, reports = play([e], reqs)
    e.alloc.check()
    assert e.alloc.pages_used == 0 and not e.num_requests
    assert sum(rep.reprefill_tokens for rep in reports) == 0
    width = 128
    checked = 0
    for rec in done.values():
        assert len(rec.env_spans) == TURNS - 1
        seq = list(rec.prompt) + list(rec.tokens)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, : len(seq)] = seq
        seg = (np.arange(width) < len(seq)).astype(np.int32)[None]
        logits = forward(
            params, jnp.asarray(tokens), jnp.arange(width)[None], jnp.asarray(seg), CFG
        )[0]
        logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
        env = {i for a, b in rec.env_spans for i in range(a, b)}
        P = len(rec.prompt)
        for i, (t, lp) in enumerate(zip(rec.tokens, rec.logprobs, strict=True)):
            if i in env:
                assert lp == 0.0
                continue
            assert abs(logp[P + i - 1, t] - lp) < 1e-4, (rec.id, i)
            checked += 1
        # prefilled: the prompt, then each environment turn and the model token before it
        assert rec.prefill_tokens == P + sum(b - a + 1 for a, b in rec.env_spans)
    assert checked > 20


@pytest.mark.parametrize("how", ["migrate", "park"])
def test_a_waiting_conversation_moved_continues_bit_identically(params, how):
    """Requests moved while they wait on their environment (to another engine, or parked to
    host memory and back) end with the same tokens and logprobs as requests never moved;
    nothing is re-prefilled."""
    reqs = conversations(3, seed=2)
    ref, _ = play([engine_on(params, 0)], copy.deepcopy(reqs))
    a, b = engine_on(params, 1), engine_on(params, 2)

    def move(e, rec, turn):
        if turn != 0 or rec.id == 1:  # move requests 0 and 2 after their first turn
            return e
        other = b if e is a else a
        if how == "migrate":
            other.import_requests(e.export_requests([rec.id]))
        else:
            x = e.park([rec.id])
            assert isinstance(x.kv, np.ndarray) and x.requests[0].waiting
            other.import_requests(x)
        assert rec.id in other.waiting and rec.id not in e.request_ids()
        return other

    got, reports = play([a, b], reqs, on_turn_end=move)
    assert sum(rep.reprefill_tokens for rep in reports) == 0
    # a request moved after its first turn, whose conversation went on, arrived moved once
    moved_on = {rid for rid, rec in got.items() if rid != 1 and rec.env_spans}
    assert moved_on and all(got[rid].migrations == 1 for rid in moved_on)
    assert got[1].migrations == 0
    for rid, rec in ref.items():
        assert got[rid].tokens == rec.tokens
        assert got[rid].logprobs == rec.logprobs  # bit-identical
    for e in (a, b):
        e.alloc.check()
        assert e.alloc.pages_used == 0


def test_snapshot_with_conversations_waiting_restores_exactly(params):
    """A snapshot taken while some conversations wait on their environment and others decode,
    restored on a fresh engine, ends as the run that was never stopped."""
    reqs = conversations(4, seed=6)
    ref, _ = play([engine_on(params, 0)], copy.deepcopy(reqs))
    a = engine_on(params, 1)
    script = Script([a], reqs, delay=3)
    for _ in range(500):
        if a.waiting and any(r is not None for r in a.slots):
            break
        script.step()
    else:
        raise AssertionError("no step had conversations both waiting and decoding")
    fresh = engine_on(params, 2)
    fresh.restore(a.snapshot())
    assert set(fresh.waiting) == set(a.waiting)
    script.engines = [fresh]
    script.where = {rid: fresh for rid in script.where}
    got, _ = script.run()
    for rid, rec in ref.items():
        assert got[rid].tokens == rec.tokens and got[rid].logprobs == rec.logprobs
    fresh.alloc.check()
    assert fresh.alloc.pages_used == 0


def test_waiting_conversations_hold_kv_but_no_slot_and_are_parked_first(params):
    """Four conversations waiting fill no slot: new requests run beside them. When pages run
    short, a waiting conversation is parked to host memory before any running request."""
    rcfg = dataclasses.replace(RCFG, num_pages=15, max_slots=2)
    e = engine_on(params, 0, rcfg, eos=-1)  # turns end on stop sequences; the runner runs long
    waiting = conversations(2, seed=3)
    e.submit(waiting)
    for _ in range(200):
        if len(e.waiting) == 2:
            break
        e.step()
    assert e.load().free_slots == 2 and e.load().waiting == 2
    held = sum(len(e.alloc.table(r)) for r in e.waiting)
    assert held > 0
    runner = Request(9, [13] * 10, 0, request_key(3, 9), 96)  # single-turn: 106 tokens
    e.submit([runner])
    for _ in range(60):
        e.step()
        if e.parked:
            break
    assert e.parked and all(p.requests[0].waiting for p in e.parked)
    assert e.slots.count(None) == 1  # the runner kept its slot
    assert not e.has_work or e.slots[0] is not None or e.slots[1] is not None
    parked = e.parked[0].requests[0].id
    e.extend(parked, [20, 21])  # a parked conversation extended resumes when pages allow
    assert not e.parked[0].requests[0].waiting
    e.end([r for r in e.waiting_ids() if r != parked])
    for _ in range(400):
        e.step()
        if not e.parked and parked not in e.waiting:
            break
    assert not e.parked
    e.alloc.check()


def test_interrupted_waiting_conversation_is_prefilled_afresh_when_extended(params):
    e = engine_on(params, 0)
    (r,) = conversations(1, seed=4)
    e.submit([r])
    while not e.waiting:
        e.step()
    (back,) = e.interrupt([r.id])
    assert back.waiting and back.kv_len == 0 and e.alloc.pages_used == 0
    e.submit([back])  # partial rollout: resubmitted (same version here), it waits again
    assert r.id in e.waiting and not e.has_work
    n = back.total_tokens
    e.extend(r.id, [20, 21, 22])
    rep = e.step()
    # all of it fed again; all but its last token (sampled, never fed) had been computed before
    assert rep.prefill_tokens == n + 3 and rep.reprefill_tokens == n - 1
    assert back.kv_len == n + 3 and len(back.tokens) == n - len(back.prompt) + 4


def test_extend_and_end_refuse_what_does_not_wait(params):
    e = engine_on(params, 0)
    (r,) = conversations(1, seed=5)
    e.submit([r])
    with pytest.raises(EngineError, match="not waiting on its environment"):
        e.extend(r.id, [20])
    while not e.waiting:
        e.step()
    with pytest.raises(EngineError, match="needs at least one"):
        e.extend(r.id, [20] * 200)
    with pytest.raises(EngineError, match="at least one token"):
        e.extend(r.id, [])
    e.end([r.id])
    assert not e.num_requests and e.alloc.pages_used == 0
    with pytest.raises(EngineError, match="not waiting"):
        e.end([r.id])


def test_requests_parked_together_split_one_by_one_and_continue_bit_identically(params):
    """A handover that does not fit its destination is parked there one request at a time (the
    pack buffer of several requests split per request, pages padded as the engine pads them);
    each resumes from its own KV, with the same tokens as requests never moved."""
    reqs = conversations(3, seed=7)
    ref, _ = play([engine_on(params, 0)], copy.deepcopy(reqs))
    a, b = engine_on(params, 1), engine_on(params, 2)
    script = Script([a], reqs)
    for _ in range(200):
        if sum(r is not None for r in a.slots) == 3 and min(len(r.tokens) for r in reqs) > 9:
            break
        script.step()
    b.slots = [object()] * len(b.slots)  # every slot busy: the handover cannot be imported
    b.move_in(a.move_out([r.id for r in reqs]))
    assert [len(p.requests) for p in b.parked] == [1, 1, 1]
    b.slots = [None] * len(b.slots)
    script.engines = [b]
    script.where = {rid: b for rid in script.where}
    got, reports = script.run()
    assert sum(rep.reprefill_tokens for rep in reports) == 0
    for rid, rec in ref.items():
        assert got[rid].tokens == rec.tokens and got[rid].logprobs == rec.logprobs
    b.alloc.check()
    assert b.alloc.pages_used == 0
