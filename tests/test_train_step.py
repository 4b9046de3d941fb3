"""The jitted GRPO train step: NumPy-oracle loss and metrics, staleness-0 ratio, sharded ==
unsharded without recompiles, microbatching, learning direction, the non-finite guard, fp32
master weights and the KL/TIS/RLOO options."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.config import ModelConfig, TrainConfig
from dora_jax.mesh import make_mesh
from dora_jax.model import forward, init_params
from dora_jax.train import Trainer, Trajectory, model_params, pack_batch, token_logprobs

MODEL = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2
)
G = 4
TRAIN = TrainConfig(
    lr=1e-3, group_size=G, length_buckets=(16, 32), logprob_chunk=16, total_steps=10
)


def make_trajs(seed, versions, rewards=None):
    """One prompt group per entry of ``versions``; random prompts, responses, rewards."""
    rng = np.random.default_rng(seed)
    out = []
    for g, v in enumerate(versions):
        prompt = rng.integers(0, MODEL.vocab_size, int(rng.integers(2, 6))).tolist()
        for i in range(G):
            R = int(rng.integers(2, 9))
            r = float(rng.random()) if rewards is None else rewards[g][i]
            lp = (-rng.random(R) * 3).tolist()
            out.append(Trajectory(prompt, rng.integers(0, 64, R).tolist(), lp, r, v, (seed, g)))
    return out


@jax.jit
def _logprobs(params, batch):
    lp, _ = token_logprobs(
        params,
        batch.tokens,
        batch.positions,
        batch.segment_ids,
        batch.targets,
        MODEL,
        chunk=TRAIN.logprob_chunk,
    )
    return lp


def with_behavior(batch, params, noise=0.0, seed=0):
    """The trainer's own logprobs under ``params`` as behavior logprobs (plus optional noise)."""
    lp = np.asarray(_logprobs(params, batch), np.float64)
    lp += noise * np.random.default_rng(seed).normal(size=lp.shape)
    return batch.replace(behavior_logprobs=np.where(batch.loss_mask, lp, 0.0).astype(np.float32))


def seq_logprob_sums(params, batch):
    lp = np.asarray(_logprobs(params, batch))
    S = batch.num_samples
    return np.array([lp[(batch.sample_index == s) & batch.loss_mask].sum() for s in range(S)])


def host(tree):
    return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(tree))


def max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))


# ---------------------------------------------------------------- NumPy oracle of one step


def np_log_softmax(z):
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def np_token_stats(params, batch, cfg):
    z = np.asarray(forward(params, batch.tokens, batch.positions, batch.segment_ids, cfg))
    ls = np_log_softmax(z)
    lp = np.take_along_axis(ls, batch.targets[..., None], -1)[..., 0]
    ent = -(np.exp(ls) * ls).sum(-1)
    return lp, ent


