"""The model's weight products: 16-bit operands into a float32 result on a CPU, forward and
backward, against NumPy in float64; float32 operands exactly as ``jnp.einsum``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.model.dense import dense

EQS = [
    ("BTD,DNH->BTNH", (2, 5, 16), (16, 3, 4)),
    ("BTNH,NHD->BTD", (2, 5, 3, 4), (3, 4, 16)),
    ("BTD,cD->BTc", (2, 5, 16), (7, 16)),
    ("...D,DV->...V", (3, 16), (16, 7)),
]


def _inputs(xs, ws, dtype):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, xs, jnp.float32).astype(dtype)
    w = jax.random.normal(kw, ws, jnp.float32).astype(dtype)
    return x, w, kg


@pytest.mark.parametrize("eq,xs,ws", EQS)
def test_bfloat16_products_and_their_gradients_match_numpy(eq, xs, ws):
    x, w, kg = _inputs(xs, ws, jnp.bfloat16)
    y = dense(eq, x, w)
    assert y.dtype == jnp.bfloat16
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want = np.einsum(eq, x64, w64)
    # one rounding of a float32 sum to bfloat16 (8 bits): within 2^-8 of each value
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2**-8, atol=1e-6)

    g = jax.random.normal(kg, y.shape, jnp.float32).astype(jnp.bfloat16)
    _, vjp = jax.vjp(lambda x, w: dense(eq, x, w), x, w)
    dx, dw = vjp(g)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    g64 = np.asarray(g, np.float64)
    # the oracle: the gradients of <g, einsum(x, w)>, by NumPy in float64 (an ellipsis
    # flattened first: NumPy does not sum one that the result leaves out)
    ins, out = eq.replace("...", "M").split("->")
    a, b = ins.split(",")
    x2 = x64.reshape(-1, x64.shape[-1]) if "..." in eq else x64
    g2 = g64.reshape(-1, g64.shape[-1]) if "..." in eq else g64
    want_dx = np.einsum(f"{out},{b}->{a}", g2, w64).reshape(x64.shape)
    want_dw = np.einsum(f"{a},{out}->{b}", x2, g2)
    for got, want in ((dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(
            np.asarray(got, np.float64), want, rtol=2**-8, atol=1e-3 * np.max(np.abs(want))
        )


def test_a_float32_result_is_not_rounded_to_bfloat16():
    x, w, _ = _inputs((4, 16), (16, 9), jnp.bfloat16)
    y = dense("...D,DV->...V", x, w, jnp.float32)
    assert y.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-6, atol=1e-5)


def test_float32_operands_are_jnp_einsum_bit_for_bit():
    x, w, _ = _inputs((2, 5, 16), (16, 3, 4), jnp.float32)
    eq = "BTD,DNH->BTNH"
    np.testing.assert_array_equal(dense(eq, x, w), jnp.einsum(eq, x, w))
    gd = jax.grad(lambda x, w: jnp.sum(dense(eq, x, w) ** 2), (0, 1))(x, w)
    ge = jax.grad(lambda x, w: jnp.sum(jnp.einsum(eq, x, w) ** 2), (0, 1))(x, w)
    for a, b in zip(gd, ge, strict=True):
        np.testing.assert_array_equal(a, b)


def test_every_product_of_a_bfloat16_step_is_bfloat16_into_float32():
    """The point of the module: no dot of the forward or backward pass multiplies a float32
    operand or rounds its result to bfloat16 (the forms XLA's CPU backend runs slowly)."""
    x, w, _ = _inputs((2, 5, 16), (16, 32), jnp.bfloat16)
    w2 = w.T

    def loss(x, w, w2):
        h = jax.nn.silu(dense("BTD,DF->BTF", x, w))
        return jnp.sum(dense("BTF,FD->BTD", h, w2).astype(jnp.float32) ** 2)

    hlo = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, w, w2).as_text()
    dot = r"stablehlo\.dot_general.*?:\s*\((tensor<[^)]*)\)\s*->\s*(tensor<[^>]*>)"
    dots = re.findall(dot, hlo)
    assert len(dots) == 6  # two products, each with its forward and two gradient products
    for operands, result in dots:
        assert operands.count("bf16") == 2 and "f32" not in operands, operands
        assert result.endswith("xf32>"), result
