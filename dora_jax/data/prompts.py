"""Prompts and a deterministic, checkpointable prompt source."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Prompt:
    """One prompt of the stream: ``index`` is its position in the stream (a stable id)."""

    index: int
    text: str
    answer: str


class PromptSource:
    """Hands out prompts ``fetch(0), fetch(1), ...``; the whole state is ``cursor``, so a run
    resumes exactly where it stopped (:meth:`state` / :meth:`restore`)."""

    def __init__(self, fetch: Callable[[int], tuple[str, str]], name: str):
        self._fetch = fetch
        self.name = name
        self.cursor = 0

    def take(self, n: int) -> list[Prompt]:
        out = [Prompt(i, *self._fetch(i)) for i in range(self.cursor, self.cursor + n)]
        self.cursor += n
        return out

    def state(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "name": self.name}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"prompt source mismatch: the checkpoint was made with "
                             f"{state.get('name')!r}, this run uses {self.name!r}")  # fmt: skip
        self.cursor = int(state["cursor"])


def shuffled_epochs(
    items: Sequence[tuple[str, str]], seed: int
) -> Callable[[int], tuple[str, str]]:
    """``fetch(i)`` over ``items`` in a fresh seeded order every epoch."""
    if not items:
        raise ValueError("the prompt list is empty")
    cache: dict[int, np.ndarray] = {}

    def fetch(i: int) -> tuple[str, str]:
        epoch, pos = divmod(i, len(items))
        if epoch not in cache:
            cache.clear()
            cache[epoch] = np.random.default_rng((seed, epoch)).permutation(len(items))
        return items[int(cache[epoch][pos])]

    return fetch
