"""Token sampling with the behavior log-probability the trainer will score.

**Which log-probability.** ``logprob`` is the log-probability of the sampled token under
``softmax(logits / temperature)`` over the *full* vocabulary (temperature 1 when greedy). Top-k and
top-p only restrict which tokens may be drawn; they do not renormalise the recorded logprob. The
trainer scores ``log_softmax(logits / temperature)`` of the same token with the same temperature,
so at staleness 0 and identical numerics the importance ratio is exactly 1.

**Keys.** Each request carries its own key; the key for the token at sequence position ``p`` is
``fold_in(request_key, p)``. A token's randomness therefore depends only on the request and the
position, not on batch composition, slot, engine or migration: a migrated request samples
exactly what it would have sampled in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _restrict(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Mask (to -inf) the tokens outside top-k and the top-p nucleus; ``logits [B, V]``."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
        keep_sorted = before < top_p  # always keeps the most likely token
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def sample(
    logits: jax.Array, keys: jax.Array, positions: jax.Array, params: SamplingParams
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row.

    Args:
      logits: float32 ``[B, V]``.
      keys: typed PRNG keys ``[B]``, one per request.
      positions: int32 ``[B]``, the sequence position of the token being sampled.

    Returns:
      ``(tokens int32[B], logprobs float32[B])`` (see the module docstring for the logprob).
    """
    logits = logits.astype(jnp.float32)
    temp = params.temperature if not params.greedy else 1.0
    scaled = logits / temp
    logp = jax.nn.log_softmax(scaled, axis=-1)
    if params.greedy:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        step_keys = jax.vmap(jax.random.fold_in)(keys, positions)
        restricted = _restrict(scaled, params.top_k, params.top_p)
        tokens = jax.vmap(jax.random.categorical)(step_keys, restricted)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
