"""The plain-English arithmetic task of the real-model recipe: seeded, distinct, answers right,
held-out pairs never trained on, and its files written by launch/make_word_arithmetic.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dora_jax.data.word_arithmetic import pairs_of, problems

ROOT = Path(__file__).resolve().parents[1]


def test_problems_are_seeded_distinct_and_right():
    rows = problems("*", 2, 12, 50, seed=3)
    assert rows == problems("*", 2, 12, 50, seed=3) != problems("*", 2, 12, 50, seed=4)
    assert len(set(pairs_of(rows))) == 50
    for r in rows:
        assert r["prompt"] == f"What is {r['a']} * {r['b']}?"
        assert int(r["answer"]) == r["a"] * r["b"] and 2 <= r["a"] <= 12 and 2 <= r["b"] <= 12
    sub = problems("-", 1, 5, 25, seed=0)  # every pair of [1, 5]
    assert sorted(pairs_of(sub)) == [(a, b) for a in range(1, 6) for b in range(1, 6)]
    assert {r["answer"] for r in sub if r["a"] < r["b"]} <= {"-1", "-2", "-3", "-4"}


def test_exclusions_and_bad_arguments():
    held = problems("+", 1, 10, 30, seed=1)
    rest = problems("+", 1, 10, 70, seed=2, exclude=pairs_of(held))
    assert not set(pairs_of(held)) & set(pairs_of(rest))
    with pytest.raises(ValueError, match=r"71 problems asked of \+ over \[1, 10\]: only 70"):
        problems("+", 1, 10, 71, seed=2, exclude=pairs_of(held))
    with pytest.raises(ValueError, match="op must be one of"):
        problems("/", 1, 10, 3, seed=0)
    with pytest.raises(ValueError, match="need 0 <= lo <= hi"):
        problems("+", 5, 1, 3, seed=0)


def test_the_files_are_disjoint(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "launch" / "make_word_arithmetic.py"),
        "--lo",
        "1",
        "--hi",
        "20",
        "--train",
        "300",
        "--held-out",
        "100",
        "--out",
        str(tmp_path),
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    read = lambda name: [json.loads(s) for s in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    train, held = read("train.jsonl"), read("held_out.jsonl")
    assert len(train) == 300 and len(held) == 100
    assert not set(pairs_of(train)) & set(pairs_of(held))
    assert held == problems("+", 1, 20, 100, seed=7)  # what the baseline benchmark measures
