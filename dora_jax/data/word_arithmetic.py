"""Arithmetic asked in plain English (``What is 13 + 14?``), for models with a chat template.

A problem set is a pure function of its operation, operand range, count and seed, so the
training and held-out files of a recipe are reproducible (``launch/make_word_arithmetic.py``
writes them as JSONL rows ``{"prompt", "answer", "op", "a", "b"}``), and candidate
difficulties can be measured on a base model before one is chosen
(``benchmarks/smollm2_baseline.py``). The answer is checked by ``data.reward: final_number``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def problems(op: str, lo: int, hi: int, n: int, seed: int, exclude=()) -> list[dict]:
    """``n`` distinct problems ``a op b`` with ``lo <= a, b <= hi``, in a seeded order, none of
    whose ``(a, b)`` pairs is in ``exclude`` (a held-out set's pairs)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if not 0 <= lo <= hi:
        raise ValueError(f"need 0 <= lo <= hi, got lo={lo} hi={hi}")
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    excluded = set(exclude)
    pairs = [p for p in pairs if p not in excluded]
    if n > len(pairs):
        raise ValueError(f"{n} problems asked of {op} over [{lo}, {hi}]: only {len(pairs)} exist")
    random.Random(seed).shuffle(pairs)
    return [row(op, a, b) for a, b in pairs[:n]]


def row(op: str, a: int, b: int) -> dict:
    answer = str(OPS[op](a, b))
    return {"prompt": f"What is {a} {op} {b}?", "answer": answer, "op": op, "a": a, "b": b}


def pairs_of(rows: list[dict]) -> Iterator[tuple[int, int]]:
    return ((r["a"], r["b"]) for r in rows)
