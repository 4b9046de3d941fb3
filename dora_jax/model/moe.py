"""Mixture-of-experts MLP block (Qwen3-MoE and Qwen2-MoE) as pure functions.

Axis letters: B batch, T positions, D model, E experts, k experts per token, f one expert's ffn
width, S the shared expert's ffn width, M = B * T * k token-expert pairs.

Routing, per token: router logits ``x @ router`` in float32, a softmax over all ``E`` experts,
the ``k`` most probable experts; their probabilities are the combine weights, renormalised to sum
to 1 when ``cfg.resolved_norm_topk_prob`` (Qwen3-MoE checkpoints: yes; Qwen2-MoE: no). Each chosen
expert is a SwiGLU MLP; the block's output is the weighted sum. Qwen2-MoE adds a shared expert
(a SwiGLU of width ``S``) scaled by ``sigmoid(x @ shared_expert_gate)``.

Experts are applied as a grouped matmul: the ``M`` token-expert pairs are sorted by expert and
multiplied with ``jax.lax.ragged_dot`` (one contiguous group of rows per expert) on GPUs and
TPUs; on CPUs, where XLA lowers ``ragged_dot`` densely (every group times every row), each group
is padded to whole blocks and a scan applies one expert per block. Both are *dropless*: every
token reaches every expert it was routed to, whatever the load, so there is no capacity factor
and no token is ever dropped, in training or in rollout, and the cached decode path computes
exactly what the full forward pass computes. The price: the sort and the data-dependent group
sizes. Padding positions are routed like any token (their outputs are discarded by the
callers).

Routing replay: ``moe_mlp`` returns the experts it used (``chosen``, in the router's order:
descending probability) and accepts ``routes`` of the same shape to force them. A token whose
``routes`` row holds any ``-1`` uses the router's own choice. Forced or not, the combine weights
are the router's softmax probabilities at the used experts, normalised by the family's rule, so
replaying a token's own routes reproduces its output bit for bit and the router still receives
gradients through the weights.

Sharding: expert weights carry the logical axis ``experts`` (the mesh axis ``expert``) and their
ffn dimension ``mlp`` (tensor parallel over ``model``); the partitioning of the dispatch is left to
XLA's SPMD partitioner.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dora_jax.config import ModelConfig
from dora_jax.sharding import constrain


def route(
    router: jax.Array, x: jax.Array, cfg: ModelConfig, routes: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``(chosen int32[..., k], weights float32[..., k])`` for tokens ``x [..., D]``.

    ``routes`` (int32[..., k]) forces the experts of every token whose row has no ``-1``."""
    logits = jnp.einsum(
        "...D,DE->...E", x, router.astype(x.dtype), preferred_element_type=jnp.float32
    )
    probs = jax.nn.softmax(logits, axis=-1)
    _, chosen = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    chosen = chosen.astype(jnp.int32)
    if routes is not None:
        forced = jnp.all(routes >= 0, axis=-1, keepdims=True)
        chosen = jnp.where(forced, routes.astype(jnp.int32), chosen)
    weights = jnp.take_along_axis(probs, chosen, axis=-1)
    if cfg.resolved_norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return chosen, weights


def grouped_experts(
    lp: dict[str, jax.Array],
    x: jax.Array,
    chosen: jax.Array,
    weights: jax.Array,
    num_experts: int,
    impl: str | None = None,
) -> jax.Array:
    """``sum_j weights[n, j] * expert[chosen[n, j]](x[n])`` for ``x [N, D]``, ``chosen [N, k]``:
    the ``M = N k`` pairs sorted by expert, the experts applied group by group (dropless),
    unsorted, combined. ``impl`` (default :func:`default_impl`): ``"ragged"``, three
    ``jax.lax.ragged_dot`` s over the sorted rows; ``"blocked"``, each expert's rows padded to
    whole blocks and a scan over the blocks (:func:`_blocked_swiglu`); ``"loop"``, the dense
    reference the benchmarks compare with (:func:`_per_expert_loop`: no sort)."""
    if impl == "loop":
        return _per_expert_loop(lp, x, chosen, weights, num_experts)
    N, k = chosen.shape
    flat = chosen.reshape(-1)  # [M]
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)  # [M, D], grouped by expert
    if (impl or default_impl()) == "ragged":
        gate = jax.lax.ragged_dot(xs, lp["moe_gate"], sizes)
        up = jax.lax.ragged_dot(xs, lp["moe_up"], sizes)
        ys = jax.lax.ragged_dot(jax.nn.silu(gate) * up, lp["moe_down"], sizes)  # [M, D]
    else:
        ys = _blocked_swiglu(lp, xs, sizes, num_experts)
    unsorted = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
    ys = unsorted.reshape(N, k, -1)
    return jnp.einsum("NkD,Nk->ND", ys, weights.astype(ys.dtype))


