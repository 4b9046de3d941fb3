"""Reward functions by name and file, run in worker processes: a result, extra metrics, the
row's metadata, an async verifier, and every way a verifier can fail (hang, raise, return junk,
kill its process) scoring 0 and counted by kind, with the pool still serving afterwards."""

import os
import textwrap
import time

import numpy as np
import pytest

from dora_jax.data import RewardPool, Scorer
from dora_jax.data.reward_functions import (
    InvalidReward,
    RewardSpecError,
    load_reward_function,
    outcome,
)

VERIFIERS = textwrap.dedent("""
    import asyncio, os, time

    def verify(response, answer, metadata):
        kind = metadata.get("kind")
        if kind == "hang":
            time.sleep(60)
        if kind == "raise":
            raise ValueError("cannot parse " + response)
        if kind == "junk":
            return "yes"
        if kind == "die":
            os._exit(3)
        return {"score": float(response == answer), "pid": os.getpid(),
                "weight": metadata["weight"]}

    async def remote(response, answer, metadata):
        await asyncio.sleep(0.01)  # a verifier that calls a service
        return 0.5 if response == answer else 0.0

    def two(response, answer):
        return 1.0
""")


@pytest.fixture
def verifier_file(tmp_path):
    path = tmp_path / "my_rewards.py"  # outside the package
    path.write_text(VERIFIERS)
    return path


def test_every_failure_scores_zero_is_counted_and_the_pool_goes_on(verifier_file):
    pool = RewardPool(f"{verifier_file}:verify", workers=2, timeout_s=1.0)
    scorer = Scorer(pool=pool)
    try:
        items = [
            ("7", "7", {"kind": k, "weight": 2.0})
            for k in ("ok", "hang", "raise", "junk", "die", "ok")
        ]
        t0 = time.monotonic()
        outs = scorer.score_many(items)
        took = time.monotonic() - t0
        assert [o.error for o in outs] == [None, "timeout", "exception", "invalid", "crash", None]
        assert [o.score for o in outs] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert "cannot parse 7" in outs[2].message and "str" in outs[3].message
        assert scorer.error_counts() == {"timeout": 1, "exception": 1, "invalid": 1, "crash": 1}
        assert took < 30, "the hung call was not stopped at its timeout"
        ok = outs[0]
        assert ok.metrics["weight"] == 2.0 and ok.metrics["pid"] != os.getpid()
        # the pool serves on after the kills
        assert scorer("3", "4", {"kind": "ok", "weight": 1.0}) == 0.0
        pool.close()  # twice (below) is fine
        kinds = [k for k, _, _ in pool.spans]
        assert kinds.count("timeout") == 1 and kinds.count("ok") == 3
    finally:
        scorer.close()


def test_async_and_two_argument_functions(verifier_file):
    pool = RewardPool(f"{verifier_file}:remote", workers=1, timeout_s=10.0)
    try:
        assert [f.result().score for f in (pool.submit("a", "a"), pool.submit("a", "b"))] == [
            0.5,
            0.0,
        ]
    finally:
        pool.close()
    two = load_reward_function(f"{verifier_file}:two")
    assert Scorer(two)("anything", "else", {"ignored": 1}) == 1.0
    async_inline = Scorer(load_reward_function(f"{verifier_file}:remote"))
    assert async_inline("x", "x") == 0.5


def test_bad_specs_name_data_reward(verifier_file, tmp_path):
    with pytest.raises(RewardSpecError, match="data.reward: .*missing.py: no such file"):
        load_reward_function(f"{tmp_path / 'missing.py'}:f")
    with pytest.raises(RewardSpecError, match="has no 'nope'"):
        load_reward_function(f"{verifier_file}:nope")
    with pytest.raises(RewardSpecError, match="cannot import 'no_such_pkg.mod'"):
        load_reward_function("no_such_pkg.mod:f")
    assert load_reward_function("os.path:join") is os.path.join  # package.module:function


@pytest.mark.parametrize(
    "value,want",
    [
        (1, (1.0, {})),
        (True, (1.0, {})),
        ({"score": 0.5, "len": 3}, (0.5, {"len": 3.0})),
        (np.float32(0.25), (0.25, {})),
        ({"score": np.array(1), "ok": np.bool_(True)}, (1.0, {"ok": 1.0})),
    ],
)
def test_outcome_of_good_values(value, want):
    assert outcome(value) == want


@pytest.mark.parametrize(
    "value",
    [
        "1.0",
        None,
        float("nan"),
        float("inf"),
        {"len": 3},
        {"score": "1"},
        {"score": 1.0, "note": "text"},
        [1.0],
        np.array("1"),
        np.array(1 + 2j),
        {"score": np.array("x")},
        {"score": 1.0, "len": np.array(1j)},
        10**400,
    ],
)
def test_outcome_of_junk_is_invalid(value):
    with pytest.raises(InvalidReward):
        outcome(value)