def np_step_oracle(params, batch, tcfg, ref_params=None):
    """Loss and metrics of a step, from full-vocabulary logits and per-sample Python loops."""
    lp, ent = np_token_stats(params, batch, MODEL)
    S = batch.num_samples
    rewards = batch.rewards.astype(np.float64).reshape(-1, G)
    adv = np.zeros_like(rewards)
    for g, r in enumerate(rewards):
        if not batch.sample_mask[g * G]:
            continue
        c = r - r.mean()
        if tcfg.advantage == "rloo":
            adv[g] = c * G / (G - 1)
        elif tcfg.normalize_std:
            adv[g] = c / (np.sqrt((c**2).mean()) + tcfg.adv_eps)
        else:
            adv[g] = c
    adv = adv.reshape(S)
    ref_lp = np_token_stats(ref_params, batch, MODEL)[0] if ref_params is not None else None
    per_seq, n_tok = [], 0
    sums = dict(low=0.0, high=0.0, kl=0.0, ent=0.0, mis=0.0, mis_n=0.0)
    for s in range(S):
        sel = (batch.sample_index == s) & batch.loss_mask
        if not sel.any():
            continue
        logp, blp, a = lp[sel], batch.behavior_logprobs[sel].astype(np.float64), adv[s]
        r = np.exp(logp - blp)
        tok = -np.minimum(r * a, np.clip(r, 1 - tcfg.clip_eps_low, 1 + tcfg.clip_eps_high) * a)
        if tcfg.tis_cap is not None:
            tok = tok * np.minimum(1.0, tcfg.tis_cap / r)
        if tcfg.kl_beta > 0:
            d = ref_lp[sel] - logp
            tok = tok + tcfg.kl_beta * (np.exp(d) - d - 1)
        per_seq.append(tok)
        n_tok += sel.sum()
        sums["low"] += ((a < 0) & (r < 1 - tcfg.clip_eps_low)).sum()
        sums["high"] += ((a > 0) & (r > 1 + tcfg.clip_eps_high)).sum()
        k3 = r - 1 - np.log(r)
        sums["kl"] += k3.sum()
        sums["ent"] += ent[sel].sum()
        if batch.staleness[s] == 0:
            sums["mis"] += k3.sum()
            sums["mis_n"] += sel.sum()
    if tcfg.loss_agg == "token_mean":
        loss = np.concatenate(per_seq).sum() / n_tok
    elif tcfg.loss_agg == "seq_mean_token_mean":
        loss = np.mean([x.mean() for x in per_seq])
    else:
        loss = np.mean([x.sum() / tcfg.resolved_loss_norm_len for x in per_seq])
    return {
        "loss": loss,
        "clip_frac_low": sums["low"] / n_tok,
        "clip_frac_high": sums["high"] / n_tok,
        "approx_kl": sums["kl"] / n_tok,
        "entropy": sums["ent"] / n_tok,
        "mismatch_kl": sums["mis"] / max(sums["mis_n"], 1),
        "mismatch_tokens": sums["mis_n"],
        "num_tokens": n_tok,
    }


def assert_metrics_match(metrics, oracle):
    for k, want in oracle.items():
        np.testing.assert_allclose(float(metrics[k]), want, rtol=2e-5, atol=2e-6, err_msg=k)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def params0():
    return host(init_params(MODEL, jax.random.key(1)))


@pytest.fixture(scope="module")
def batch0(params0):
    """Two prompt groups, staleness 0, behavior logprobs from the same params."""
    b = pack_batch(make_trajs(0, [0, 0]), TRAIN, trainer_version=0)
    return with_behavior(b, params0)


@pytest.fixture(scope="module")
def base():
    return Trainer(MODEL, TRAIN, key=jax.random.key(1))


@pytest.fixture(scope="module")
def first_step(base, params0, batch0):
    base.reset(params0)
    metrics = host(base.step(batch0))
    return {"metrics": metrics, "params": host(base.state.params)}


# ---------------------------------------------------------------- tests


def test_staleness0_ratio_is_one_and_nothing_clipped(first_step, batch0):
    m = first_step["metrics"]
    assert abs(float(m["ratio_mean"]) - 1.0) < 1e-5
    assert float(m["clip_frac_low"]) == 0.0 and float(m["clip_frac_high"]) == 0.0
    assert abs(float(m["approx_kl"])) < 1e-6 and abs(float(m["mismatch_kl"])) < 1e-6
    assert float(m["mismatch_tokens"]) == float(m["num_tokens"]) == batch0.loss_mask.sum()
    assert int(m["skipped"]) == 0 and int(m["version"]) == 1


def test_step_matches_numpy_oracle(base, params0):
    """Stale groups with noisy behavior logprobs: ratios away from 1, both clips active."""
    b = pack_batch(make_trajs(1, [2, 0]), TRAIN, trainer_version=2)
    b = with_behavior(b, params0, noise=0.5, seed=3)
    base.reset(params0)
    m = host(base.step(b))
    oracle = np_step_oracle(params0, b, TRAIN)
    assert oracle["clip_frac_low"] > 0 and oracle["clip_frac_high"] > 0
    assert 0 < oracle["mismatch_tokens"] < oracle["num_tokens"]
    assert_metrics_match(m, oracle)
    assert m["staleness_hist"].tolist() == [4, 0, 4, 0, 0, 0, 0, 0]
    lens = b.response_lens[b.sample_mask]
    np.testing.assert_allclose(float(m["response_len_mean"]), lens.mean(), rtol=1e-6)
    assert int(m["response_len_max"]) == lens.max()
    assert float(m["grad_norm"]) > 0