def default_impl() -> str:
    """``"ragged"`` on GPUs and TPUs (JAX lowers ``ragged_dot`` to XLA's ragged-dot instruction
    there); ``"blocked"`` on CPUs, where ``ragged_dot`` is lowered to a dense product with every
    group, masked (``E`` times the FLOPs and an ``[E, M, ...]`` temporary: see
    benchmarks/bench_moe.py)."""
    return "blocked" if jax.default_backend() == "cpu" else "ragged"


def block_rows(M: int, E: int) -> int:
    """Rows per block of the blocked path: about the mean group size ``M / E`` (a power of two
    in [8, 128]), so the padding (< one block per expert) stays near ``M`` rows."""
    b = 8
    while b < 128 and 2 * b <= M // max(E, 1):
        b *= 2
    return b


def _blocked_swiglu(lp: dict[str, jax.Array], xs: jax.Array, sizes: jax.Array, E: int) -> jax.Array:
    """The experts' SwiGLU on rows ``xs [M, D]`` sorted by expert (group sizes ``sizes [E]``):
    every group is padded to whole blocks of ``b`` rows, each block is one expert's, and a scan
    over the (at most ``ceil(M / b) + E``) blocks applies its expert. Dropless and exact; the
    FLOPs are those of ``M + E b`` rows."""
    M, D = xs.shape
    b = block_rows(M, E)
    nb = -(-M // b) + E  # static bound on the blocks
    padded = -(-sizes // b) * b
    starts = jnp.cumsum(sizes) - sizes  # group offsets in xs
    pstarts = jnp.cumsum(padded) - padded  # group offsets in the padded rows
    expert = jnp.repeat(jnp.arange(E, dtype=jnp.int32), sizes, total_repeat_length=M)
    dest = pstarts[expert] + jnp.arange(M, dtype=jnp.int32) - starts[expert]  # [M]
    rows = jnp.zeros((nb * b, D), xs.dtype).at[dest].set(xs, unique_indices=True)
    # the expert of each block (blocks past the last group: any expert; their rows are zero)
    block_expert = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(nb) * b, side="right")
    block_expert = jnp.minimum(block_expert, E - 1).astype(jnp.int32)

    def one(_, blk):
        xb, e = blk
        gate = xb @ lp["moe_gate"][e]
        up = xb @ lp["moe_up"][e]
        return None, (jax.nn.silu(gate) * up) @ lp["moe_down"][e]

    _, ys = jax.lax.scan(one, None, (rows.reshape(nb, b, D), block_expert))
    return ys.reshape(nb * b, D)[dest]


def _per_expert_loop(
    lp: dict[str, jax.Array], x: jax.Array, chosen: jax.Array, weights: jax.Array, E: int
) -> jax.Array:
    """Every expert on every token of ``x [N, D]``, one expert per scan step, each token's output
    weighted by its combine weight (0 where the expert was not chosen): the grouped block's
    result with ``E / k`` times its expert FLOPs and one expert's ``[N, f]`` temporaries at a
    time."""

    def one(y, e_w):
        e, wg, wu, wd = e_w
        w = jnp.sum(jnp.where(chosen == e, weights, 0.0), axis=-1).astype(x.dtype)  # [N]
        h = jax.nn.silu(x @ wg) * (x @ wu)
        return y + w[:, None] * (h @ wd), None

    experts = jnp.arange(E, dtype=jnp.int32)
    xs = (experts, lp["moe_gate"], lp["moe_up"], lp["moe_down"])
    return jax.lax.scan(one, jnp.zeros_like(x), xs)[0]


def shared_expert(lp: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """Qwen2-MoE's always-on expert, scaled by its sigmoid gate."""
    gate = jnp.einsum("...D,DS->...S", x, lp["shared_gate"])
    up = jnp.einsum("...D,DS->...S", x, lp["shared_up"])
    h = jnp.einsum("...S,SD->...D", jax.nn.silu(gate) * up, lp["shared_down"])
    scale = jax.nn.sigmoid(jnp.einsum("...D,D->...", x, lp["shared_expert_gate"]))
    return scale[..., None] * h


def moe_mlp(
    lp: dict[str, Any], x: jax.Array, cfg: ModelConfig, routes: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The MoE block on normed ``x [B, T, D]``: ``(y [B, T, D], chosen int32[B, T, k])``.

    ``routes`` (int32[B, T, k] or None) forces each token's experts (a row with a ``-1``: the
    router's choice); ``chosen`` is the experts actually used, in the router's order."""
    B, T, D = x.shape
    chosen, weights = route(lp["router"], x, cfg, routes)
    y = grouped_experts(
        lp,
        x.reshape(B * T, D),
        chosen.reshape(B * T, -1),
        weights.reshape(B * T, -1),
        cfg.num_experts,
    ).reshape(B, T, D)
    if "shared_gate" in lp:
        y = y + shared_expert(lp, x)
    return constrain(y.astype(x.dtype), ("batch", "seq", "embed")), chosen
