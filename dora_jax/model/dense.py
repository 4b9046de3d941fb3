"""The model's weight products (``x @ W`` written as an einsum), with 16-bit operands multiplied
into a float32 result on CPU hosts.

On a CPU, XLA sends a bfloat16 x bfloat16 dot with a float32 result to a library kernel that uses
the processor's bfloat16 dot-product instructions (``avx512_bf16``, AMX), while the same dot with
a bfloat16 result runs a generic loop no faster than float32: measured on a 2-core host with
``avx512_bf16`` at SmolLM2-135M's train shapes, 393-403 against 172-186 GFLOP/s (float32:
182-203; ``benchmarks/bench_cpu_matmul.py``). So a 16-bit product here is computed
as ``einsum(x, w, preferred_element_type=float32)`` and cast to the compute dtype afterwards, and
its backward pass (a ``custom_vjp``) does the same for both of its products, the input's and the
weight's gradient; JAX's own transpose would multiply the float32 cotangent by the 16-bit weight,
a mixed product XLA widens to float32.

Float32 operands and other backends keep the plain einsum: a GPU's bfloat16 GEMM accumulates in
float32 already. The equations are of the form ``"x,w->out"`` where every index of each operand
also appears in one of the other two terms (projections: no index is summed inside one operand).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def dense(eq: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """``jnp.einsum(eq, x, w)`` in ``out_dtype`` (default: ``x``'s dtype). 16-bit ``x`` and ``w``
    of one dtype on a CPU backend: float32 accumulation, forward and backward (module doc)."""
    if x.dtype == w.dtype and x.dtype.itemsize == 2 and jax.default_backend() == "cpu":
        return _dense16(eq, jnp.dtype(out_dtype or x.dtype), x, w)
    if out_dtype is None:
        return jnp.einsum(eq, x, w)
    return jnp.einsum(eq, x, w, preferred_element_type=out_dtype)


def _terms(eq: str) -> tuple[str, str, str]:
    ins, out = eq.replace(" ", "").split("->")
    a, b = ins.split(",")
    return a, b, out


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dense16(eq, out_dtype, x, w):
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _dense16_fwd(eq, out_dtype, x, w):
    return _dense16(eq, out_dtype, x, w), (x, w)


def _dense16_bwd(eq, out_dtype, res, g):
    x, w = res
    a, b, out = _terms(eq)
    g = g.astype(x.dtype)
    dx = jnp.einsum(f"{out},{b}->{a}", g, w, preferred_element_type=jnp.float32)
    dw = jnp.einsum(f"{a},{out}->{b}", x, g, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_dense16.defvjp(_dense16_fwd, _dense16_bwd)
