"""Prompts and a deterministic, checkpointable prompt source."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from dora_jax.data.examples import Example

T = TypeVar("T")


@dataclass(frozen=True)
class Prompt:
    """One prompt of the stream: ``index`` is its position in the stream (a stable id); ``text``
    is a string or chat messages (dicts with ``role`` and ``content``); ``metadata`` is the
    dataset row's other fields, for reward functions."""

    index: int
    text: str | tuple[dict[str, str], ...]
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


class PromptSource:
    """Hands out prompts ``fetch(0), fetch(1), ...``; the whole state is ``cursor``, so a run
    resumes exactly where it stopped (:meth:`state` / :meth:`restore`)."""

    def __init__(self, fetch: Callable[[int], tuple[str, str] | Example], name: str):
        self._fetch = fetch
        self.name = name
        self.cursor = 0

    def take(self, n: int) -> list[Prompt]:
        out = []
        for i in range(self.cursor, self.cursor + n):
            item = self._fetch(i)
            if isinstance(item, Example):
                out.append(Prompt(i, item.prompt, item.answer, item.metadata))
            else:
                out.append(Prompt(i, *item))
        self.cursor += n
        return out

    def state(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "name": self.name}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(
                f"prompt source mismatch: the checkpoint was made with "
                f"{state.get('name')!r}, this run uses {self.name!r}"
            )
        self.cursor = int(state["cursor"])


def shuffled_epochs(items: Sequence[T], seed: int, shuffle: bool = True) -> Callable[[int], T]:
    """``fetch(i)`` over ``items`` epoch after epoch: in a fresh seeded order every epoch, or in
    file order without ``shuffle``. Item ``i`` depends on ``(seed, i)`` only, so a resumed
    source (its cursor restored) continues with exactly the items it would have given."""
    if not items:
        raise ValueError("the prompt list is empty")
    cache: dict[int, np.ndarray] = {}

    def fetch(i: int) -> T:
        epoch, pos = divmod(i, len(items))
        if not shuffle:
            return items[pos]
        if epoch not in cache:
            cache.clear()
            cache[epoch] = np.random.default_rng((seed, epoch)).permutation(len(items))
        return items[int(cache[epoch][pos])]

    return fetch
