"""Mixture of experts: the grouped (dropless) block against a per-expert loop, forced routes
(routing replay), routes out of the rollout steps, config validation, and a train step with
experts sharded over 2 devices equal to the unsharded one."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.config import ConfigError, ModelConfig, TrainConfig
from dora_jax.mesh import make_mesh
from dora_jax.model import forward, init_params, moe
from dora_jax.model.hf_mapping import UnsupportedModelError, model_config_from_hf
from dora_jax.model.moe import moe_mlp
from dora_jax.model.transformer import default_positions, hidden_states, logits_from_hidden
from dora_jax.train import Trainer, Trajectory, pack_batch

QWEN3 = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    family="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)
QWEN2 = dataclasses.replace(QWEN3, family="qwen2_moe", shared_expert_intermediate_size=24)


@jax.jit
def run(params, tokens, positions, seg, routes, cfg):
    """``(logits, chosen routes)``, jitted like the train and rollout paths."""
    h, chosen = hidden_states(
        params, tokens, positions, seg, cfg, routes=routes, return_routes=True
    )
    return logits_from_hidden(params, h, cfg), chosen


run = jax.jit(run.__wrapped__, static_argnames=("cfg",))


def batch(B=3, T=10, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, vocab, (B, T)), jnp.int32)
    seg = np.ones((B, T), np.int32)
    seg[1, T - 3 :] = 0
    seg = jnp.asarray(seg)
    return tokens, default_positions(seg), seg


def loop_moe(lp, x, cfg):
    """Every expert on every token, masked: the plain reference of the grouped block."""
    probs = jax.nn.softmax(jnp.einsum("BTD,DE->BTE", x, lp["router"]), axis=-1)
    top, idx = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.resolved_norm_topk_prob:
        top = top / top.sum(-1, keepdims=True)
    y = jnp.zeros_like(x)
    for e in range(cfg.num_experts):
        w = jnp.sum(jnp.where(idx == e, top, 0.0), axis=-1)
        h = jax.nn.silu(x @ lp["moe_gate"][e]) * (x @ lp["moe_up"][e])
        y = y + w[..., None] * (h @ lp["moe_down"][e])
    if "shared_gate" in lp:
        h = jax.nn.silu(x @ lp["shared_gate"]) * (x @ lp["shared_up"])
        y = y + jax.nn.sigmoid(x @ lp["shared_expert_gate"])[..., None] * (h @ lp["shared_down"])
    return y, idx


@pytest.mark.parametrize("impl", ["blocked", "ragged"])
@pytest.mark.parametrize("cfg", [QWEN3, QWEN2], ids=["qwen3_moe", "qwen2_moe"])
def test_grouped_block_equals_per_expert_loop(cfg, impl, monkeypatch):
    monkeypatch.setattr(moe, "default_impl", lambda: impl)
    p = init_params(cfg, jax.random.key(1))
    lp = jax.tree.map(lambda w: w[0] * 10, p["layers"])  # larger weights: decisive routing
    x = jax.random.normal(jax.random.key(2), (3, 7, cfg.hidden_size))
    y, chosen = moe_mlp(lp, x, cfg)
    want, idx = loop_moe(lp, x, cfg)
    assert chosen.shape == (3, 7, 2) and chosen.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(chosen), np.asarray(idx))
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "N, E, k",
    [
        (1, 8, 2),
        (40, 8, 2),
        pytest.param(300, 64, 4, marks=pytest.mark.slow),
        pytest.param(2048, 8, 1, marks=pytest.mark.slow),
    ],
)
def test_blocked_path_handles_any_load(N, E, k):
    """Empty experts, one expert taking every token, blocks of 8 to 128 rows: the blocked path
    equals ragged_dot (its dense CPU lowering is the reference here), gradients too."""
    cfg = dataclasses.replace(QWEN3, num_experts=E, num_experts_per_tok=k)
    p = init_params(cfg, jax.random.key(3))
    lp = jax.tree.map(lambda w: w[0], p["layers"])
    x = jax.random.normal(jax.random.key(4), (N, cfg.hidden_size))
    rng = np.random.default_rng(N)
    chosen = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    if N == 2048:
        chosen[:] = 3  # every token on one expert (k = 1)
    w = jnp.asarray(rng.random((N, k)), jnp.float32)

    def run_impl(impl):
        def f(lp, x):
            return moe.grouped_experts(lp, x, jnp.asarray(chosen), w, E, impl=impl)

        return f(lp, x), jax.grad(lambda lp, x: jnp.sum(f(lp, x) ** 2), argnums=(0, 1))(lp, x)

    (y1, g1), (y2, g2) = run_impl("blocked"), run_impl("ragged")
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cfg", [QWEN3, QWEN2], ids=["qwen3_moe", "qwen2_moe"])
def test_forced_routes_replay_bit_identically_and_others_change_logits(cfg):
    params = init_params(cfg, jax.random.key(0))
    tokens, positions, seg = batch()
    h, chosen = run(params, tokens, positions, seg, None, cfg)
    L, k = cfg.num_layers, cfg.num_experts_per_tok
    assert chosen.shape == (3, 10, L, k) and chosen.dtype == jnp.int32
    assert np.all((np.asarray(chosen) >= 0) & (np.asarray(chosen) < cfg.num_experts))
    np.testing.assert_array_equal(
        np.asarray(forward(params, tokens, positions, seg, cfg)), np.asarray(h)
    )

    # the router's own choice, forced: bit for bit the same, and the same routes come out
    h2, chosen2 = run(params, tokens, positions, seg, chosen, cfg)
    np.testing.assert_array_equal(np.asarray(h2), np.asarray(h))
    np.testing.assert_array_equal(np.asarray(chosen2), np.asarray(chosen))
    # all -1: the router decides everywhere
    h3, _ = run(params, tokens, positions, seg, jnp.full_like(chosen, -1), cfg)
    np.testing.assert_array_equal(np.asarray(h3), np.asarray(h))

    # other experts for one token of one layer: that token's output (and later ones) change
    other = np.asarray(chosen).copy()
    other[0, 4, 1] = (other[0, 4, 1] + 1) % cfg.num_experts  # another set of k experts
    assert set(other[0, 4, 1]) != set(np.asarray(chosen)[0, 4, 1])
    h4, chosen4 = run(params, tokens, positions, seg, jnp.asarray(other), cfg)
    np.testing.assert_array_equal(np.asarray(chosen4), other)
    diff = np.abs(np.asarray(h4) - np.asarray(h)).max(-1)
    assert np.all(diff[0, :4] == 0) and np.all(diff[1:] == 0)  # causal: earlier tokens intact
    assert diff[0, 4] > 1e-4

    # a row with a -1 falls back to the router for that token only
    mixed = np.asarray(other).copy()
    mixed[0, 4, 1, 0] = -1
    h5, _ = run(params, tokens, positions, seg, jnp.asarray(mixed), cfg)
    np.testing.assert_array_equal(np.asarray(h5), np.asarray(h))


@pytest.mark.slow  # long: the default run stays under its time limit
def test_routes_with_remat_and_seq_chunk_are_the_same():
    params = init_params(QWEN3, jax.random.key(0))
    tokens, positions, seg = batch(T=12)
    h, chosen = run(params, tokens, positions, seg, None, QWEN3)
    for kw in (dict(remat="full"), dict(remat="nested"), dict(seq_chunk=5)):
        cfg = dataclasses.replace(QWEN3, **kw)
        h2, chosen2 = run(params, tokens, positions, seg, chosen, cfg)
        np.testing.assert_array_equal(np.asarray(chosen2), np.asarray(chosen))
        np.testing.assert_allclose(np.asarray(h2), np.asarray(h), atol=1e-6)


def test_dense_models_refuse_routes():
    cfg = ModelConfig()
    tokens, positions, seg = batch()
    with pytest.raises(ValueError, match="routes are for mixture-of-experts models"):
        hidden_states(
            init_params(cfg, jax.random.key(0)), tokens, positions, seg, cfg, return_routes=True
        )


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(decoder_sparse_step=2), r"^decoder_sparse_step: only 1 \(every layer is a MoE"),
        (dict(mlp_only_layers=(0,)), r"^mlp_only_layers: only \[\] \(every layer is a MoE"),
        (dict(num_experts_per_tok=9), r"^num_experts_per_tok: must be in \[1, num_experts=8\]"),
        (dict(shared_expert_intermediate_size=8), r"^shared_expert_intermediate_size: a shared"),
        (dict(moe_intermediate_size=0), r"^moe_intermediate_size: must be > 0"),
    ],
)
def test_config_validation_names_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(QWEN3, **changes)


def test_dense_families_ignore_the_moe_fields():
    assert not ModelConfig(decoder_sparse_step=3, num_experts=0).is_moe
    assert QWEN3.resolved_norm_topk_prob and not QWEN2.resolved_norm_topk_prob


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("decoder_sparse_step", 2, "decoder_sparse_step=2 is not supported"),
        ("mlp_only_layers", [1], r"mlp_only_layers=\[1\] is not supported"),
    ],
)
def test_hf_configs_with_dense_layers_are_refused(key, value, message):
    hf = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "router_aux_loss_coef": 0.001,
        key: value,
    }
    with pytest.raises(UnsupportedModelError, match=message):
        model_config_from_hf(hf)


# ------------------------------------------------------------------------------ train step

TRAIN = TrainConfig(
    lr=1e-3,
    group_size=4,
    length_buckets=(16,),
    logprob_chunk=16,
    total_steps=10,
    adam_eps=1e-3,
    max_grad_norm=10.0,
)


def trajectories(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(2):
        prompt = rng.integers(0, 64, int(rng.integers(2, 6))).tolist()
        for _ in range(4):
            R = int(rng.integers(2, 9))
            out.append(
                Trajectory(
                    prompt,
                    rng.integers(0, 64, R).tolist(),
                    (-rng.random(R) * 3).tolist(),
                    float(rng.random()),
                    0,
                    (seed, g),
                )
            )
    return out


@pytest.mark.slow  # long: the default run stays under its time limit
def test_train_step_with_experts_sharded_over_two_devices_equals_unsharded():
    cfg = dataclasses.replace(QWEN3, num_layers=2)
    params = init_params(cfg, jax.random.key(0))
    # rows a multiple of data x expert = 4, so the sharded step takes the same batch
    b = pack_batch(trajectories(), TRAIN, trainer_version=0, row_multiple=4)
    want = Trainer(cfg, TRAIN, params=params)
    m0 = jax.device_get(want.step(b))
    mesh = make_mesh(jax.devices()[:8], 2, 2, expert=2)
    assert dict(mesh.shape) == {"data": 2, "expert": 2, "model": 2}
    tr = Trainer(cfg, TRAIN, mesh=mesh, params=params)
    spec = tr.state.params["layers"]["moe_gate"].sharding.spec
    assert spec == jax.sharding.PartitionSpec(None, "expert", None, "model")  # [L, E, D, f]
    m = jax.device_get(tr.step(b))
    np.testing.assert_allclose(float(m["loss"]), float(m0["loss"]), atol=1e-6)
    np.testing.assert_allclose(float(m["grad_norm"]), float(m0["grad_norm"]), rtol=1e-5)
    a = jax.device_get(tr.state.params)
    w = jax.device_get(want.state.params)
    worst = max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(x - y).max()), a, w)))
    assert worst < 1e-5


# --------------------------------------------------------------------------- rollout steps


def test_rollout_steps_return_the_routes_of_every_fed_token():
    """Prefill returns ``[B, C, L, k]`` per chunk, decode ``[S, B, L, k]`` for the token fed at
    each step; both equal the routes of the full forward pass over the same sequence."""
    from dora_jax.config import RolloutConfig
    from dora_jax.rollout.sampling import SamplingParams
    from dora_jax.rollout.steps import StepStatic, decode_step, init_cache, prefill_step

    cfg = QWEN3
    params = init_params(cfg, jax.random.key(0))
    params["layers"]["router"] = params["layers"]["router"] * 30  # decisive routing
    rcfg = RolloutConfig(
        page_size=8,
        num_pages=8,
        max_slots=2,
        max_prompt_len=16,
        max_new_tokens=8,
        prefill_chunk=8,
        temperature=0.0,
    )
    mesh = make_mesh(jax.devices()[:1], 1, 1)
    st = StepStatic(
        cfg=cfg,
        sampling=SamplingParams(0.0),
        mesh=mesh,
        impl="reference",
        interpret=False,
        decode_steps=3,
        eos_ids=(-1,),
    )
    cache = init_cache(cfg, rcfg, mesh)
    prefill = jax.jit(prefill_step, static_argnames=("st",))
    decode = jax.jit(decode_step, static_argnames=("st",))
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 64, 12)]
    tables = jnp.asarray([[1, 2, 3], [0, 0, 0]], jnp.int32)  # row 1: padding
    keys = jnp.zeros((2, 2), jnp.uint32)
    got = []
    for start in (0, 8):
        piece = prompt[start : start + 8]
        chunk = np.zeros((2, 8), np.int32)
        chunk[0, : len(piece)] = piece
        cache, nxt, _, _, routes = prefill(
            params,
            cache,
            jnp.asarray(chunk),
            jnp.asarray([start, 0], jnp.int32),
            jnp.asarray([len(piece), 0], jnp.int32),
            tables,
            keys,
            st=st,
        )
        assert routes.shape == (2, 8, cfg.num_layers, 2) and routes.dtype == jnp.int32
        got.append(np.asarray(routes)[0, : len(piece)])
    first = int(nxt[0])
    cache, toks, _, _, routes = decode(
        params,
        cache,
        jnp.asarray([first, 0], jnp.int32),
        jnp.asarray([12, 0], jnp.int32),
        tables,
        jnp.asarray([True, False]),
        keys,
        jnp.asarray([3, 0], jnp.int32),
        st=st,
    )
    assert routes.shape == (3, 2, cfg.num_layers, 2) and toks.shape == (3, 2)
    got.append(np.asarray(routes)[:, 0])  # fed: first, toks[0], toks[1]
    seq = prompt + [first] + [int(t) for t in np.asarray(toks)[:2, 0]]
    T = len(seq)
    _, want = run(
        params,
        jnp.asarray([seq], jnp.int32),
        jnp.arange(T)[None],
        jnp.ones((1, T), jnp.int32),
        None,
        cfg,
    )
    np.testing.assert_array_equal(np.concatenate(got), np.asarray(want)[0])


def test_dense_rollout_steps_return_no_routes():
    from dora_jax.config import RolloutConfig
    from dora_jax.rollout.sampling import SamplingParams
    from dora_jax.rollout.steps import StepStatic, init_cache, prefill_step

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1)
    rcfg = RolloutConfig(
        page_size=8, num_pages=4, max_slots=1, max_prompt_len=8, max_new_tokens=8, prefill_chunk=8
    )
    mesh = make_mesh(jax.devices()[:1], 1, 1)
    st = StepStatic(
        cfg=cfg, sampling=SamplingParams(0.0), mesh=mesh, impl="reference", interpret=False
    )
    out = prefill_step(
        init_params(cfg, jax.random.key(0)),
        init_cache(cfg, rcfg, mesh),
        jnp.ones((1, 8), jnp.int32),
        jnp.zeros(1, jnp.int32),
        jnp.full(1, 8, jnp.int32),
        jnp.asarray([[1]], jnp.int32),
        jnp.zeros((1, 2), jnp.uint32),
        st,
    )
    assert len(out) == 5 and out[4] is None


@pytest.mark.parametrize("decode_steps, num_pages", [(1, 40), (3, 12)])
def test_engine_records_every_tokens_routes(decode_steps, num_pages):
    """Finished requests carry ``[len(prompt) + len(tokens), L, k]`` routes equal to the full
    forward pass's (the last row, never fed, is -1), through multi-step decode, and through
    parking to host under tight pages (12 pages: requests are parked and resumed)."""
    from dora_jax.config import RolloutConfig
    from dora_jax.rollout import Engine, Request, request_key

    cfg = QWEN3
    params = init_params(cfg, jax.random.key(0))
    params["layers"]["router"] = params["layers"]["router"] * 30  # decisive routing
    rcfg = RolloutConfig(
        page_size=8,
        num_pages=num_pages,
        max_slots=4,
        max_prompt_len=16,
        max_new_tokens=24,
        prefill_chunk=8,
        temperature=1.0,
        decode_steps=decode_steps,
    )
    engine = Engine(cfg, rcfg, make_mesh(jax.devices()[:1], 1, 1), eos_id=2)
    engine.load_params(params, 0)
    rng = np.random.default_rng(7)
    reqs = [
        Request(
            i,
            [int(t) for t in rng.integers(3, 64, int(rng.integers(2, 17)))],
            0,
            request_key(7, i),
            int(rng.integers(1, 25)),
        )
        for i in range(8)
    ]
    engine.submit(reqs)
    finished, parked = [], 0
    for _ in range(500):
        if not engine.num_requests:
            break
        finished += engine.step().finished
        parked = max(parked, engine.load().parked)
    assert len(finished) == 8
    if num_pages == 12:
        assert parked > 0
    W = rcfg.max_prompt_len + rcfg.max_new_tokens  # one padded width: one compile
    for f in finished:
        seq = list(f.prompt) + list(f.tokens)
        assert f.routes.shape == (len(seq), cfg.num_layers, 2) and f.routes.dtype == np.int16
        assert np.all(f.routes[-1] == -1)
        T = len(seq)
        tokens = np.zeros((1, W), np.int32)
        tokens[0, :T] = seq
        seg = (np.arange(W) < T).astype(np.int32)[None]
        _, want = run(params, jnp.asarray(tokens), jnp.arange(W)[None], jnp.asarray(seg), None, cfg)
        np.testing.assert_array_equal(f.routes[:-1], np.asarray(want)[0, : T - 1])


def test_dense_engines_record_no_routes():
    from dora_jax.config import RolloutConfig
    from dora_jax.rollout import Engine, Request, request_key

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1)
    rcfg = RolloutConfig(
        page_size=8, num_pages=8, max_slots=2, max_prompt_len=8, max_new_tokens=4, prefill_chunk=8
    )
    engine = Engine(cfg, rcfg, make_mesh(jax.devices()[:1], 1, 1), eos_id=-1)
    engine.load_params(init_params(cfg, jax.random.key(0)), 0)
    engine.submit([Request(0, [5, 6, 7], 0, request_key(0, 0), 4)])
    finished = []
    while engine.num_requests:
        finished += engine.step().finished
    assert finished[0].routes is None
