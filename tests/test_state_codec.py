"""The host state's codec: JSON text plus numpy arrays, no pickle; exact round trips of every kind
of value a checkpoint holds, and refusals that name where the bad value is."""

import json
import math

import ml_dtypes
import numpy as np
import pytest

from dora_jax import state_codec
from dora_jax.execution.payloads import Completion, PromptPayload
from dora_jax.orchestrator.backend import FinishedRequest, GroupTick
from dora_jax.orchestrator.records import Records, StepRecord
from dora_jax.rollout.requests import ExportedRequests, Request, request_key


def round_trip(x):
    text, arrays = state_codec.dumps(x)
    json.loads(text)  # strict JSON: no NaN literals
    return state_codec.loads(text, arrays), arrays


def test_plain_values_round_trip_exactly():
    x = {
        "none": None,
        "t": True,
        "i": -(2**70),
        "f": 0.1,
        "s": "ä",
        "l": [1, [2]],
        "tuple": (1, (2, 3)),
        "ints": {3: "a", (1, 2): "b"},
        "__odd": 1,
        "set": {3, 1},
        "nan": math.nan,
        "inf": math.inf,
        "-inf": -math.inf,
        "b": b"\x00\xff",
    }
    y, arrays = round_trip(x)
    assert not arrays
    assert math.isnan(y.pop("nan")) and math.isnan(x.pop("nan"))
    assert y == x and isinstance(y["tuple"], tuple) and isinstance(y["tuple"][1], tuple)


@pytest.mark.parametrize(
    "a",
    [
        np.zeros((), np.int32),
        np.float32(2.5),
        np.arange(6, dtype=np.uint32).reshape(2, 3),
        np.array([np.nan, -0.0, np.inf], np.float32),
        np.zeros((0, 3), np.float64),
        np.ones((3, 4), ml_dtypes.bfloat16),
        np.arange(300 * 30, dtype=np.float32).reshape(300, 30),
        np.arange(20, dtype=np.int64)[::3],
    ],
)
def test_arrays_keep_dtype_shape_and_bits(a):
    b, arrays = round_trip({"a": a})
    b = b["a"]
    assert type(b) is type(a) and b.dtype == a.dtype and np.shape(b) == np.shape(a)
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert bool(arrays) == (np.asarray(a).nbytes >= state_codec.INLINE_BYTES)  # large: stored apart


def test_records_round_trip():
    req = Request(7, [1, 2, 3], 2, request_key(0, 7), 16, tokens=[4, 5], logprobs=[-0.5, -1.5])
    kv = np.arange(2 * 1 * 2 * 3 * 4 * 8, dtype=np.float32).reshape(2, 1, 2, 3, 4, 8)
    prompt = PromptPayload(3, (1, 2, 3), "42")
    rec = Records("dora", 4, 8)
    rec.steps.append(StepRecord(0, 3, 1, 2, 0))
    rec.groups.append((GroupTick(0, 1, "decode", 2, 2, 0, 0, 0.01),))
    x = {
        "exported": ExportedRequests([req], [3], kv),
        "finished": FinishedRequest(
            7, 1, 3, 2, (2,), Completion(prompt, (4, 5), (-0.5, -1.5), "eos", 3, 0)
        ),
        "records": rec,
    }
    y, _ = round_trip(x)
    back = y["exported"].requests[0]
    assert np.array_equal(back.key, req.key) and back.key.dtype == req.key.dtype
    assert {k: v for k, v in vars(back).items() if k != "key"} == {
        k: v for k, v in vars(req).items() if k != "key"
    }
    assert np.array_equal(y["exported"].kv, kv)
    assert y["finished"] == x["finished"] and y["records"] == rec
    assert isinstance(y["records"].groups[0][0], GroupTick)


def test_unknown_types_are_refused_naming_where():
    class Opaque:
        pass

    with pytest.raises(state_codec.StateCodecError, match=r"state\.a\[1\]\.b: cannot store"):
        state_codec.dumps({"a": [0, {"b": Opaque()}]})
    with pytest.raises(state_codec.StateCodecError, match="does not read"):
        state_codec.loads(b'{"__record__": "os:system", "fields": {}}', {})
    with pytest.raises(state_codec.StateCodecError, match="not valid JSON"):
        state_codec.loads(b"\x80\x04K.", {})  # a pickle is not read


def test_a_record_saved_under_its_old_class_name_is_read_as_the_renamed_class():
    from dora_jax.rollout import EngineFinished

    rec = EngineFinished(7, (5, 6), (9, 10), (-0.5, -1.0), 2, "eos", 2, 0, 0.5)
    text, arrays = state_codec.dumps({"turn": rec})
    assert b"requests:EngineFinished" in text
    old = text.replace(b"requests:EngineFinished", b"requests:FinishedRequest")
    assert state_codec.loads(old, arrays) == {"turn": rec}