def test_sharded_step_equals_unsharded_without_recompiling(first_step, params0, batch0):
    mesh = make_mesh(jax.devices(), 2, 4)
    tr = Trainer(MODEL, TRAIN, mesh=mesh, params=params0)
    emb = tr.state.params["layers"]["w_gate"].sharding.spec
    assert emb == jax.sharding.PartitionSpec(None, None, "model")  # params really are sharded
    m = host(tr.step(batch0))
    assert max_diff(host(tr.state.params), first_step["params"]) < 1e-5
    np.testing.assert_allclose(float(m["loss"]), float(first_step["metrics"]["loss"]), atol=1e-6)
    # another batch of the same bucket (different content and staleness): no new compilation
    b1 = pack_batch(make_trajs(5, [1, 0]), TRAIN, trainer_version=1)
    assert b1.tokens.shape == batch0.tokens.shape
    m1 = tr.step(b1)
    assert int(m1["version"]) == 2
    assert tr.num_compiles == 1 and tr.traces == 1


def test_microbatched_step_equals_full_batch(first_step, params0, batch0):
    tr = Trainer(MODEL, dataclasses.replace(TRAIN, microbatches=2), params=params0)
    m = host(tr.step(batch0))
    assert max_diff(host(tr.state.params), first_step["params"]) < 1e-5
    np.testing.assert_allclose(float(m["loss"]), float(first_step["metrics"]["loss"]), atol=1e-6)
    np.testing.assert_allclose(
        float(m["grad_norm"]), float(first_step["metrics"]["grad_norm"]), rtol=1e-5
    )


def test_steps_raise_likelihood_of_positive_advantage_and_lower_negative(base, params0):
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]]
    b = pack_batch(make_trajs(2, [0, 0], rewards), TRAIN, trainer_version=0)
    b = with_behavior(b, params0)
    base.reset(params0)
    before = seq_logprob_sums(params0, b)
    for _ in range(4):
        m = base.step(b)
        assert int(m["skipped"]) == 0
    delta = seq_logprob_sums(model_params(base.state), b) - before
    r = np.asarray(rewards).reshape(-1)
    adv_sign = np.sign(r - np.repeat(np.asarray(rewards).mean(1), G))
    assert np.all(np.sign(delta) == adv_sign), (delta, adv_sign)
    assert np.all(np.abs(delta) > 1e-3)


@pytest.mark.parametrize("corrupt", ["behavior_nan", "reward_inf"])
def test_nonfinite_step_is_skipped_and_changes_nothing(base, params0, batch0, corrupt):
    base.reset(params0)
    opt0 = host(base.state.opt_state)
    if corrupt == "behavior_nan":
        blp = batch0.behavior_logprobs.copy()
        blp[np.nonzero(batch0.loss_mask)[0][0], np.nonzero(batch0.loss_mask)[1][0]] = np.nan
        bad = batch0.replace(behavior_logprobs=blp)
    else:
        rw = batch0.rewards.copy()
        rw[1] = np.inf
        bad = batch0.replace(rewards=rw)
    m = host(base.step(bad))
    assert int(m["skipped"]) == 1 and int(m["skipped_total"]) == 1
    assert int(base.state.version) == 0 and int(base.state.skipped) == 1
    assert max_diff(host(base.state.params), params0) == 0.0
    assert max_diff(host(base.state.opt_state), opt0) == 0.0
    m = host(base.step(batch0))  # a good step afterwards is applied
    assert int(m["skipped"]) == 0 and int(m["version"]) == 1 and int(m["skipped_total"]) == 1
    assert np.all(np.isfinite(jax.tree.leaves(host(base.state.params))[0]))


