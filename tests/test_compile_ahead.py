"""Compiling train-step shapes ahead on a worker thread (``train.compile: background``): the
worker itself (order, waiting, a failing compilation), and a trainer that runs a batch in a
bigger compiled shape while the batch's own shape compiles, with the same update as the batch's
own shape gives, and never compiles a shape twice."""

import threading
import time

import jax
import numpy as np
from test_train_step import MODEL, TRAIN, make_trajs  # tests/test_train_step.py

from dora_jax.mesh import make_mesh
from dora_jax.train import Trainer, Trajectory
from dora_jax.train.compile_ahead import ShapeCompiler


def test_worker_compiles_in_order_and_get_waits():
    gate, seen = threading.Event(), []

    def compile_fn(key):
        gate.wait(5)
        seen.append(key)
        return f"compiled {key}"

    c = ShapeCompiler(compile_fn)
    assert c.request("a") and c.request("b")
    assert not c.request("a")  # queued already
    assert c.ready() == {} and c.pending() == 2
    assert c.get("never requested") is None
    gate.set()
    assert c.get("b") == "compiled b"  # waits for "a", then "b"
    assert seen == ["a", "b"] and set(c.ready()) == {"a", "b"} and c.pending() == 0
    assert not c.request("b")  # compiled already
    assert set(c.seconds) == {"a", "b"}
    c.close()
    assert not c.request("c")


def test_a_failing_compilation_is_recorded_not_retried():
    calls = []

    def compile_fn(key):
        calls.append(key)
        if key == "bad":
            raise RuntimeError("no such shape")
        return key

    c = ShapeCompiler(compile_fn)
    c.request("bad")
    c.request("good")
    c.wait_idle()
    assert c.get("bad") is None and c.get("good") == "good"
    assert isinstance(c.errors["bad"], RuntimeError)
    assert not c.request("bad") and calls == ["bad", "good"]
    c.close()


def _long_group(seed, n_tokens):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(TRAIN.group_size):
        prompt = rng.integers(0, MODEL.vocab_size, 4).tolist()
        R = n_tokens - 4
        lp = (-rng.random(R) * 3).tolist()
        out.append(
            Trajectory(prompt, rng.integers(0, 64, R).tolist(), lp, float(i % 2), 0, (seed, "long"))
        )
    return out


def test_a_batch_runs_in_a_compiled_bigger_shape_while_its_own_compiles():
    params = jax.device_get(Trainer(MODEL, TRAIN).state.params)
    mesh = make_mesh(jax.devices()[:4], 2, 2)
    ahead = Trainer(MODEL, TRAIN, mesh=mesh, params=params)
    inline = Trainer(MODEL, TRAIN, mesh=mesh, params=params)
    ahead.compile_ahead()
    # two groups of long samples need a big shape; nothing is compiled yet, so the step waits
    # for the worker's compilation of it (and the jitted step itself never compiles)
    big = make_trajs(1, [0]) + _long_group(2, 30)
    b_ahead, b_inline = ahead.pack(big), inline.pack(big)
    assert (b_ahead.num_rows, b_ahead.seq_len) == (b_inline.num_rows, b_inline.seq_len)
    ahead.step(b_ahead)
    inline.step(b_inline)
    assert ahead.num_compiles == 0 and ahead.fallback_batches == 0
    # a small batch: its own shape is not compiled, so it runs in the big one meanwhile
    small = make_trajs(3, [1, 1])
    s_ahead, s_inline = ahead.pack(small), inline.pack(small)
    assert (s_ahead.num_rows, s_ahead.seq_len) == (b_ahead.num_rows, b_ahead.seq_len)
    assert s_ahead.num_rows * s_ahead.seq_len > s_inline.num_rows * s_inline.seq_len
    assert ahead.fallback_batches == 1
    m_ahead, m_inline = ahead.step(s_ahead), inline.step(s_inline)
    assert ahead.num_compiles == 0 and inline.num_compiles == 2
    # the same samples in another shape: the same update, up to float32 summation order
    for k in ("loss", "pg_loss", "grad_norm", "num_tokens", "real_tokens", "entropy"):
        np.testing.assert_allclose(float(m_ahead[k]), float(m_inline[k]), rtol=1e-5, err_msg=k)
    for a, b in zip(
        jax.tree.leaves(ahead.state.params), jax.tree.leaves(inline.state.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # once compiled, the small batch gets its own shape
    ahead._ahead.wait_idle()
    again = ahead.pack(make_trajs(3, [2, 2]))
    assert (again.num_rows, again.seq_len) == (s_inline.num_rows, s_inline.seq_len)
    assert ahead.fallback_batches == 1
    ahead.close()


def test_close_waits_for_the_compilation_under_way():
    started, done = threading.Event(), []

    def compile_fn(key):
        started.set()
        time.sleep(0.3)
        done.append(key)
        return key

    c = ShapeCompiler(compile_fn)
    c.request("a")
    c.request("b")
    started.wait(5)
    c.close()  # "a" finishes (a thread inside XLA at exit aborts the process); "b" is dropped
    assert done == ["a"] and c.get("b") is None
