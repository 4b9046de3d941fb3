"""A number-guessing game with a verifiable reward: find ``rounds`` secret numbers in
``1..high`` one after another, each guess answered ``higher``, ``lower`` or ``correct``.

The number of rounds is a discretised lognormal (capped), so episode lengths are long-tailed
even for a player that bisects each round. A model turn is a guess ending in ``?`` (the stop
string), e.g. ``8?``; the last integer of the turn is the guess. ``guesses_per_round x rounds``
guesses in all; running out truncates the episode. The reward comes with the last step: the
share of the secrets found (1 when all are: the episode is solved)::

    find 2 numbers in 1..16:8?lower
    4?higher
    6?correct
    8?correct
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from dora_jax.envs.builtin import check_shape, long_tailed_count
from dora_jax.envs.protocol import task_index

_INT = re.compile(r"-?\d+")


class GuessNumbers:
    stop_strings = ("?",)

    def __init__(
        self,
        median_rounds: int = 2,
        sigma: float = 1.2,
        max_rounds: int = 40,
        high: int = 16,
        guesses_per_round: int = 8,
    ):
        check_shape(median_rounds, sigma, max_rounds)
        if high < 2 or guesses_per_round < 1:
            raise ValueError(
                f"need high >= 2 and guesses_per_round >= 1, got {high}, {guesses_per_round}"
            )
        self.median_rounds, self.sigma, self.max_rounds = median_rounds, sigma, max_rounds
        self.high, self.guesses_per_round = high, guesses_per_round
        self._secrets: list[int] = []
        self.found = self.guesses = 0

    def secrets(self, seed: int, index: int) -> list[int]:
        rng = np.random.default_rng((seed, index))
        rounds = long_tailed_count(rng, self.median_rounds, self.sigma, self.max_rounds)
        return [int(x) for x in rng.integers(1, self.high + 1, rounds)]

    def prompt(self, seed: int, index: int) -> tuple[str, str]:
        """``(first observation, the secrets comma-separated)`` of game ``index``."""
        secrets = self.secrets(seed, index)
        return self._intro(len(secrets)), ",".join(map(str, secrets))

    def _intro(self, rounds: int) -> str:
        return f"find {rounds} numbers in 1..{self.high}:"

    def ideal_actions(self, seed: int, index: int) -> list[str]:
        """A bisecting player's turns."""
        actions = []
        for secret in self.secrets(seed, index):
            lo, hi = 1, self.high
            while True:
                guess = (lo + hi) // 2
                actions.append(f"{guess}?")
                if guess == secret:
                    break
                lo, hi = (guess + 1, hi) if guess < secret else (lo, guess - 1)
        return actions

    def reset(self, seed: int, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        index = task_index(task)
        self._secrets = self.secrets(seed, index)
        self.found = self.guesses = 0
        return self._intro(len(self._secrets)), {"rounds": len(self._secrets)}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not self._secrets:
            raise RuntimeError("step() before reset()")
        self.guesses += 1
        numbers = _INT.findall(action_text)
        secret = self._secrets[self.found]
        if not numbers:
            reply = "not a number\n"
        elif int(numbers[-1]) < secret:
            reply = "higher\n"
        elif int(numbers[-1]) > secret:
            reply = "lower\n"
        else:
            self.found += 1
            reply = "correct\n"
        share = self.found / len(self._secrets)
        info = {"found": self.found, "guesses": self.guesses}
        if self.found == len(self._secrets):
            return reply, 1.0, True, False, {**info, "solved": 1.0}
        if self.guesses >= self.guesses_per_round * len(self._secrets):
            return reply, share, False, True, {**info, "solved": 0.0}
        return reply, 0.0, False, False, info
