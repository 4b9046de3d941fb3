"""GRPO math against hand-written NumPy oracles: advantages, ratio, clip, TIS, KL, aggregation,
chunked logprobs/entropy, and the learning-rate schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.config import TrainConfig
from dora_jax.train.advantages import group_advantages, valid_members
from dora_jax.train.logprobs import chunk_layout, chunked_logprobs
from dora_jax.train.losses import (
    aggregate,
    clipped_surrogate,
    importance_ratio,
    kl_k3,
    masked_mean,
    token_weights,
)
from dora_jax.train.state import lr_schedule

# ---------------------------------------------------------------- advantages


def np_advantages(rewards, group_mask, mode, normalize_std, eps):
    out = np.zeros_like(rewards, dtype=np.float64)
    for g, r in enumerate(np.asarray(rewards, np.float64)):
        if not group_mask[g]:
            continue
        G = len(r)
        for i in range(G):
            if mode == "rloo":
                out[g, i] = r[i] - (r.sum() - r[i]) / (G - 1)
            else:
                mean = r.sum() / G
                std = np.sqrt(((r - mean) ** 2).sum() / G)  # population std
                out[g, i] = (r[i] - mean) / (std + eps) if normalize_std else r[i] - mean
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "mode,normalize_std", [("grpo", True), ("grpo", False), ("rloo", False), ("rloo", True)]
)
def test_group_advantages_match_oracle(seed, mode, normalize_std):
    rng = np.random.default_rng(seed)
    NG, G = rng.integers(1, 6), rng.integers(2, 9)
    rewards = rng.normal(size=(NG, G)).astype(np.float32)
    if seed % 2:  # binary rewards, including all-equal groups
        rewards = rng.integers(0, 2, size=(NG, G)).astype(np.float32)
    mask = rng.random(NG) < 0.8
    got = group_advantages(rewards, mask, mode=mode, normalize_std=normalize_std, eps=1e-6)
    want = np_advantages(rewards, mask, mode, normalize_std, 1e-6)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(got)))


def test_group_advantages_known_values():
    r = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]], np.float32)
    a = np.asarray(group_advantages(r, mode="grpo", normalize_std=True, eps=0.0 + 1e-9))
    np.testing.assert_allclose(a[0], [1.0, -1.0, -1.0, 1.0], atol=1e-6)  # population std 0.5
    np.testing.assert_allclose(a[1], 0.0, atol=1e-6)
    loo = np.asarray(group_advantages(r, mode="rloo"))
    np.testing.assert_allclose(loo[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3], atol=1e-6)


# ---------------------------------------------------------------- failed calls (data.on_failure)

MODES = [("grpo", True), ("grpo", False), ("rloo", False)]  # GRPO, Dr. GRPO, RLOO


def np_policy_advantages(rewards, failed, policy, mode, normalize_std, eps):
    """Advantages under ``data.on_failure``, one group and one member at a time: ``zero`` is the
    plain oracle (a failed member's 0 in its group); ``drop_sample`` computes each group over its
    members that did not fail only, the failed ones 0 (so is a group with fewer than two left);
    ``drop_group`` gives every member of a group with a failure 0."""
    rewards, failed = np.asarray(rewards, np.float64), np.asarray(failed, bool)
    if policy == "zero":
        return np_advantages(rewards, np.ones(len(rewards), bool), mode, normalize_std, eps)
    out = np.zeros_like(rewards)
    for g, (r, f) in enumerate(zip(rewards, failed, strict=True)):
        if policy == "drop_group" and f.any():
            continue
        kept = [i for i in range(len(r)) if not f[i]]
        if len(kept) < 2:
            continue
        sub = np_advantages(r[kept][None], [True], mode, normalize_std, eps)[0]
        out[g, kept] = sub
    return out


def advantages_under(policy, rewards, failed, mode, normalize_std, eps=1e-6):
    valid = valid_members(failed, policy)
    return np.asarray(
        group_advantages(rewards, valid=valid, mode=mode, normalize_std=normalize_std, eps=eps)
    )


@pytest.mark.parametrize("mode,normalize_std", MODES)
def test_one_failed_member_gets_the_advantages_the_policy_says(mode, normalize_std):
    """A group of 4 whose third member's reward call failed (scored 0), beside a clean group."""
    rewards = np.array([[1.0, 0.0, 0.0, 0.5], [0.25, 1.0, 0.0, 0.5]], np.float32)
    failed = np.array([[False, False, True, False], [False] * 4])
    today = np_advantages(rewards, [True, True], mode, normalize_std, 1e-6)
    clean = today[1]
    # zero: today's advantages, the failed member's 0 in the baseline
    got = advantages_under("zero", rewards, failed, mode, normalize_std)
    np.testing.assert_allclose(got, today, rtol=1e-5, atol=1e-6)
    # drop_sample: the other three from their own rewards only, the failed one 0
    got = advantages_under("drop_sample", rewards, failed, mode, normalize_std)
    others = np_advantages(rewards[:1, [0, 1, 3]], [True], mode, normalize_std, 1e-6)[0]
    np.testing.assert_allclose(got[0, [0, 1, 3]], others, rtol=1e-5, atol=1e-6)
    assert got[0, 2] == 0.0
    np.testing.assert_allclose(got[1], clean, rtol=1e-5, atol=1e-6)
    # ... which is not today's: the failure no longer drags the baseline
    assert not np.allclose(got[0, [0, 1, 3]], today[0, [0, 1, 3]], rtol=1e-3, atol=1e-3)
    # drop_group: the whole group 0, the clean group untouched
    got = advantages_under("drop_group", rewards, failed, mode, normalize_std)
    assert np.all(got[0] == 0.0)
    np.testing.assert_allclose(got[1], clean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["zero", "drop_sample", "drop_group"])
@pytest.mark.parametrize("mode,normalize_std", MODES)
def test_advantages_under_every_policy_match_oracle(seed, policy, mode, normalize_std):
    rng = np.random.default_rng(seed)
    NG, G = rng.integers(2, 7), rng.integers(2, 9)
    rewards = rng.normal(size=(NG, G)).astype(np.float32)
    if seed % 2:  # binary rewards, including all-equal groups
        rewards = rng.integers(0, 2, size=(NG, G)).astype(np.float32)
    failed = rng.random((NG, G)) < 0.3
    failed[0] = True  # a group whose every member failed
    failed[1] = False
    failed[1, 0] = True  # one with exactly one failure
    rewards[failed] = 0.0  # a failed call scores 0
    got = advantages_under(policy, rewards, failed, mode, normalize_std)
    want = np_policy_advantages(rewards, failed, policy, mode, normalize_std, 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(got))
    if policy != "zero":
        assert np.all(got[failed] == 0.0) and np.all(got[0] == 0.0)


def test_valid_members_by_policy():
    failed = np.array([[False, True, False], [False, False, False], [True, True, True]])
    assert valid_members(failed, "zero").all()
    assert (valid_members(failed, "drop_sample") == ~failed).all()
    assert valid_members(failed, "drop_group").tolist() == [[False] * 3, [True] * 3, [False] * 3]
    with pytest.raises(ValueError, match="on_failure"):
        valid_members(failed, "skip")


def test_group_advantages_reject_bad_shapes():
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(np.zeros((3, 1), np.float32))
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_advantages(np.zeros((6,), np.float32))


# ---------------------------------------------------------------- surrogate, TIS, KL


def np_surrogate(logp, blp, adv, el, eh, cap):
    r = np.exp(logp.astype(np.float64) - blp)
    unclipped = r * adv
    clipped = np.clip(r, 1 - el, 1 + eh) * adv
    loss = -np.minimum(unclipped, clipped)
    # d loss / d logp: the unclipped branch has gradient -r*A; the clipped one 0 (outside range)
    use_unclipped = unclipped <= clipped
    grad = np.where(use_unclipped, -r * adv, np.where((r > 1 - el) & (r < 1 + eh), -r * adv, 0.0))
    if cap is not None:
        factor = np.minimum(1.0, cap / r)
        loss, grad = loss * factor, grad * factor
    low = (adv < 0) & (r < 1 - el)
    high = (adv > 0) & (r > 1 + eh)
    return r, loss, grad, low, high


@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("seed", range(3))
def test_clipped_surrogate_matches_oracle(seed, cap):
    rng = np.random.default_rng(seed)
    shape = (3, 11)
    blp = -rng.random(shape).astype(np.float32) * 4
    logp = (blp + rng.normal(scale=0.6, size=shape)).astype(np.float32)
    adv = rng.normal(size=shape).astype(np.float32)
    el, eh = 0.2, 0.28
    r, loss, grad, low, high = np_surrogate(logp, blp, adv, el, eh, cap)
    out = clipped_surrogate(logp, blp, adv, eps_low=el, eps_high=eh, tis_cap=cap)
    np.testing.assert_allclose(np.asarray(importance_ratio(logp, blp)), r, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out.ratio), r, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out.loss), loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.clipped_low), low)
    np.testing.assert_array_equal(np.asarray(out.clipped_high), high)
    assert low.any() and high.any()  # the inputs exercise both clips
    if cap is not None:
        np.testing.assert_array_equal(np.asarray(out.truncated), r > cap)
        assert (r > cap).any()
    g = jax.grad(
        lambda lp: jnp.sum(
            clipped_surrogate(lp, blp, adv, eps_low=el, eps_high=eh, tis_cap=cap).loss
        )
    )(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g), grad, rtol=1e-5, atol=1e-6)


