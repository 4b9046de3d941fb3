"""The GRPO train step (a pure module-level function), its shardings and its lowering from
abstract values; :class:`~dora_jax.train.trainer.Trainer` owns and runs it.

``train_step(state, batch) -> (state, metrics)`` does, all inside one jit:

1. group-relative advantages from the batch's rewards (``[NG, G]`` by reshape, on device), over
   the samples ``valid`` keeps (:func:`batch_advantages`);
2. per-token aggregation weights for the *whole* batch (:func:`losses.token_weights`), zero on the
   tokens of samples that are not ``valid`` (a failed call dropped by ``data.on_failure``: no
   gradient from them, policy or KL, and they are not counted in the aggregation's denominators);
3. a ``lax.scan`` (a plain call when ``M = 1``) over ``microbatches`` strided row slices (row
   ``i`` goes to microbatch ``i % M``, so each microbatch stays spread over the ``data`` axis),
   each computing chunked
   log-probabilities, the clipped surrogate, the optional KL penalty and ``value_and_grad``,
   accumulating float32 gradients and metric sums; the weights make the accumulated loss equal
   the full-batch loss exactly;
4. global-norm clipping + AdamW; if the loss or the gradient norm is not finite, the update is
   skipped with ``lax.cond`` (params, optimizer state and version unchanged) and ``skipped``
   is incremented.

All metrics are computed from the logprobs of the params *before* the update. ``mismatch_kl``
restricts the behavior KL to staleness-0 samples: the trainer and the engine then ran the same
version, so it measures their numeric mismatch alone. The off-policy drift by lag (staleness
``k``, ``0 .. staleness_bins - 1``, the last bin also counting larger lags), over the response
tokens of the samples of that lag: ``lag_tokens``; ``lag_ess``, the normalised effective sample
size of the token importance weights ``w = pi_theta / pi_behavior``, ``(sum w)^2 / (n sum
w^2)`` (1 when every weight is equal; lag 0's distance from 1 is what engine/trainer numerics
alone cause, the floor for the others); ``lag_clip_frac`` (tokens outside the clip range, either
side) and ``lag_kl`` (the behavior KL, ``approx_kl``'s estimator). A lag with no tokens reads 0.

Mixture-of-experts batches carry the engine's routes: with ``train.routing_replay`` the forward uses
them. ``routing_diff_share`` is the share of tokens with recorded routes that the forward sent to
another set of experts (in any layer) than the engine did: the router's disagreement without replay
(numerics, and the policy's change for stale samples), 0 with it (the forward reports the experts it
used).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.config import ModelConfig, TrainConfig, TrainerMeshConfig
from dora_jax.model.params import Params, abstract_params
from dora_jax.sharding import Rules, constrain, spec_for, trainer_rules, use_rules
from dora_jax.train.advantages import group_advantages
from dora_jax.train.batch import TrainBatch, chunk_rows
from dora_jax.train.logprobs import token_logprobs
from dora_jax.train.losses import aggregate, clipped_surrogate, kl_k3, token_weights
from dora_jax.train.state import (
    TrainState,
    init_state,
    lr_schedule,
    make_optimizer,
    model_params,
    state_shardings,
    uses_master,
)

Metrics = dict[str, jax.Array]
TOKEN_FIELDS = ("tokens", "positions", "segment_ids", "targets", "loss_mask", "behavior")
SUM_KEYS = (
    "pg_loss",
    "kl_ref",
    "tokens",
    "clip_low",
    "clip_high",
    "truncated",
    "ratio",
    "kl_behavior",
    "entropy",
    "mismatch_kl",
    "mismatch_tokens",
    "routed_tokens",
    "routing_diff",
)
LAG_SUM_KEYS = ("lag_tokens", "lag_w", "lag_w2", "lag_clip", "lag_kl")  # float32[staleness_bins]
MAX_WEIGHT = math.exp(30.0)  # w is capped here for the ESS sums (w^2 stays finite)


def _split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """``[B, ...] -> [M, B / M, ...]``, row ``i`` into microbatch ``i % M``."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _microbatch_loss(
    params: Params, ref_params: Params | None, mb: dict[str, jax.Array], state: TrainState
) -> tuple[jax.Array, dict[str, jax.Array]]:
    mcfg, tcfg = state.model_cfg, state.train_cfg
    toks = {k: constrain(mb[k], ("batch", "seq")) for k in TOKEN_FIELDS}

    recorded = mb.get("routes")
    if recorded is not None:
        recorded = constrain(recorded, ("batch", "seq", None, None))
    replay = recorded if recorded is not None and tcfg.routing_replay else None

    def logprobs_of(p: Params, routes=None, return_routes=False) -> tuple[jax.Array, ...]:
        return token_logprobs(
            p,
            toks["tokens"],
            toks["positions"],
            toks["segment_ids"],
            toks["targets"],
            mcfg,
            chunk=tcfg.logprob_chunk,
            routes=routes,
            return_routes=return_routes,
        )

    if recorded is None:
        logp, ent = logprobs_of(params)
        routed, routing_diff = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    else:
        logp, ent, used = logprobs_of(params, routes=replay, return_routes=True)
        routed, routing_diff = _routing_difference(used, recorded)
    mask, w = toks["loss_mask"], mb["weights"]
    sur = clipped_surrogate(
        logp,
        toks["behavior"],
        mb["advantages"],
        eps_low=tcfg.clip_eps_low,
        eps_high=tcfg.clip_eps_high,
        tis_cap=tcfg.tis_cap,
    )
    pg_loss = aggregate(sur.loss, w)
    loss = pg_loss
    kl_ref = jnp.zeros_like(logp)
    if tcfg.kl_beta > 0:
        ref_logp, _ = logprobs_of(jax.lax.stop_gradient(ref_params), routes=replay)
        kl_ref = kl_k3(logp, jax.lax.stop_gradient(ref_logp))
        loss = loss + tcfg.kl_beta * aggregate(kl_ref, w)
    lp = jax.lax.stop_gradient(logp)
    kl_behavior = kl_k3(toks["behavior"], lp)  # KL(behavior || theta) on behavior samples

    def msum(x: jax.Array, where: jax.Array = mask) -> jax.Array:
        return jnp.sum(jnp.where(where, x, 0.0).astype(jnp.float32))

    sums = {
        "pg_loss": jax.lax.stop_gradient(pg_loss),
        "kl_ref": jax.lax.stop_gradient(aggregate(kl_ref, w)),
        "tokens": msum(1.0),
        "clip_low": msum(sur.clipped_low.astype(jnp.float32)),
        "clip_high": msum(sur.clipped_high.astype(jnp.float32)),
        "truncated": msum(sur.truncated.astype(jnp.float32)),
        "ratio": msum(jax.lax.stop_gradient(sur.ratio)),
        "kl_behavior": msum(kl_behavior),
        "entropy": msum(jax.lax.stop_gradient(ent)),
        "mismatch_kl": msum(kl_behavior, mb["stale0"]),
        "mismatch_tokens": msum(1.0, mb["stale0"]),
        "routed_tokens": routed,
        "routing_diff": routing_diff,
    }
    bins = tcfg.staleness_bins
    w = jnp.minimum(jax.lax.stop_gradient(sur.ratio), MAX_WEIGHT)  # the surrogate's own ratio
    clipped = (sur.clipped_low | sur.clipped_high).astype(jnp.float32)

    def lag_sum(x: jax.Array) -> jax.Array:
        x = jnp.broadcast_to(jnp.where(mask, x, 0.0).astype(jnp.float32), mask.shape)
        return jax.ops.segment_sum(x.ravel(), mb["lag"].ravel(), num_segments=bins)

    for key, x in zip(LAG_SUM_KEYS, (1.0, w, w * w, clipped, kl_behavior), strict=True):
        sums[key] = lag_sum(x)
    return loss, sums


