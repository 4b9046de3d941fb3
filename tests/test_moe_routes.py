"""Recorded expert routes of a mixture-of-experts policy: the engine records the experts of every
token it feeds through the model, the record equals the full forward's routing, travels with the
request (migration, parking, snapshots, messages between processes) bit for bit, and the train
batch and step use it (routing replay)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax import state_codec
from dora_jax.config import ModelConfig, RolloutConfig, TrainConfig
from dora_jax.distributed import codec
from dora_jax.mesh import make_mesh
from dora_jax.model import hidden_states, init_params
from dora_jax.rollout import Engine, Request, request_key
from dora_jax.train.batch import Trajectory, pack_batch
from dora_jax.train.trainer import Trainer

CFG = ModelConfig(
    family="qwen3_moe",
    attention_bias=False,
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
)
RCFG = RolloutConfig(
    page_size=8,
    num_pages=40,
    max_slots=4,
    max_prompt_len=24,
    max_new_tokens=40,
    prefill_chunk=8,
    temperature=1.0,
    top_k=20,
)
L, K = CFG.num_layers, CFG.num_experts_per_tok


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(3))


def engine_on(params, *ids, **rcfg):
    mesh = make_mesh([jax.devices()[i] for i in ids], 1, len(ids))
    e = Engine(CFG, dataclasses.replace(RCFG, **rcfg), mesh, eos_id=-1)
    e.load_params(params, 0)
    return e


def requests(n=3, seed=5):
    rng = np.random.default_rng(seed)
    return [
        Request(
            id=f"q{i}",
            prompt=[int(t) for t in rng.integers(3, 64, rng.integers(9, 20))],
            version=0,
            key=request_key(seed, i),
            max_new_tokens=int(rng.integers(20, 41)),
        )
        for i in range(n)
    ]


def drain(*engines):
    done = []
    while any(e.num_requests for e in engines):
        for e in engines:
            done += e.step().finished
    return {f.id: f for f in done}


def full_forward_routes(params, seq):
    T = len(seq)
    tokens = jnp.asarray(np.asarray(seq, np.int32)[None])
    _, chosen = hidden_states(
        params, tokens, jnp.arange(T)[None], jnp.ones((1, T), jnp.int32), CFG, return_routes=True
    )
    return np.asarray(chosen[0])


def test_routes_travel_with_migration_parking_snapshots_and_messages(params):
    reqs = requests(seed=6)
    ref = drain_fresh(params, reqs)
    src, dst = engine_on(params, 0), engine_on(params, 1)
    src.submit(reqs)
    for _ in range(12):
        src.step()
    # a migration to another submesh, a park to host memory, then a snapshot restored through
    # the checkpoint codec and a request through the inter-process message codec
    dst.import_requests(src.export_requests([reqs[0].id]))
    parked = src.park([reqs[1].id])
    dst.import_requests(parked)
    for _ in range(3):
        src.step(), dst.step()
    text, arrays = state_codec.dumps(dst.snapshot())
    restored = engine_on(params, 2)
    restored.restore(state_codec.loads(text, arrays))
    moved = src.export_requests([reqs[2].id])
    restored.import_requests(codec.decode(codec.encode(moved)))
    got = drain(restored)
    assert set(got) == set(ref)
    for rid, f in got.items():
        assert f.tokens == ref[rid].tokens and f.migrations >= 1
        np.testing.assert_array_equal(f.routes, ref[rid].routes)  # bit for bit, in order


def drain_fresh(params, reqs):
    e = engine_on(params, 3)
    e.submit([dataclasses.replace(r, tokens=[], logprobs=[], routes=[]) for r in reqs])
    return drain(e)


def test_pack_batch_places_routes_and_checks_their_shape():
    tcfg = TrainConfig(group_size=2, length_buckets=(16,), pack_rows=1)
    r1 = np.arange(7 * L * K, dtype=np.int16).reshape(7, L, K) % 4
    trajs = [
        Trajectory([5, 6, 7], [8, 9, 10, 11], [-1.0] * 4, 1.0, 0, "g", routes=r1),
        Trajectory([5, 6], [12, 13], [-1.0] * 2, 0.0, 0, "g"),
    ]  # no routes recorded
    b = pack_batch(trajs, tcfg, trainer_version=0, routes_shape=(L, K))
    assert b.routes.shape == (1, 16, L, K)
    # first-fit-decreasing puts the longer sample first: slots 0..6 carry its routes
    np.testing.assert_array_equal(b.routes[0, :7], r1)
    assert (b.routes[0, 7:] == -1).all()  # the sample without routes, then padding
    bad = dataclasses.replace(trajs[0], routes=r1[:6])
    with pytest.raises(ValueError, match="routes of shape"):
        pack_batch([bad, trajs[1]], tcfg, trainer_version=0, routes_shape=(L, K))
    assert pack_batch(trajs, tcfg, trainer_version=0).routes is None  # a dense policy


def test_train_step_replays_recorded_routes(params):
    """Replaying the router's own choice changes nothing; replaying other experts changes the
    loss; without replay the step reports how many recorded tokens its router disagrees on.
    The experts' weights are scaled up so that which experts run shows clearly in the loss."""
    params = {
        **params,
        "layers": {k: (w * 10 if k.startswith("moe_") else w) for k, w in params["layers"].items()},
    }
    tcfg = TrainConfig(group_size=2, length_buckets=(24,))
    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(3, 64, n)] for n in (14, 11)]
    own = [full_forward_routes(params, s).astype(np.int16) for s in seqs]
    other = [(r + 1) % CFG.num_experts for r in own]  # every token, every layer: other experts

    def trajectories(routes):
        return [
            Trajectory(s[:6], s[6:], [-2.0] * (len(s) - 6), float(i), 0, "g", routes=r)
            for i, (s, r) in enumerate(zip(seqs, routes, strict=True))
        ]

    trainers = {
        r: Trainer(CFG, dataclasses.replace(tcfg, routing_replay=r), params=params)
        for r in (False, True)
    }

    def step(replay, routes):  # the loss of the params before the update: reset each time
        tr = trainers[replay]
        tr.reset(params)
        return {
            k: float(v)
            for k, v in tr.step(tr.pack(trajectories(routes))).items()
            if np.ndim(v) == 0
        }

    free_own, replay_own = step(False, own), step(True, own)
    free_other, replay_other = step(False, other), step(True, other)
    assert free_own["routed_tokens"] == sum(len(s) for s in seqs)
    assert free_own["routing_diff_share"] == 0.0 and replay_own["routing_diff_share"] == 0.0
    assert free_other["routing_diff_share"] == 1.0  # the router never picks the shifted experts
    assert replay_other["routing_diff_share"] == 0.0  # the forward used the recorded ones
    assert replay_own["loss"] == pytest.approx(free_own["loss"], abs=1e-6)
    assert free_other["loss"] == pytest.approx(free_own["loss"], abs=1e-6)  # record ignored
    assert abs(replay_other["loss"] - free_own["loss"]) > 1e-3  # the record was used