def test_fp32_master_weights_with_bf16_params(params0, batch0):
    mcfg = dataclasses.replace(MODEL, param_dtype="bfloat16")
    tcfg = dataclasses.replace(TRAIN, fp32_master_weights=True, lr=1e-5)
    p_bf16 = jax.tree.map(lambda w: jnp.asarray(w, jnp.bfloat16), params0)
    tr = Trainer(mcfg, tcfg, params=p_bf16)
    leaves = jax.tree.leaves(tr.state.params) + jax.tree.leaves(tr.state.opt_state)
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in leaves)
    master0 = host(tr.state.params)
    m = host(tr.step(batch0))
    assert int(m["version"]) == 1 and np.isfinite(float(m["loss"]))
    master1 = host(tr.state.params)
    exported = tr.export_params()
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(exported))
    # updates of ~lr = 1e-5 are far below bf16 resolution: only the f32 master keeps them
    w0, w1 = master0["layers"]["w_up"], master1["layers"]["w_up"]
    assert 0 < np.max(np.abs(w1 - w0)) < 2e-5
    bf0 = np.asarray(jnp.asarray(w0, jnp.bfloat16), np.float32)
    bf1 = np.asarray(exported["layers"]["w_up"], np.float32)
    assert np.mean(bf0 == bf1) > 0.5


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_adam_moments_are_float32_unless_asked_otherwise(params0, batch0, moments):
    """bf16 params without master weights: the moments follow train.adam_moment_dtype (float32
    by default, not the params' dtype) and keep it through a step; the params stay bf16."""
    mcfg = dataclasses.replace(MODEL, param_dtype="bfloat16")
    tcfg = dataclasses.replace(TRAIN, adam_moment_dtype=moments)
    assert TrainConfig().adam_moment_dtype == "float32"
    p_bf16 = jax.tree.map(lambda w: jnp.asarray(w, jnp.bfloat16), params0)
    tr = Trainer(mcfg, tcfg, params=p_bf16)

    def moment_dtypes():
        adam = tr.state.opt_state[1][0]  # (clip, adamw: (scale_by_adam, ...))
        return {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))}

    assert moment_dtypes() == {jnp.dtype(moments)}
    m = host(tr.step(batch0))
    assert int(m["version"]) == 1 and np.isfinite(float(m["loss"]))
    assert moment_dtypes() == {jnp.dtype(moments)}
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(tr.state.params))


def test_kl_tis_rloo_seq_norm_options_match_oracle(params0):
    tcfg = dataclasses.replace(
        TRAIN,
        kl_beta=0.1,
        tis_cap=1.5,
        advantage="rloo",
        loss_agg="seq_mean_token_sum_norm",
        lr=1e-2,
    )
    tr = Trainer(MODEL, tcfg, params=params0)
    b = pack_batch(make_trajs(3, [0, 0]), tcfg, trainer_version=0)
    b = with_behavior(b, params0, noise=0.5, seed=4)
    m0 = host(tr.step(b))
    assert abs(float(m0["kl_ref"])) < 1e-7  # the reference policy is the initial policy
    assert float(m0["tis_frac"]) > 0
    assert_metrics_match(m0, np_step_oracle(params0, b, tcfg, ref_params=params0))
    params1 = host(tr.state.params)
    m1 = host(tr.step(b))
    assert float(m1["kl_ref"]) > 1e-6
    assert_metrics_match(m1, np_step_oracle(params1, b, tcfg, ref_params=params0))


@pytest.mark.slow
def test_sharded_4x2_equals_unsharded(first_step, params0, batch0):
    tr = Trainer(MODEL, TRAIN, mesh=make_mesh(jax.devices(), 4, 2), params=params0)
    tr.step(batch0)
    assert max_diff(host(tr.state.params), first_step["params"]) < 1e-5
