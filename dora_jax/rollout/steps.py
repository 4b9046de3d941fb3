"""Pure prefill and decode steps of the rollout engine over the paged KV cache.

Both are module-level pure functions ``(params, cache, host inputs) -> (cache, outputs)``; the
engine jits each once per padding bucket, donating the cache. They reuse the model's
:func:`~dora_jax.model.layers.decoder_layer` with an ``attend`` that writes K/V into pages and
reads them back, so the cached path computes exactly what the full forward pass computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dora_jax.config import ModelConfig, RolloutConfig
from dora_jax.model.layers import decoder_layer, rms_norm
from dora_jax.model.params import Params, abstract_params, dtype_of, param_axes
from dora_jax.model.transformer import cast_params, logits_from_hidden
from dora_jax.rollout.attention import decode_attend, prefill_attend
from dora_jax.rollout.sampling import SamplingParams, sample
from dora_jax.sharding import constrain, rollout_rules, tree_shardings

CACHE_SPEC = P("model", None, None, None)  # [K, L*P, Z, H]: kv heads over the TP axis


@flax.struct.dataclass
class KVCache:
    """One engine's paged cache, ``k, v [K, L * P, Z, H]`` in the compute dtype.

    Layer ``l``'s page ``p`` is global page ``l * P + p``. This layer-major page layout lets the
    single-layer kernels (which take ``[K, pages, Z, H]``) address every layer of one buffer by
    offsetting the block tables, so the layer scan updates the cache in place instead of copying
    a layer slice in and out each step. Page ``l * P`` (page 0 of each layer) is padding.
    """

    k: jax.Array
    v: jax.Array
    num_layers: int = flax.struct.field(pytree_node=False)

    @property
    def pages_per_layer(self) -> int:
        return self.k.shape[1] // self.num_layers

    def global_pages(self, page_ids) -> list[int]:
        """Every layer's copy of ``page_ids``, layer-major: the order used by pack buffers."""
        P = self.pages_per_layer
        return [l * P + p for l in range(self.num_layers) for p in page_ids]


def kv_cache_dtype(cfg: ModelConfig, platform: str) -> jnp.dtype:
    """The KV cache's dtype on devices of ``platform``: the compute dtype, but float32 for a
    16-bit model on CPU devices.
    XLA's CPU backend widens a 16-bit buffer to float32 around each scatter into it and gather
    from it, so a bfloat16 cache costs a pass over the whole cache for every slot written or
    page read (measured on SmolLM2-135M, 16 rows, 8 decode steps a call: 1.9 s a call against
    0.49 s in float32); the attention reads it in float32 either way, and a bfloat16 value is
    exact in float32, so the cached keys and values are the same numbers."""
    dtype = dtype_of(cfg.compute_dtype)
    if jnp.dtype(dtype).itemsize == 2 and platform == "cpu":
        return jnp.dtype(jnp.float32)
    return jnp.dtype(dtype)


def init_cache(cfg: ModelConfig, rcfg: RolloutConfig, mesh: Mesh) -> KVCache:
    shape = (
        cfg.num_kv_heads,
        cfg.num_layers * rcfg.num_pages,
        rcfg.page_size,
        cfg.resolved_head_dim,
    )
    sharding = NamedSharding(mesh, CACHE_SPEC)
    dtype = kv_cache_dtype(cfg, mesh.devices.flat[0].platform)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return KVCache(k=zeros(), v=zeros(), num_layers=cfg.num_layers)


@flax.struct.dataclass
class StepStatic:
    """Static settings of the jitted steps (hashable, part of the jit cache key)."""

    cfg: ModelConfig = flax.struct.field(pytree_node=False)
    sampling: SamplingParams = flax.struct.field(pytree_node=False)
    mesh: Mesh = flax.struct.field(pytree_node=False)
    impl: str = flax.struct.field(pytree_node=False)
    interpret: bool = flax.struct.field(pytree_node=False)
    return_logits: bool = flax.struct.field(pytree_node=False, default=False)
    decode_steps: int = flax.struct.field(pytree_node=False, default=1)
    eos_ids: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())


