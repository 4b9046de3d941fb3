"""The jitted GRPO train step: NumPy-oracle loss and metrics, staleness-0 ratio, sharded (2x4 and
4x2) == unsharded without recompiles, microbatching, learning direction, the non-finite guard,
fp32 master weights, Adam moment dtypes, and the gradients and first update of every loss option
(GRPO / Dr. GRPO / RLOO, the three aggregations, TIS, KL against a reference that differs from
the policy, microbatches) against ``jax.grad`` of an independent float64 model and loss."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_model import as_float64, reference_logprobs  # tests/reference_model.py

from dora_jax.config import ModelConfig, TrainConfig
from dora_jax.mesh import make_mesh
from dora_jax.model import forward, init_params
from dora_jax.train import (
    Trainer,
    Trajectory,
    init_state,
    model_params,
    pack_batch,
    token_logprobs,
    train_step_with_grads,
)
from dora_jax.train.advantages import valid_members

MODEL = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2
)
G = 4
# gradient oracle: the float32 step differs from the float64 oracle by <= 8.2e-7 of a leaf's
# largest entry (3.5e-7 for the loss, 2.6e-7 for the global norm); 1e-5 leaves 12x room
GRAD_RTOL = 1e-5
# adam_eps near a typical gradient entry and no clipping: the first AdamW update
# lr * g / (|g| + eps) then depends on the gradient's scale (with eps = 1e-8 it is about
# lr * sign(g), and a gradient scaled by any factor would give the same params)
# packed by tokens (the default) into a row count that splits over 4 data shards or 2
# microbatches, so every test below runs the same packed batch
ROWS = 4
TRAIN = TrainConfig(
    lr=1e-3,
    group_size=G,
    length_buckets=(16, 32),
    logprob_chunk=16,
    total_steps=10,
    adam_eps=1e-3,
    max_grad_norm=10.0,
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


def counted(batch, s):
    """Whether sample ``s`` enters its group's baseline and the loss (``valid``: not a failed
    call that ``data.on_failure`` dropped)."""
    return bool(batch.sample_mask[s]) and (batch.valid is None or bool(batch.valid[s]))


def np_advantages(batch, tcfg):
    """Per-sample advantages: each prompt group's rewards minus their mean (RLOO: times
    n / (n - 1), the leave-one-out baseline), divided by the group's population std for GRPO
    with ``normalize_std``; over the ``n`` members that are counted only, the others 0 (and
    all of a group with fewer than two counted)."""
    rewards = batch.rewards.astype(np.float64).reshape(-1, G)
    adv = np.zeros_like(rewards)
    for g, r in enumerate(rewards):
        kept = [i for i in range(G) if counted(batch, g * G + i)]
        n = len(kept)
        if n < 2:
            continue
        c = r[kept] - r[kept].mean()
        if tcfg.advantage == "rloo":
            adv[g, kept] = c * n / (n - 1)
        elif tcfg.normalize_std:
            adv[g, kept] = c / (np.sqrt((c**2).mean()) + tcfg.adv_eps)
        else:
            adv[g, kept] = c
    return adv.reshape(-1)


def np_step_oracle(params, batch, tcfg, ref_params=None):
    """Loss and metrics of a step, from full-vocabulary logits and per-sample Python loops."""
    lp, ent = np_token_stats(params, batch, MODEL)
    S = batch.num_samples
    adv = np_advantages(batch, tcfg)
    ref_lp = np_token_stats(ref_params, batch, MODEL)[0] if ref_params is not None else None
    per_seq, n_tok, n_loss = [], 0, 0
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
        if counted(batch, s):  # a dropped sample's tokens are in the figures, not the loss
            per_seq.append(tok)
            n_loss += sel.sum()
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
        loss = np.concatenate(per_seq).sum() / n_loss
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


def np_lag_oracle(params, batch, tcfg):
    """Per staleness bin: response tokens, the normalised ESS of the token importance weights,
    the clipped share (either side) and the behavior KL (k3), from per-sample loops."""
    lp, _ = np_token_stats(params, batch, MODEL)
    adv = np_advantages(batch, tcfg)
    bins = tcfg.staleness_bins
    w_of = [[] for _ in range(bins)]
    clip, kl = np.zeros(bins), np.zeros(bins)
    for s in range(batch.num_samples):
        sel = (batch.sample_index == s) & batch.loss_mask
        if not sel.any():
            continue
        k = min(int(batch.staleness[s]), bins - 1)
        r = np.exp(lp[sel] - batch.behavior_logprobs[sel].astype(np.float64))
        a = adv[s]
        w_of[k] += r.tolist()
        clip[k] += ((a < 0) & (r < 1 - tcfg.clip_eps_low)).sum()
        clip[k] += ((a > 0) & (r > 1 + tcfg.clip_eps_high)).sum()
        kl[k] += (r - 1 - np.log(r)).sum()
    n = np.array([len(w) for w in w_of], np.float64)
    ess = np.array([np.sum(w) ** 2 / (len(w) * np.sum(np.square(w))) if w else 0.0 for w in w_of])
    per = lambda x: np.where(n > 0, x / np.maximum(n, 1), 0.0)  # noqa: E731
    return {"lag_tokens": n, "lag_ess": ess, "lag_clip_frac": per(clip), "lag_kl": per(kl)}


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
    b = pack_batch(make_trajs(0, [0, 0]), TRAIN, trainer_version=0, row_multiple=ROWS)
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
    # every weight 1: the ESS is all of the tokens, at lag 0 only
    assert abs(float(m["lag_ess"][0]) - 1.0) < 1e-6 and not m["lag_ess"][1:].any()
    assert float(m["lag_tokens"][0]) == batch0.loss_mask.sum()


def test_step_matches_numpy_oracle(base, params0):
    """Stale groups with noisy behavior logprobs: ratios away from 1, both clips active."""
    b = pack_batch(make_trajs(1, [2, 0]), TRAIN, trainer_version=2, row_multiple=ROWS)
    b = with_behavior(b, params0, noise=0.5, seed=3)
    base.reset(params0)
    m = host(base.step(b))
    oracle = np_step_oracle(params0, b, TRAIN)
    assert oracle["clip_frac_low"] > 0 and oracle["clip_frac_high"] > 0
    assert 0 < oracle["mismatch_tokens"] < oracle["num_tokens"]
    assert_metrics_match(m, oracle)
    assert m["staleness_hist"].tolist() == [4, 0, 4, 0, 0, 0, 0, 0]
    lags = np_lag_oracle(params0, b, TRAIN)  # the drift by lag: lags 0 and 2 have tokens
    assert lags["lag_tokens"][[0, 2]].all() and not lags["lag_tokens"][[1, 3]].any()
    assert 0.3 < lags["lag_ess"][2] < 0.99 and lags["lag_kl"][2] > 0
    for k, want in lags.items():
        np.testing.assert_allclose(np.asarray(m[k]), want, rtol=2e-5, atol=2e-6, err_msg=k)
    lens = b.response_lens[b.sample_mask]
    np.testing.assert_allclose(float(m["response_len_mean"]), lens.mean(), rtol=1e-6)
    assert int(m["response_len_max"]) == lens.max()
    assert float(m["grad_norm"]) > 0


@pytest.mark.parametrize("data,model", [(2, 4), (4, 2)])
def test_sharded_step_equals_unsharded_without_recompiling(
    first_step, params0, batch0, data, model
):
    tr = Trainer(MODEL, TRAIN, mesh=make_mesh(jax.devices(), data, model), params=params0)
    emb = tr.state.params["layers"]["w_gate"].sharding.spec
    assert emb == jax.sharding.PartitionSpec(None, None, "model")  # params really are sharded
    m = host(tr.step(batch0))
    want = first_step["metrics"]
    assert max_diff(host(tr.state.params), first_step["params"]) < 1e-5
    np.testing.assert_allclose(float(m["loss"]), float(want["loss"]), atol=1e-6)
    np.testing.assert_allclose(float(m["grad_norm"]), float(want["grad_norm"]), rtol=1e-5)
    # another batch of the same bucket (different content and staleness): no new compilation
    b1 = pack_batch(make_trajs(5, [1, 0]), TRAIN, trainer_version=1, row_multiple=ROWS)
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
    b = pack_batch(make_trajs(2, [0, 0], rewards), TRAIN, trainer_version=0, row_multiple=ROWS)
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


# ---------------------------------------------------------------- gradient oracle


def oracle_loss(lp, batch, tcfg, adv, ref_lp=None):
    """The step's loss from per-token logprobs ``lp`` (``[B, T]``, float64), per-sample Python
    loops as in :func:`np_step_oracle`. The truncated importance weight ``min(1, C / r)`` is a
    constant of the loss (by definition the TIS gradient is ``min(r, C) A grad log pi``)."""
    per_seq = []
    for s in range(batch.num_samples):
        sel = (batch.sample_index == s) & batch.loss_mask
        if not sel.any() or not counted(batch, s):
            continue
        logp, a = lp[sel], adv[s]
        r = jnp.exp(logp - batch.behavior_logprobs[sel].astype(np.float64))
        clipped = jnp.clip(r, 1 - tcfg.clip_eps_low, 1 + tcfg.clip_eps_high)
        tok = -jnp.minimum(r * a, clipped * a)
        if tcfg.tis_cap is not None:
            tok = tok * jax.lax.stop_gradient(jnp.minimum(1.0, tcfg.tis_cap / r))
        if tcfg.kl_beta > 0:
            d = ref_lp[sel] - logp
            tok = tok + tcfg.kl_beta * (jnp.exp(d) - d - 1)
        per_seq.append(tok)
    if tcfg.loss_agg == "token_mean":
        return jnp.concatenate(per_seq).sum() / sum(x.size for x in per_seq)
    if tcfg.loss_agg == "seq_mean_token_mean":
        return sum(x.mean() for x in per_seq) / len(per_seq)
    return sum(x.sum() / tcfg.resolved_loss_norm_len for x in per_seq) / len(per_seq)


def _reference_lp(p64, tokens, positions, segment_ids, targets):
    return reference_logprobs(p64, tokens, positions, segment_ids, targets, MODEL, xp=jnp)


_reference_lp_jit = jax.jit(_reference_lp)


@jax.jit
def _reference_lp_pullback(p64, cotangent, *batch_arrays):
    _, pull = jax.vjp(lambda p: _reference_lp(p, *batch_arrays), p64)
    return pull(cotangent)[0]


def oracle_grads(params, batch, tcfg, ref_params=None):
    """``(loss, grads)`` in float64 from the independent reference model
    (``tests/reference_model.py``): ``jax.grad`` of :func:`oracle_loss` taken through the
    model's logprobs by the chain rule (the model part is compiled once for every case)."""
    arrays = (batch.tokens, batch.positions, batch.segment_ids, batch.targets)
    with jax.enable_x64(True):
        p64 = as_float64(params, jnp)
        lp = _reference_lp_jit(p64, *arrays)
        ref_lp = None
        if tcfg.kl_beta > 0:
            ref_lp = _reference_lp_jit(as_float64(ref_params, jnp), *arrays)
        adv = np_advantages(batch, tcfg)
        loss_of_lp = jax.value_and_grad(lambda x: oracle_loss(x, batch, tcfg, adv, ref_lp))
        loss, d_lp = jax.jit(loss_of_lp)(lp)
        grads = _reference_lp_pullback(p64, d_lp, *arrays)
        return float(loss), jax.tree.map(np.asarray, grads)