def test_tis_caps_the_effective_importance_weight():
    # A < 0, r = e^2 ~ 7.4 > cap: the gradient weight is truncated to the cap exactly.
    logp, blp, adv = jnp.array([0.0]), jnp.array([-2.0]), jnp.array([-1.0])
    g = jax.grad(
        lambda lp: clipped_surrogate(lp, blp, adv, eps_low=0.2, eps_high=0.2, tis_cap=2.0).loss[0]
    )(logp)
    np.testing.assert_allclose(np.asarray(g), [2.0], rtol=1e-6)  # d(-w*A*logp) = -cap*A = 2


def test_kl_k3_matches_oracle():
    rng = np.random.default_rng(0)
    logp = -rng.random((4, 9)).astype(np.float32) * 5
    ref = -rng.random((4, 9)).astype(np.float32) * 5
    d = ref.astype(np.float64) - logp
    want = np.exp(d) - d - 1
    got = np.asarray(kl_k3(logp, ref))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(got >= 0)
    np.testing.assert_allclose(np.asarray(kl_k3(logp, logp)), 0.0, atol=0)


# ---------------------------------------------------------------- aggregation


def random_packed_layout(rng, num_samples, rows, T):
    """Samples (uneven lengths, some with no loss token) placed several per row, with gaps."""
    loss_mask = np.zeros((rows, T), bool)
    sample_index = np.full((rows, T), num_samples, np.int32)
    per_sample = {}
    cursor = [0] * rows
    for s in range(num_samples):
        r = s % rows
        L = int(rng.integers(1, 7))
        o = cursor[r]
        assert o + L + 1 <= T
        sample_index[r, o : o + L] = s
        n_resp = int(rng.integers(0, L))  # 0 response tokens is allowed
        loss_mask[r, o + L - 1 - n_resp : o + L - 1] = True
        per_sample[s] = [(r, t) for t in range(o, o + L) if loss_mask[r, t]]
        cursor[r] = o + L + int(rng.integers(0, 2))
    return loss_mask, sample_index, per_sample


