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

A per-sample ``valid`` mask leaves members out of their group: a member that is not valid is not
part of the baseline (mean and std are over the group's valid members only, the leave-one-out
mean over the other valid ones) and gets advantage 0. :func:`valid_members` turns the trajectories
whose reward or environment call failed into that mask by ``data.on_failure``: ``zero`` keeps them
(their reward 0 in the baseline, today's GRPO), ``drop_sample`` leaves the failed members out,
``drop_group`` every member of a group with a failed one. A group with fewer than two valid
members has no baseline and gets advantage 0 throughout.

Standard deviation: the *population* std (``ddof=0``, divide by ``G``) of the group's rewards,
so that normalised advantages of a group have unit root-mean-square (up to ``eps``). A group
whose rewards are all equal gets (numerically) zero advantage in every mode, never a NaN: ``eps``
keeps the divisor positive.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

AdvantageMode = Literal["grpo", "rloo"]
OnFailure = Literal["zero", "drop_sample", "drop_group"]
ON_FAILURE: tuple[str, ...] = ("zero", "drop_sample", "drop_group")


def valid_members(failed, on_failure: OnFailure) -> np.ndarray:
    """``bool[NG, G]``: the members that stay in their group's baseline and gradient, from
    ``failed`` (``bool[NG, G]``: the member's reward or environment call failed) and the policy
    ``data.on_failure``: ``zero`` keeps every member, ``drop_sample`` drops the failed ones,
    ``drop_group`` drops every member of a group that has a failed one."""
    failed = np.asarray(failed, bool)
    if failed.ndim != 2:
        raise ValueError(f"failed must be [num_groups, group_size], got shape {failed.shape}")
    if on_failure == "zero":
        return np.ones_like(failed)
    if on_failure == "drop_sample":
        return ~failed
    if on_failure == "drop_group":
        return np.repeat(~failed.any(axis=1, keepdims=True), failed.shape[1], axis=1)
    raise ValueError(f"unknown on_failure {on_failure!r} (expected one of {ON_FAILURE})")


def group_advantages(
    rewards: jax.Array,
    group_mask: jax.Array | None = None,
    *,
    valid: jax.Array | None = None,
    mode: AdvantageMode = "grpo",
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> jax.Array:
    """Advantages ``float32[NG, G]`` from rewards ``[NG, G]``.

    - ``grpo``: ``(r - mean_g) / (std_g + eps)`` with the population std; with
      ``normalize_std=False`` just ``r - mean_g`` (Dr. GRPO: no division by the std, which
      otherwise up-weights near-unanimous groups).
    - ``rloo``: leave-one-out baseline ``r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g)``
      (REINFORCE leave-one-out; ``n`` the group's valid members). ``normalize_std`` does not
      apply to it.

    ``group_mask`` (``bool[NG]``, default all true) zeroes padding groups. ``valid``
    (``bool[NG, G]``, default all true) leaves members out: ``mean_g``, ``std_g`` and the
    leave-one-out mean are over the group's valid members only, and a member that is not valid
    gets advantage 0 (so does every member of a group with fewer than two valid ones).
    """
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {r.shape}")
    G = r.shape[1]
    if G < 2:
        raise ValueError(f"group-relative advantages need group_size >= 2, got {G}")
    if mode not in ("grpo", "rloo"):
        raise ValueError(f"unknown advantage mode {mode!r} (expected 'grpo' or 'rloo')")
    keep = jnp.ones(r.shape, bool) if valid is None else jnp.asarray(valid, bool)
    if keep.shape != r.shape:
        raise ValueError(f"valid must have the rewards' shape {r.shape}, got {keep.shape}")
    if group_mask is not None:
        keep = keep & jnp.asarray(group_mask, bool)[:, None]
    n = jnp.sum(keep.astype(jnp.float32), axis=1, keepdims=True)
    mean = jnp.sum(jnp.where(keep, r, 0.0), axis=1, keepdims=True) / jnp.maximum(n, 1.0)
    centered = jnp.where(keep, r - mean, 0.0)
    if mode == "grpo":
        adv = centered
        if normalize_std:
            std = jnp.sqrt(
                jnp.sum(centered * centered, axis=1, keepdims=True) / jnp.maximum(n, 1.0)
            )
            adv = centered / (std + eps)
    else:
        adv = centered * (n / jnp.maximum(n - 1.0, 1.0))
    # one valid member: no baseline, no signal (its centered reward is 0 already)
    return jnp.where(keep & (n >= 2), adv, 0.0)