def global_norm(tree):
    return float(
        np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in jax.tree.leaves(tree)))
    )


def adamw_first_step(params, grads, tcfg):
    """Params after one AdamW step from fresh moments, written out: global-norm clip, then
    ``m_hat = g``, ``v_hat = g^2`` (the bias-corrected moments), ``u = g / (|g| + eps)``, plus
    decoupled weight decay on matrices (not norms or biases), times the step-0 learning rate."""
    n = global_norm(grads)
    scale = min(1.0, tcfg.max_grad_norm / n)
    lr = tcfg.lr * (min(1.0, 1.0 / tcfg.warmup_steps) if tcfg.warmup_steps else 1.0)

    def upd(path, p, g):
        g = g * scale
        u = g / (np.abs(g) + tcfg.adam_eps)
        if path[-1].key not in ("attn_norm", "mlp_norm", "final_norm", "bq", "bk", "bv"):
            u = u + tcfg.weight_decay * p
        return p - lr * u

    return jax.tree_util.tree_map_with_path(upd, params, grads)


# Every loss option appears in at least one case (the second also clips the global norm).
GRAD_CASES = {
    "grpo-token_mean": dict(),
    "drgrpo-seq_sum_norm-tis-clipnorm": dict(
        normalize_std=False, tis_cap=1.5, max_grad_norm=0.05, loss_agg="seq_mean_token_sum_norm"
    ),
    "rloo-seq_mean-kl-microbatches": dict(
        advantage="rloo", loss_agg="seq_mean_token_mean", kl_beta=0.5, tis_cap=2.0, microbatches=2
    ),
    # microbatches by a token budget, one row each (rows packed for one device), the step
    # looping over the used ones only
    "grpo-seq_mean-token_budget": dict(
        loss_agg="seq_mean_token_mean", microbatch_tokens=16, pack_multiple=1
    ),
}