def np_aggregate(values, per_sample, mode, norm_len):
    seqs = [np.array([values[r, t] for r, t in toks], np.float64) for toks in per_sample.values()]
    nonempty = [x for x in seqs if len(x)]
    if mode == "token_mean":
        return np.concatenate(nonempty).mean()
    if mode == "seq_mean_token_mean":
        return np.mean([x.mean() for x in nonempty])
    return np.mean([x.sum() / norm_len for x in nonempty])


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("seed", range(3))
def test_aggregation_matches_oracle(mode, seed):
    rng = np.random.default_rng(seed)
    S, rows, T = 9, 3, 32
    loss_mask, sample_index, per_sample = random_packed_layout(rng, S, rows, T)
    values = rng.normal(size=(rows, T)).astype(np.float32)
    values[~loss_mask] = np.inf  # off-mask values must not leak in, not even as NaN
    w = token_weights(jnp.asarray(loss_mask), jnp.asarray(sample_index), S, mode, norm_len=40)
    got = float(aggregate(jnp.asarray(values), w))
    want = np_aggregate(values, per_sample, mode, 40)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_aggregation_splits_exactly_over_row_subsets():
    """Weights of the whole batch summed over any row partition give the full-batch loss."""
    rng = np.random.default_rng(7)
    loss_mask, sample_index, _ = random_packed_layout(rng, 8, 4, 32)
    values = rng.normal(size=(4, 32)).astype(np.float32)
    w = token_weights(
        jnp.asarray(loss_mask), jnp.asarray(sample_index), 8, "seq_mean_token_mean", 1
    )
    full = float(aggregate(jnp.asarray(values), w))
    parts = sum(float(aggregate(jnp.asarray(values[i::2]), w[i::2])) for i in range(2))
    np.testing.assert_allclose(parts, full, rtol=1e-6)


