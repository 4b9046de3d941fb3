"""Group-relative advantages: one scalar per sampled response, from the rewards of its prompt group.

A *prompt group* holds the ``G`` responses sampled from one prompt. In DORA all ``G`` members of a
prompt group are dispatched with one policy version and every token of each member is generated
under that version, so the group mean is a baseline of that single behavior version: the
*per-version* (version-specific) baseline ``mu_k`` that appendix F of the DORA paper argues for
(it keeps version-level reward information, unlike a baseline averaged over the versions mixed in
a batch). Nothing here needs the version: the grouping already is per version.

Rewards come as a dense ``[NG, G]`` array (``NG`` prompt groups, group-major) with a per-group
mask; masked groups (padding of a fixed-shape batch) get advantage 0. Groups are always complete:
the batch packer rejects a group with a missing member.

Standard deviation: the *population* std (``ddof=0``, divide by ``G``) of the group's rewards,
so that normalised advantages of a group have unit root-mean-square (up to ``eps``). A group
whose rewards are all equal gets (numerically) zero advantage in every mode, never a NaN: ``eps``
keeps the divisor positive.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

AdvantageMode = Literal["grpo", "rloo"]


def group_advantages(
    rewards: jax.Array,
    group_mask: jax.Array | None = None,
    *,
    mode: AdvantageMode = "grpo",
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> jax.Array:
    """Advantages ``float32[NG, G]`` from rewards ``[NG, G]``.

    - ``grpo``: ``(r - mean_g) / (std_g + eps)`` with the population std; with
      ``normalize_std=False`` just ``r - mean_g`` (Dr. GRPO: no division by the std, which
      otherwise up-weights near-unanimous groups).
    - ``rloo``: leave-one-out baseline ``r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_g)``
      (REINFORCE leave-one-out). ``normalize_std`` does not apply to it.

    ``group_mask`` (``bool[NG]``, default all true) zeroes padding groups.
    """
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {r.shape}")
    G = r.shape[1]
    if G < 2:
        raise ValueError(f"group-relative advantages need group_size >= 2, got {G}")
    centered = r - jnp.mean(r, axis=1, keepdims=True)
    if mode == "grpo":
        adv = centered
        if normalize_std:
            std = jnp.sqrt(jnp.mean(centered * centered, axis=1, keepdims=True))
            adv = centered / (std + eps)
    elif mode == "rloo":
        adv = centered * (G / (G - 1))
    else:
        raise ValueError(f"unknown advantage mode {mode!r} (expected 'grpo' or 'rloo')")
    if group_mask is not None:
        adv = jnp.where(jnp.asarray(group_mask, bool)[:, None], adv, 0.0)
    return adv
