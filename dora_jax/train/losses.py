"""The GRPO policy loss as small pure array functions: ratio, clipped surrogate, KL, aggregation.

All per-token arrays are aligned with the position that *predicts* a response token
(``[B, T]``, see :mod:`dora_jax.train.batch`); ``loss_mask`` is true exactly there.

The importance ratio of a token is ``r = pi_theta / pi_behavior`` where ``pi_behavior`` is the
log-probability recorded by the rollout engine, under the policy version that generated the
whole trajectory (DORA generates every trajectory under one version, so this is a well-defined
single-policy ratio; no cross-version correction is needed).

Aggregation is expressed as per-token weights (:func:`token_weights`) computed once for the whole
batch, so the loss is ``sum(per_token_loss * weights)``. Summing that over microbatches gives the
full-batch loss exactly, which keeps gradient accumulation exact in every mode.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def importance_ratio(logp: jax.Array, behavior_logp: jax.Array) -> jax.Array:
    """``exp(logp - behavior_logp)``: the per-token ratio ``pi_theta / pi_behavior``."""
    return jnp.exp(logp - behavior_logp)


class Surrogate(NamedTuple):
    """Per-token results of :func:`clipped_surrogate` (all ``[B, T]``)."""

    loss: jax.Array  # float32: the per-token policy loss (to be minimised)
    ratio: jax.Array  # float32: pi_theta / pi_behavior
    clipped_low: jax.Array  # bool: A < 0 and r < 1 - eps_low (the clip zeroes the gradient)
    clipped_high: jax.Array  # bool: A > 0 and r > 1 + eps_high (the clip zeroes the gradient)
    truncated: jax.Array  # bool: r > tis_cap (the importance weight was truncated)


def clipped_surrogate(
    logp: jax.Array,
    behavior_logp: jax.Array,
    advantages: jax.Array,
    *,
    eps_low: float,
    eps_high: float,
    tis_cap: float | None = None,
) -> Surrogate:
    """Token-level PPO clipped surrogate with an asymmetric clip range (DAPO's clip-higher).

    ``loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``.

    ``tis_cap`` (``C >= 1``, optional) truncates the importance weight: the gradient of the
    unclipped branch is ``r * A * grad log pi``; with the cap it becomes ``min(r, C) * A * grad
    log pi`` (truncated importance sampling). It is implemented as the stop-gradient factor
    ``min(1, C / r)`` on the per-token loss, so tokens with ``r <= C`` are untouched and the value
    and gradient of a token the engine sampled with a much lower probability than the trainer now
    assigns (numeric mismatch between engine and trainer, or staleness) stay bounded. Only the
    ``A < 0`` side is affected in practice: for ``A > 0`` the clip already binds at
    ``1 + eps_high``.

    The clip fractions count tokens whose clip is *active* (the branch that zeroes the gradient is
    selected): ``clipped_low`` for ``A < 0, r < 1 - eps_low`` and ``clipped_high`` for
    ``A > 0, r > 1 + eps_high``.
    """
    r = importance_ratio(logp, behavior_logp)
    unclipped = r * advantages
    clipped = jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -jnp.minimum(unclipped, clipped)
    if tis_cap is not None:
        loss = loss * jax.lax.stop_gradient(jnp.minimum(1.0, tis_cap / r))
        truncated = r > tis_cap
    else:
        truncated = jnp.zeros(r.shape, bool)
    return Surrogate(
        loss=loss,
        ratio=r,
        clipped_low=(advantages < 0) & (r < 1.0 - eps_low),
        clipped_high=(advantages > 0) & (r > 1.0 + eps_high),
        truncated=truncated,
    )


def kl_k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Per-token k3 estimator of ``KL(pi || pi_ref)`` on tokens sampled from (about) ``pi``:
    ``exp(ref - logp) - (ref - logp) - 1`` (non-negative, unbiased, low variance; Schulman)."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1.0


def token_weights(
    loss_mask: jax.Array,
    sample_index: jax.Array,
    num_samples: int,
    mode: LossAgg,
    norm_len: int,
) -> jax.Array:
    """``float32[B, T]`` weights with ``loss = sum(per_token_loss * weights)``.

    ``sample_index [B, T]`` names the sample (``0..num_samples-1``) each token belongs to;
    ``num_samples`` marks tokens of no sample. Let ``m`` be the loss mask, ``n_s`` the number of
    loss tokens of sample ``s`` and ``S+`` the number of samples with ``n_s > 0`` (samples with
    no loss token, e.g. an empty response or batch padding, are not counted):

    - ``token_mean``: ``m / sum(m)``: every response token of the batch weighs the same.
    - ``seq_mean_token_mean``: ``m / (n_s * S+)``: mean over tokens within a sequence, then mean
      over sequences (the original GRPO; long responses get less weight per token).
    - ``seq_mean_token_sum_norm``: ``m / (norm_len * S+)``: token sum of each sequence divided by
      the constant ``norm_len`` (Dr. GRPO; the caller passes ``TrainConfig.resolved_loss_norm_len``,
      the largest length bucket unless set), then mean over sequences.

    An empty batch (no loss token) gets all-zero weights.
    """
    m = loss_mask.astype(jnp.float32)
    if mode == "token_mean":
        return m / jnp.maximum(jnp.sum(m), 1.0)
    counts = jnp.zeros((num_samples + 1,), jnp.float32).at[sample_index].add(m)
    n_seq = jnp.maximum(jnp.sum(counts[:num_samples] > 0), 1).astype(jnp.float32)
    if mode == "seq_mean_token_mean":
        return m / (jnp.maximum(counts[sample_index], 1.0) * n_seq)
    if mode == "seq_mean_token_sum_norm":
        return m / (float(norm_len) * n_seq)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def aggregate(values: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum(values * weights)`` in float32 (weights from :func:`token_weights`); tokens of
    weight 0 contribute exactly 0 even if their value is not finite."""
    return jnp.sum(jnp.where(weights != 0, values.astype(jnp.float32) * weights, 0.0))


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``values`` where ``mask``; 0 when the mask is empty."""
    m = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(jnp.sum(m), 1.0)