def _run_layers(params, cache: KVCache, x, positions, block_tables, st: StepStatic, attend_layer):
    """Scan the decoder layers carrying the whole cache (updated in place). Returns
    ``(x, cache, routes)``: ``routes int32[B, T, L, k]``, the experts each token used in each
    layer, for a mixture of experts; None for dense models.

    ``attend_layer``: :func:`decode_attend` or :func:`prefill_attend` with its per-row inputs
    bound; it is called with the block tables offset to this layer's pages and ``window``, the
    layer's sliding window (int32 scalar, 0: none; None for a model without one).
    """
    P = cache.pages_per_layer
    # The stacked 16-bit weights enter the scan as bit patterns (no gradients here): XLA's CPU
    # backend otherwise widens the whole [L, ...] stack to float32 for its dots, outside the
    # loop (measured: a float32 copy of every weight among the step's temporaries).
    dtypes = jax.tree.map(lambda w: w.dtype, params["layers"])
    bits = jax.tree.map(_to_bits, params["layers"])

    windows = jnp.asarray(st.cfg.layer_windows(), jnp.int32)
    attend_layer = partial(attend_layer, mesh=st.mesh, impl=st.impl, interpret=st.interpret)

    def layer(carry, xs):
        x, kc, vc = carry
        lb, l = xs
        lp = jax.tree.map(_from_bits, lb, dtypes)
        tables = block_tables + l * P
        window = None if st.cfg.sliding_window is None else windows[l]

        def attend(q, k, v, scale):
            o, kc2, vc2 = attend_layer(q, k, v, kc, vc, tables, scale=scale, window=window)
            return o, (kc2, vc2)

        out = decoder_layer(lp, x, positions, st.cfg, attend)
        x, (kc, vc) = out[:2]
        return (x, kc, vc), (out[2] if st.cfg.is_moe else None)

    layers = jnp.arange(cache.num_layers, dtype=jnp.int32)
    (x, k, v), chosen = jax.lax.scan(layer, (x, cache.k, cache.v), (bits, layers))
    routes = None if chosen is None else jnp.moveaxis(chosen, 0, 2)  # [B, T, L, k]
    return x, cache.replace(k=k, v=v), routes


