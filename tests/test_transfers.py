"""Transfers between processes over the key-value store (the CPU host-copy path), on one
process with an in-memory store standing in for the runtime's."""

import threading
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.distributed.transfers import CHUNK, TransferError, Transfers


class MemoryStore:
    """The subset of the coordination client the transfers use."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.cv = threading.Condition()

    def key_value_set_bytes(self, key, value):
        with self.cv:
            self.data[key] = bytes(value)
            self.cv.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.data, timeout_ms / 1e3):
                raise TimeoutError(key)
            return self.data[key]

    def key_value_delete(self, key):
        with self.cv:
            self.data.pop(key, None)


def transfers(store, index=0):
    return Transfers(SimpleNamespace(index=index, client=store), via_store=True)


def test_host_copy_round_trip_in_chunks_and_cleans_up():
    store = MemoryStore()
    a, b = transfers(store, 0), transfers(store, 1)
    big = np.arange(CHUNK // 4 + 1000, dtype=np.float32)  # more than one chunk
    arrays = [jnp.asarray(big), jnp.ones((3, 2), jnp.bfloat16)]
    uid = a.new_id()
    a.serve(uid, arrays, meta={"n": 2})
    dev = jax.devices()[0]
    out, meta = b.fetch(uid, lambda m: [jax.sharding.SingleDeviceSharding(dev)] * m["n"], 5.0)
    assert meta == {"n": 2}
    np.testing.assert_array_equal(np.asarray(out[0]), big)
    assert out[1].dtype == jnp.bfloat16 and out[1].shape == (3, 2)
    assert store.data == {}  # every piece was deleted once read


class Unreadable:
    shape, dtype = (2,), np.float32

    def __array__(self, *a, **k):
        raise RuntimeError("device buffer gone")


def test_a_failed_serve_fails_the_receiver_at_once_with_the_reason():
    store = MemoryStore()
    a, b = transfers(store, 0), transfers(store, 1)
    uid = a.new_id()
    with pytest.raises(RuntimeError, match="device buffer gone"):
        a.serve(uid, [Unreadable()])
    with pytest.raises(TransferError, match="process 0 could not serve.*device buffer gone"):
        b.fetch(uid, [None], timeout_s=0.5)  # raises at once, not after its bound


def test_host_copies_of_the_same_arrays_from_several_threads():
    store = MemoryStore()
    a, b = transfers(store, 0), transfers(store, 1)
    params = [jnp.full((64, 64), i, jnp.float32) for i in range(8)]
    uids = [a.new_id() for _ in range(8)]
    errors = []

    def serve(u):
        try:
            a.serve(u, params)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(u,)) for u in uids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    sh = [jax.sharding.SingleDeviceSharding(jax.devices()[0])] * len(params)
    for u in uids:
        out, _ = b.fetch(u, sh, 5.0)
        for i, x in enumerate(out):
            assert float(x[0, 0]) == i


def test_codec_keeps_the_extension_dtypes_and_refuses_unknown_ones():
    import ml_dtypes

    from dora_jax.distributed.codec import decode, encode

    x = {
        "kv": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
        "f8": np.array([0.5, -2.0], dtype=ml_dtypes.float8_e4m3fn),
        "i": np.arange(3),
    }
    y = decode(encode(x))
    for k in x:
        assert y[k].dtype == x[k].dtype and y[k].shape == x[k].shape
        np.testing.assert_array_equal(y[k].astype(np.float32), x[k].astype(np.float32))
    bad = encode(np.zeros(2, np.float32)).replace(b"<f4", b"abs")  # a name that is no dtype
    with pytest.raises(ValueError, match="unknown array dtype 'abs'"):
        decode(bad)
