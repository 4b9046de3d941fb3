"""Built-in environments that run on the CPU with no network: a calculator-tool form of the
arithmetic task (:mod:`.calculator`) and a number-guessing game (:mod:`.guess`). Each episode is
a pure function of ``(seed, task["index"])`` and the actions; each has a ``prompt(seed, index)``
of ``(first observation, reference)`` for a prompt source and a held-out solved share."""

from __future__ import annotations

import numpy as np


def long_tailed_count(rng: np.random.Generator, median: int, sigma: float, cap: int) -> int:
    """A discretised lognormal count in ``[1, cap]`` with the given median: the skew that makes
    a few episodes far longer than the typical one."""
    return min(max(int(round(median * float(np.exp(sigma * rng.standard_normal())))), 1), cap)


def check_shape(median: int, sigma: float, cap: int) -> None:
    if not 1 <= median <= cap:
        raise ValueError(f"need 1 <= median <= cap, got median={median}, cap={cap}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