def test_empty_mask_gives_zero_weights_and_mean():
    mask = jnp.zeros((2, 5), bool)
    idx = jnp.full((2, 5), 3, jnp.int32)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        assert float(jnp.abs(token_weights(mask, idx, 3, mode, 8)).sum()) == 0.0
    assert float(masked_mean(jnp.ones((2, 5)), mask)) == 0.0


# ---------------------------------------------------------------- chunked logprobs


def np_log_softmax(z):
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("rows", [False, True], ids=["DV", "rows"])
@pytest.mark.parametrize("V,chunk", [(64, 16), (37, 5), (37, 37), (50, 7), (10, 64)])
def test_chunked_logprobs_and_entropy_match_oracle(V, chunk, rows):
    """``w [D, V]``, or (``rows``) its transpose as a tied embedding is stored."""
    rng = np.random.default_rng(V + chunk)
    B, T, D = 2, 5, 8
    h = rng.normal(size=(B, T, D)).astype(np.float32)
    w = (rng.normal(size=(D, V)) * 2).astype(np.float32)
    targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
    w_in = jnp.asarray(w.T if rows else w)

    def f(x, ww):
        return chunked_logprobs(x, ww, jnp.asarray(targets), chunk=chunk, rows=rows)

    logp, ent = f(jnp.asarray(h), w_in)
    ls = np_log_softmax(h.astype(np.float64) @ w)
    want_lp = np.take_along_axis(ls, targets[..., None], -1)[..., 0]
    want_ent = -(np.exp(ls) * ls).sum(-1)
    np.testing.assert_allclose(np.asarray(logp), want_lp, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=1e-5, atol=2e-5)

    # gradient of sum(logp) w.r.t. h: (onehot - softmax) @ w.T
    onehot = np.eye(V)[targets]
    want_gh = (onehot - np.exp(ls)) @ w.T.astype(np.float64)
    gh, gw = jax.grad(lambda x, ww: jnp.sum(f(x, ww)[0]), argnums=(0, 1))(jnp.asarray(h), w_in)
    np.testing.assert_allclose(np.asarray(gh), want_gh, rtol=1e-4, atol=1e-5)
    # and w.r.t. the unembedding: h^T (onehot - softmax), in the layout it was given
    want_gw = np.einsum("btd,btv->dv", h.astype(np.float64), onehot - np.exp(ls))
    np.testing.assert_allclose(np.asarray(gw), want_gw.T if rows else want_gw, rtol=1e-4, atol=1e-5)


def test_chunk_layout():
    assert chunk_layout(64, 16) == (4, 16)
    assert chunk_layout(37, 5) == (8, 5)
    assert chunk_layout(10, 64) == (1, 10)
    C, c = chunk_layout(151936, 4096)
    assert C * c >= 151936 and c <= 4096


def _all_avals(jaxpr):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield v.aval
        for p in eqn.params.values():
            subs = p if isinstance(p, (list, tuple)) else [p]
            for sub in subs:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_avals(inner)


def test_no_full_vocab_tensor_in_forward_or_backward():
    B, T, D, V, chunk = 4, 16, 8, 256, 32
    h = jnp.ones((B, T, D))
    w = jnp.ones((D, V))
    tg = jnp.zeros((B, T), jnp.int32)

    def f(h, w):
        lp, ent = chunked_logprobs(h, w, tg, chunk=chunk)
        return jnp.sum(lp) + jnp.sum(ent)

    jaxpr = jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1)))(h, w).jaxpr
    sizes = [int(np.prod(a.shape)) for a in _all_avals(jaxpr) if hasattr(a, "shape")]
    assert max(sizes) < B * T * V // 2, max(sizes)
    assert B * T * chunk in sizes  # the per-chunk logits are there


# ---------------------------------------------------------------- schedule


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
@pytest.mark.parametrize("boost", [(), (6.0, 5.0, 10.0)])
def test_lr_schedule_matches_oracle(schedule, boost):
    cfg = TrainConfig(lr=1e-3, warmup_steps=4, schedule=schedule, total_steps=20, lr_boost=boost)
    f = lr_schedule(cfg)
    for n in range(0, 25):
        warm = min(1.0, (n + 1) / 4) * (10.0 if boost and 6 <= n < 11 else 1.0)
        if schedule == "constant":
            want = 1e-3 * warm
        else:
            p = min(max((n - 4) / 16, 0.0), 1.0)
            want = 1e-3 * warm * 0.5 * (1 + np.cos(np.pi * p))
        np.testing.assert_allclose(float(f(n)), want, rtol=1e-5, atol=1e-12)