def _to_bits(w: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(w, jnp.uint16) if w.dtype.itemsize == 2 else w


def _from_bits(b: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(b, dtype) if b.dtype != dtype else b


def _embed_rows(embed: jax.Array, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The tokens' rows of the stored embedding, in the compute dtype. A 16-bit matrix is read
    as its bit patterns (no gradients here): XLA's CPU backend widens the whole matrix to float32
    for a gather from it (measured: a ``[49152, 576]`` float32 copy every decode call)."""
    rows = _from_bits(jnp.take(_to_bits(embed), tokens, axis=0), embed.dtype)
    return constrain(rows.astype(dtype_of(cfg.compute_dtype)), ("batch", "seq", "embed"))


def _decode_once(p, embed, cache, tokens, positions, block_tables, active, keys, st: StepStatic):
    x = _embed_rows(embed, tokens[:, None], st.cfg)
    attend_layer = partial(decode_attend, lengths=positions + 1, active=active)
    x, cache, routes = _run_layers(p, cache, x, positions[:, None], block_tables, st, attend_layer)
    h = rms_norm(x[:, 0], p["final_norm"], st.cfg.rms_norm_eps)
    logits = logits_from_hidden(p, h, st.cfg)
    next_tokens, logprobs = sample(logits, keys, positions + 1, st.sampling)
    return cache, next_tokens, logprobs, logits, (None if routes is None else routes[:, 0])


def stop_ids(eos: int | Sequence[int], extra: Sequence[int] = ()) -> tuple[int, ...]:
    """The ids that end a response: ``eos`` (one id or several) then ``extra``, without
    repeats, in order."""
    ids = [eos] if isinstance(eos, int) else list(eos)
    out: list[int] = []
    for i in [*ids, *extra]:
        if int(i) not in out:
            out.append(int(i))
    if not out:
        raise ValueError("at least one EOS id is needed (-1 for none)")
    return tuple(out)


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    out = jnp.zeros(tokens.shape, bool)
    for e in eos_ids:
        out = out | (tokens == e)
    return out


def decode_step(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    block_tables: jax.Array,
    active: jax.Array,
    key_data: jax.Array,
    remaining: jax.Array,
    st: StepStatic,
):
    """``st.decode_steps`` decode steps for ``B`` rows in one call (the host round trip and
    dispatch are paid once per call).

    Args:
      tokens: int32[B], the last token of each sequence (not yet in the cache).
      positions: int32[B], that token's position.
      block_tables: int32[B, width] (pages for ``positions + decode_steps``); active: bool[B];
      key_data: uint32[B, 2]; remaining: int32[B], tokens each row may still produce.

    Returns:
      ``(cache, tokens int32[S, B], logprobs f32[S, B], logits f32[B, V] or None, routes)`` with
      ``S = decode_steps``: step ``j``'s token sits at ``positions + 1 + j``. A row stops (writes
      and attends nothing) after ``remaining`` tokens or after sampling ``st.eos_id``; the host
      ignores its later outputs. ``logits`` are those of the first step. ``routes``: for a
      mixture of experts, int32[S, B, L, k], the experts used in each layer by the token *fed*
      at step ``j`` (step 0: ``tokens``; step ``j``: the token sampled at step ``j - 1``); None
      for dense models.
    """
    p = cast_params(params, st.cfg)
    keys = jax.random.wrap_key_data(key_data)
    if st.decode_steps == 1:
        cache, nxt, lp, logits, routes = _decode_once(
            p, params["embed"], cache, tokens, positions, block_tables, active, keys, st
        )
        routes = None if routes is None else routes[None]
        return cache, nxt[None], lp[None], (logits if st.return_logits else None), routes

    def one(carry, j):
        cache, tok, pos, live = carry
        run = live & (j < remaining)
        cache, nxt, lp, logits, routes = _decode_once(
            p, params["embed"], cache, tok, pos, block_tables, run, keys, st
        )
        live = run & ~_is_eos(nxt, st.eos_ids)
        return (cache, nxt, pos + 1, live), (nxt, lp, logits, routes)

    steps = jnp.arange(st.decode_steps, dtype=jnp.int32)
    (cache, _, _, _), (toks, lps, logits, routes) = jax.lax.scan(
        one, (cache, tokens, positions, active), steps
    )
    return cache, toks, lps, (logits[0] if st.return_logits else None), routes


def prefill_step(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    start: jax.Array,
    num_valid: jax.Array,
    block_tables: jax.Array,
    key_data: jax.Array,
    st: StepStatic,
):
    """Run a prompt chunk ``tokens int32[B, C]`` at positions ``start .. start + C - 1``.

    Rows with ``num_valid = 0`` are padding. The token after each row's last valid chunk token
    (position ``start + num_valid``) is sampled; callers use it only for rows whose prompt ends
    in this chunk. Returns ``(cache, next_tokens, logprobs, logits, routes)``: ``logits
    f32[B, V]``, the ones sampled from (requests sharing a row's prompt sample from them);
    ``routes`` int32[B, C, L, k] (the experts each chunk token used in each layer; entries of
    positions past ``num_valid`` are meaningless) for a mixture of experts, None for dense models.
    """
    p = cast_params(params, st.cfg)
    B, C = tokens.shape
    positions = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
    x = _embed_rows(params["embed"], tokens, st.cfg)
    attend_layer = partial(
        prefill_attend,
        start=start,
        num_valid=num_valid,
        # cuDNN's public API has no offset-causal masking over a paged context: prefill
        # chunks of a "cudnn" model use the blockwise path (docs in model/attention.py)
        chunk_attention="dense" if st.cfg.attention == "dense" else "blockwise",
        block=st.cfg.attention_block,
    )
    x, cache, routes = _run_layers(p, cache, x, positions, block_tables, st, attend_layer)
    last = jnp.clip(num_valid - 1, 0, C - 1)
    h = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    h = rms_norm(h, p["final_norm"], st.cfg.rms_norm_eps)
    logits = logits_from_hidden(p, h, st.cfg)
    keys = jax.random.wrap_key_data(key_data)
    next_tokens, logprobs = sample(logits, keys, start + num_valid, st.sampling)
    return cache, next_tokens, logprobs, logits, routes


def sample_rows(logits, rows, key_data, positions, sampling: SamplingParams):
    """``sample`` for requests that share a prefilled prompt: row ``i`` samples from
    ``logits[rows[i]]`` with its own key and position."""
    return sample(logits[rows], jax.random.wrap_key_data(key_data), positions, sampling)


def lower_steps(
    cfg: ModelConfig, rcfg: RolloutConfig, mesh: Mesh, *, impl: str, interpret: bool = False
) -> tuple[jax.stages.Lowered, jax.stages.Lowered]:
    """The engine's jitted prefill and decode steps (largest batch and block-table shapes,
    cache donated) lowered from abstract values only, for their memory analysis. ``num_pages``
    does not change the steps' temporaries (the cache is updated in place)."""
    Z, B, C = rcfg.page_size, rcfg.max_slots, rcfg.prefill_chunk
    R = rcfg.resolved_prefill_rows
    width = -(-(rcfg.max_prompt_len + rcfg.max_new_tokens) // Z)
    st = StepStatic(
        cfg=cfg,
        sampling=SamplingParams(rcfg.temperature, rcfg.top_k, rcfg.top_p),
        mesh=mesh,
        impl=impl,
        interpret=interpret,
        decode_steps=rcfg.decode_steps,
        eos_ids=tuple(rcfg.extra_eos_ids) or (0,),
    )
    p_sh = tree_shardings(param_axes(cfg), abstract_params(cfg), rollout_rules(), mesh)
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params(cfg), p_sh
    )
    shape = (cfg.num_kv_heads, cfg.num_layers * (width + 1), Z, cfg.resolved_head_dim)
    kv = jax.ShapeDtypeStruct(
        shape,
        kv_cache_dtype(cfg, mesh.devices.flat[0].platform),
        sharding=NamedSharding(mesh, CACHE_SPEC),
    )
    cache = KVCache(k=kv, v=kv, num_layers=cfg.num_layers)
    rep = NamedSharding(mesh, P())

    def arr(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    i32 = jnp.int32
    prefill = jax.jit(prefill_step, static_argnames=("st",), donate_argnums=(1,)).lower(
        params,
        cache,
        arr((R, C), i32),
        arr((R,), i32),
        arr((R,), i32),
        arr((R, width), i32),
        arr((R, 2), jnp.uint32),
        st=st,
    )
    decode = jax.jit(decode_step, static_argnames=("st",), donate_argnums=(1,)).lower(
        params,
        cache,
        arr((B,), i32),
        arr((B,), i32),
        arr((B, width), i32),
        arr((B,), bool),
        arr((B, 2), jnp.uint32),
        arr((B,), i32),
        st=st,
    )
    return prefill, decode