def _routing_difference(used: jax.Array, recorded: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(tokens with recorded routes, those the forward routed to another set of experts in
    some layer)``, comparing the experts ``used [B, T, L, k]`` with the engine's ``recorded``
    (-1: none recorded) as sets."""
    have = recorded[..., 0, 0] >= 0  # [B, T]
    same = jnp.all(
        jnp.sort(used.astype(jnp.int32), axis=-1) == jnp.sort(recorded.astype(jnp.int32), axis=-1),
        axis=(-2, -1),
    )
    routed = jnp.sum(have.astype(jnp.float32))
    return routed, jnp.sum((have & ~same).astype(jnp.float32))


def train_step(state: TrainState, batch: TrainBatch) -> tuple[TrainState, Metrics]:
    """One GRPO optimizer step on ``batch``; see the module docstring."""
    return train_step_with_grads(state, batch)[:2]


def train_step_with_grads(
    state: TrainState, batch: TrainBatch
) -> tuple[TrainState, Metrics, Params]:
    """:func:`train_step` that also returns the accumulated float32 gradients of the loss (before
    clipping), for gradient checks in tests. Under ``jit``, :func:`train_step` is this function
    with the gradients dropped, so both compute the same update."""
    tcfg = state.train_cfg
    S, G, M = batch.rewards.shape[0], tcfg.group_size, tcfg.microbatches
    B = batch.tokens.shape[0]
    if S % G:
        raise ValueError(f"{S} samples are not whole groups of group_size={G}")
    if B % M:
        raise ValueError(f"{B} batch rows do not split into microbatches={M}")
    adv = batch_advantages(batch, tcfg)
    idx = batch.sample_index
    adv_tok = jnp.concatenate([adv, jnp.zeros((1,), jnp.float32)])[idx]
    fresh = jnp.concatenate([(batch.staleness == 0) & batch.sample_mask, jnp.zeros((1,), bool)])
    lags = jnp.clip(jnp.asarray(batch.staleness, jnp.int32), 0, tcfg.staleness_bins - 1)
    mask = batch.loss_mask.astype(bool)
    counts = jnp.concatenate([_valid(batch), jnp.zeros((1,), bool)])[idx] & mask
    per_token = {
        "tokens": batch.tokens,
        "positions": batch.positions,
        "segment_ids": batch.segment_ids,
        "targets": batch.targets,
        "loss_mask": mask,
        "behavior": batch.behavior_logprobs.astype(jnp.float32),
        "advantages": adv_tok,
        "weights": token_weights(counts, idx, S, tcfg.loss_agg, tcfg.resolved_loss_norm_len),
        "stale0": fresh[idx] & mask,
        "lag": jnp.concatenate([lags, jnp.zeros((1,), jnp.int32)])[idx],
    }
    if batch.routes is not None:
        per_token["routes"] = batch.routes
    if batch.chunk_mask is not None:  # train.microbatch_tokens: loop over the used ones only
        M = batch.chunk_mask.shape[0]
    mbs = {k: _split_microbatches(v, M) for k, v in per_token.items()}

    grad_fn = jax.value_and_grad(_microbatch_loss, has_aux=True)
    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    # The model-dtype params, cast from the master copy once for all microbatches: the gradient
    # w.r.t. them is the one w.r.t. the master copy (a cast's transpose is a cast), so only the
    # float32 accumulator is master-sized.
    params = model_params(state) if uses_master(state.model_cfg, tcfg) else state.params
    zero_sums = {k: jnp.zeros((), jnp.float32) for k in SUM_KEYS} | {
        k: jnp.zeros((tcfg.staleness_bins,), jnp.float32) for k in LAG_SUM_KEYS
    }

    def body(carry, mb):
        g_acc, loss_acc, sums_acc = carry
        (loss, sums), g = grad_fn(params, state.ref_params, mb, state)
        g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
        sums_acc = jax.tree.map(jnp.add, sums_acc, sums)
        return (g_acc, loss_acc + loss, sums_acc), None

    init = (zero_grads, jnp.zeros((), jnp.float32), zero_sums)
    if batch.chunk_mask is not None:
        pick = lambda m: jax.tree.map(  # noqa: E731
            lambda x: jax.lax.dynamic_index_in_dim(x, m, keepdims=False), mbs
        )
        used = jnp.sum(batch.chunk_mask.astype(jnp.int32))
        grads, loss, sums = jax.lax.fori_loop(0, used, lambda m, c: body(c, pick(m))[0], init)
    elif M == 1:  # no loop to compile
        (grads, loss, sums), _ = body(init, jax.tree.map(lambda x: x[0], mbs))
    else:
        (grads, loss, sums), _ = jax.lax.scan(body, init, mbs)

    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(operands):  # float32 gradients: the optimizer casts to its moment dtype
        grads, params, opt_state = operands
        updates, new_opt = make_optimizer(tcfg).update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt

    # A conditional rather than a select of new and old: the select reads the old params and
    # moments after the new ones are written into the same (donated) buffers, which makes XLA
    # copy every moment first (measured: 3.6 GiB of copies at the 0.5B shape).
    new_params, new_opt = jax.lax.cond(
        ok, update, lambda operands: operands[1:], (grads, state.params, state.opt_state)
    )
    new_state = state.replace(
        params=new_params,
        opt_state=new_opt,
        version=state.version + ok.astype(jnp.int32),
        skipped=state.skipped + (~ok).astype(jnp.int32),
    )
    metrics = _metrics(state, batch, adv, loss, sums, grad_norm, ok)
    if batch.routes is not None:  # mixture of experts
        metrics["routing_diff_share"] = sums["routing_diff"] / jnp.maximum(sums["routed_tokens"], 1)
        metrics["routed_tokens"] = sums["routed_tokens"]
    metrics["version"] = new_state.version
    metrics["skipped_total"] = new_state.skipped
    return new_state, metrics, grads


def _valid(batch: TrainBatch) -> jax.Array:
    """``bool[S]``: the samples that enter their group's baseline and the loss."""
    mask = jnp.asarray(batch.sample_mask, bool)
    return mask if batch.valid is None else mask & jnp.asarray(batch.valid, bool)


def batch_advantages(batch: TrainBatch, tcfg: TrainConfig) -> jax.Array:
    """``float32[S]``: every sample's group-relative advantage (``train.advantage``,
    ``train.normalize_std``, ``train.adv_eps``), padding groups and samples that are not
    ``valid`` left out of the baselines and given 0."""
    S, G = batch.rewards.shape[0], tcfg.group_size
    if S % G:
        raise ValueError(f"{S} samples are not whole groups of group_size={G}")
    NG = S // G
    group_mask = jnp.asarray(batch.sample_mask, bool).reshape(NG, G)[:, 0]
    return group_advantages(
        jnp.asarray(batch.rewards).reshape(NG, G),
        group_mask,
        valid=_valid(batch).reshape(NG, G),
        mode=tcfg.advantage,
        normalize_std=tcfg.normalize_std,
        eps=tcfg.adv_eps,
    ).reshape(S)


def _metrics(
    state: TrainState,
    batch: TrainBatch,
    adv: jax.Array,
    loss: jax.Array,
    sums: dict[str, jax.Array],
    grad_norm: jax.Array,
    ok: jax.Array,
) -> Metrics:
    tcfg = state.train_cfg
    n_tok = jnp.maximum(sums["tokens"], 1.0)
    valid = batch.sample_mask
    n_smp = jnp.maximum(jnp.sum(valid), 1)
    bins = tcfg.staleness_bins
    hist_idx = jnp.clip(batch.staleness, 0, bins - 1)
    lens = jnp.where(valid, batch.response_lens, 0)
    lag_n = sums["lag_tokens"]
    some = lag_n > 0
    per_lag = lambda x: jnp.where(some, x / jnp.maximum(lag_n, 1.0), 0.0)  # noqa: E731
    ess = sums["lag_w"] ** 2 / jnp.maximum(lag_n * sums["lag_w2"], 1e-30)
    return {
        "lag_tokens": lag_n,
        "lag_ess": jnp.where(some, ess, 0.0),
        "lag_clip_frac": per_lag(sums["lag_clip"]),
        "lag_kl": per_lag(sums["lag_kl"]),
        "loss": loss,
        "pg_loss": sums["pg_loss"],
        "kl_ref": sums["kl_ref"],
        "clip_frac_low": sums["clip_low"] / n_tok,
        "clip_frac_high": sums["clip_high"] / n_tok,
        "tis_frac": sums["truncated"] / n_tok,
        "ratio_mean": sums["ratio"] / n_tok,
        "approx_kl": sums["kl_behavior"] / n_tok,
        "mismatch_kl": sums["mismatch_kl"] / jnp.maximum(sums["mismatch_tokens"], 1.0),
        "mismatch_tokens": sums["mismatch_tokens"],
        "entropy": sums["entropy"] / n_tok,
        "grad_norm": grad_norm,
        "lr": lr_schedule(tcfg)(state.version),
        "skipped": (~ok).astype(jnp.int32),
        "num_tokens": sums["tokens"],
        "num_samples": jnp.sum(valid).astype(jnp.int32),
        "reward_mean": jnp.sum(jnp.where(valid, batch.rewards, 0.0)) / n_smp,
        "advantage_abs_mean": jnp.sum(jnp.abs(adv)) / n_smp,
        "staleness_hist": jnp.zeros((bins,), jnp.int32).at[hist_idx].add(valid.astype(jnp.int32)),
        "staleness_mean": jnp.sum(jnp.where(valid, batch.staleness, 0)) / n_smp,
        "response_len_mean": jnp.sum(lens) / n_smp,
        "response_len_max": jnp.max(lens),
        # every token of a sample (prompt and response) over the batch's positions: the share
        # of the step's work that is not padding
        "real_tokens": jnp.sum(batch.segment_ids > 0).astype(jnp.int32),
        "real_token_share": jnp.sum(batch.segment_ids > 0) / _positions_trained(batch),
    }


def _positions_trained(batch: TrainBatch) -> jax.Array:
    """The positions the step computes: the whole batch, or the microbatches it loops over."""
    B, T = batch.segment_ids.shape
    if batch.chunk_mask is None:
        return jnp.asarray(B * T, jnp.float32)
    M = batch.chunk_mask.shape[0]
    return jnp.sum(batch.chunk_mask.astype(jnp.float32)) * (B // M) * T


def default_rules(mesh: Mesh) -> Rules:
    """:func:`trainer_rules` for ``mesh``'s ``data`` x ``model`` shape (no FSDP)."""
    return trainer_rules(
        TrainerMeshConfig(
            data=mesh.shape["data"], model=mesh.shape["model"], expert=mesh.shape.get("expert", 1)
        )
    )


def routes_shape(cfg: ModelConfig) -> tuple[int, int] | None:
    """``(layers, experts per token)`` of a mixture-of-experts model's recorded routes (the
    ``routes`` of its train batches), None for a dense model."""
    return (cfg.num_layers, cfg.num_experts_per_tok) if cfg.is_moe else None


def batch_shardings(
    mesh: Mesh, rules: Rules, model_cfg: ModelConfig, train_cfg: TrainConfig
) -> TrainBatch:
    """Token arrays ``[B, T]`` (and MoE routes ``[B, T, L, k]``) split over ``data``,
    per-sample arrays (and the microbatch mask of ``train.microbatch_tokens``) replicated."""
    tok = NamedSharding(mesh, spec_for(("batch", "seq"), rules, mesh))
    rep = NamedSharding(mesh, PartitionSpec())
    return TrainBatch.laid_out(
        lambda dtype: tok,
        lambda dtype: rep,
        routes=tok if model_cfg.is_moe else None,
        chunk_mask=rep if train_cfg.microbatch_tokens else None,
    )


def abstract_batch(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    num_samples: int,
    rows: int,
    seq_len: int,
    multiple: int,
) -> TrainBatch:
    """A :class:`TrainBatch` of ``jax.ShapeDtypeStruct`` leaves (``rows x seq_len`` tokens,
    ``num_samples`` samples; under ``train.microbatch_tokens`` its microbatch mask, ``multiple``
    being the data-parallel devices the rows are spread over): what :func:`lower_train_step`
    compiles for."""
    routes = routes_shape(model_cfg)
    M = rows // chunk_rows(train_cfg, seq_len, multiple) if train_cfg.microbatch_tokens else None
    return TrainBatch.laid_out(
        lambda dtype: jax.ShapeDtypeStruct((rows, seq_len), dtype),
        lambda dtype: jax.ShapeDtypeStruct((num_samples,), dtype),
        routes=jax.ShapeDtypeStruct((rows, seq_len, *routes), jnp.int16) if routes else None,
        chunk_mask=None if M is None else jax.ShapeDtypeStruct((M,), jnp.bool_),
    )


def data_multiple(mesh: Mesh) -> int:
    """The devices a batch's rows are spread over: data x expert."""
    return mesh.shape["data"] * mesh.shape.get("expert", 1)


def lower_train_step(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    mesh: Mesh,
    *,
    num_samples: int,
    rows: int,
    seq_len: int,
    rules: Rules | None = None,
) -> jax.stages.Lowered:
    """The :class:`Trainer`'s step (same shardings, same donation) lowered from abstract values
    only: nothing is allocated. ``.compile().memory_analysis()`` gives its per-device bytes."""
    rules = default_rules(mesh) if rules is None else rules
    st_sh = state_shardings(model_cfg, train_cfg, mesh, rules)
    state = jax.eval_shape(
        lambda p: init_state(p, model_cfg, train_cfg), abstract_params(model_cfg)
    )
    state = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state, st_sh
    )
    batch = abstract_batch(model_cfg, train_cfg, num_samples, rows, seq_len, data_multiple(mesh))

    def traced(state: TrainState, batch: TrainBatch):
        with use_rules(mesh, rules):
            return train_step(state, batch)

    rep = NamedSharding(mesh, PartitionSpec())
    step = jax.jit(
        traced,
        in_shardings=(st_sh, batch_shardings(mesh, rules, model_cfg, train_cfg)),
        out_shardings=(st_sh, rep),
        donate_argnums=0,
    )
    return step.lower(state, batch)