def perturbed(params, scale, seed):
    """``params`` plus independent normal noise of std ``scale`` on every entry."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + scale * rng.normal(size=x.shape).astype(np.float32), params)


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_and_update_match_float64_oracle(params0, case):
    """Stale groups with noisy behavior logprobs (both clips and the TIS cap active): the loss,
    every gradient leaf, the global norm and the first AdamW update against the float64 oracle,
    and the metrics against the NumPy oracle. The KL reference is *not* the policy, so the KL
    term contributes a gradient of its own."""
    opts = dict(GRAD_CASES[case])
    multiple = opts.pop("pack_multiple", ROWS)
    tcfg = dataclasses.replace(TRAIN, weight_decay=0.1, lr=1e-2, **opts)
    b = pack_batch(make_trajs(1, [2, 0]), tcfg, trainer_version=2, row_multiple=multiple)
    if tcfg.microbatch_tokens:  # some microbatches hold samples, the rest are skipped
        assert 0 < int(b.chunk_mask.sum()) < len(b.chunk_mask) == b.num_rows
    b = with_behavior(b, params0, noise=0.5, seed=3)
    ref = perturbed(params0, 0.05, seed=7)
    state = init_state(params0, MODEL, tcfg)
    if tcfg.kl_beta > 0:
        assert max_diff(host(state.ref_params), params0) == 0  # by default the initial policy
        state = state.replace(ref_params=ref)
    new_state, m, grads = host(jax.jit(train_step_with_grads)(state, b))
    want_loss, want = oracle_grads(params0, b, tcfg, ref)
    assert int(m["skipped"]) == 0
    np.testing.assert_allclose(float(m["loss"]), want_loss, rtol=GRAD_RTOL)
    np.testing.assert_allclose(float(m["grad_norm"]), global_norm(want), rtol=GRAD_RTOL)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        w = want
        for k in path:
            w = w[k.key]
        np.testing.assert_allclose(
            g, w, rtol=0, atol=GRAD_RTOL * np.abs(w).max(), err_msg=jax.tree_util.keystr(path)
        )
    # measured 1.0e-5 x lr (float32 params up to 1 round at 6e-8 = 6e-6 x lr): 10x room
    assert max_diff(new_state.params, adamw_first_step(params0, want, tcfg)) < 1e-4 * tcfg.lr
    oracle = np_step_oracle(params0, b, tcfg, ref_params=ref)
    assert oracle["clip_frac_low"] > 0 and oracle["clip_frac_high"] > 0
    assert_metrics_match(m, oracle)
    if tcfg.tis_cap is not None:
        assert float(m["tis_frac"]) > 0
    if tcfg.kl_beta > 0:  # the KL term moves the gradient far beyond the tolerance
        assert float(m["kl_ref"]) > 1e-3
        _, no_kl = oracle_grads(params0, b, dataclasses.replace(tcfg, kl_beta=0.0))
        moved = global_norm(jax.tree.map(np.subtract, want, no_kl))
        assert moved > 1e3 * GRAD_RTOL * global_norm(want)


# data.on_failure: member 1 of the first group failed (drop_sample), or that whole group
# (drop_group); the RLOO case has the KL penalty, which a dropped sample must not feed either
DROP_CASES = {
    "drop_sample-rloo-seq_mean-kl": (
        "drop_sample",
        dict(advantage="rloo", kl_beta=0.5, loss_agg="seq_mean_token_mean"),
    ),
    "drop_sample-grpo-token_mean": ("drop_sample", dict()),
    "drop_group-drgrpo-seq_sum_norm": (
        "drop_group",
        dict(normalize_std=False, loss_agg="seq_mean_token_sum_norm"),
    ),
}


@pytest.mark.parametrize("case", list(DROP_CASES))
def test_dropped_samples_have_no_loss_weight(params0, case):
    """Samples that are not ``valid`` (a failed call dropped by ``data.on_failure``): the loss
    and every gradient leaf match the float64 oracle that leaves them out of their group's
    baseline and of the loss, and their reward and behavior logprobs change nothing at all."""
    policy, opts = DROP_CASES[case]
    tcfg = dataclasses.replace(TRAIN, **opts)
    failed = np.zeros((2, G), bool)
    failed[0, 1] = True
    valid = valid_members(failed, policy).reshape(-1)
    trajs = make_trajs(1, [2, 0])
    trajs = [dataclasses.replace(t, valid=bool(v)) for t, v in zip(trajs, valid, strict=True)]
    b = pack_batch(trajs, tcfg, trainer_version=2, row_multiple=ROWS)
    assert b.valid[: 2 * G].tolist() == valid.tolist()
    b = with_behavior(b, params0, noise=0.5, seed=3)
    ref = perturbed(params0, 0.05, seed=7)
    state = init_state(params0, MODEL, tcfg)
    if tcfg.kl_beta > 0:
        state = state.replace(ref_params=ref)
    step = jax.jit(train_step_with_grads)
    _, m, grads = host(step(state, b))
    want_loss, want = oracle_grads(params0, b, tcfg, ref)
    # (a loss of terms that nearly cancel: 4e-4 in the Dr. GRPO case, 5e-9 off)
    np.testing.assert_allclose(float(m["loss"]), want_loss, rtol=GRAD_RTOL, atol=1e-7)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        w = want
        for k in path:
            w = w[k.key]
        atol = GRAD_RTOL * np.abs(w).max()
        np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))
    assert_metrics_match(m, np_step_oracle(params0, b, tcfg, ref_params=ref))
    # another reward and other behavior logprobs for the dropped samples: the same step
    dropped = np.flatnonzero(~valid)
    rewards = b.rewards.copy()
    rewards[dropped] = 5.0
    blp = b.behavior_logprobs.copy()
    on_dropped = np.isin(b.sample_index, dropped) & b.loss_mask
    blp[on_dropped] -= 1.0
    _, m2, grads2 = host(step(state, b.replace(rewards=rewards, behavior_logprobs=blp)))
    assert max_diff(grads2, grads) == 0.0 and float(m2["loss"]) == float(m["loss"])
    # ... while counting them would change it
    _, _, all_in = host(step(state, b.replace(valid=np.ones_like(b.valid))))
    assert max_diff(all_in, grads) > 1e3 * GRAD_RTOL * np.abs(want["embed"]).max()


def test_token_budget_microbatches_equal_the_ladder_and_compile_once_per_bucket(params0):
    """On the 2x2 mesh: batches of 3, 1 and 2 prompt groups (three shapes on the ladder) give
    the same updates under ``train.microbatch_tokens`` as on the ladder, with one compilation
    per bucket met."""
    mesh = make_mesh(jax.devices()[:4], 2, 2)
    ladder = Trainer(MODEL, TRAIN, mesh=mesh, params=params0)
    budget = Trainer(
        MODEL, dataclasses.replace(TRAIN, microbatch_tokens=16), mesh=mesh, params=params0
    )
    shapes, buckets = set(), set()
    for step, versions in enumerate([[0, 0, 0], [1], [2, 2]]):
        trajs = make_trajs(10 + step, versions)
        a, b = ladder.pack(trajs, num_groups=3), budget.pack(trajs, num_groups=3)
        assert b.num_rows == 12  # room for 12 samples, one per row
        shapes.add((a.num_rows, a.seq_len))
        buckets.add(b.seq_len)
        ma, mb = host(ladder.step(a)), host(budget.step(b))
        for k in ("loss", "grad_norm", "num_tokens", "real_tokens", "entropy", "approx_kl"):
            np.testing.assert_allclose(mb[k], ma[k], rtol=2e-5, atol=1e-7, err_msg=k)
        assert max_diff(host(budget.state.params), host(ladder.state.params)) < 1e-5
    assert ladder.num_compiles == len(shapes) == 3
    assert budget.num_compiles == len(buckets) < len(shapes)
