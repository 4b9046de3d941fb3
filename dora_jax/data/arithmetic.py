"""The built-in verifiable task: division with remainder by repeated subtraction, on a scratchpad.

Prompt ``"23-5="``; the expected response counts down by 5 from 23 until the value is below 5,
then gives the remainder after ``#``::

    23,18,13,8,3#3

Every scratchpad step is a small, local subtraction (learnable by a tiny model), and the number of
steps, the quotient, is drawn from a heavy-tailed (discretised lognormal) distribution, so response
lengths in tokens have p99/median >= 10: the long tail that DORA is about. Every problem is a pure
function of ``(seed, index)``.
"""

from __future__ import annotations

import numpy as np

from dora_jax.data.prompts import PromptSource


class ArithmeticTask:
    def __init__(self, seed: int, median_steps: int = 3, sigma: float = 1.2, max_steps: int = 40):
        if not 1 <= median_steps <= max_steps:
            raise ValueError(
                f"need 1 <= median_steps <= max_steps, got {median_steps}, {max_steps}"
            )
        self.seed, self.median_steps = seed, median_steps
        self.sigma, self.max_steps = sigma, max_steps

    def numbers(self, index: int) -> tuple[int, int]:
        """``(n, s)``: count down from ``n`` in steps of ``s``."""
        rng = np.random.default_rng((self.seed, index))
        q = int(round(self.median_steps * float(np.exp(self.sigma * rng.standard_normal()))))
        q = min(max(q, 1), self.max_steps)
        s = int(rng.integers(1, 10))
        return q * s + int(rng.integers(0, s)), s

    @staticmethod
    def render(n: int, s: int) -> tuple[str, str, str]:
        """(prompt, full solution, answer)."""
        steps = list(range(n, -1, -s))
        answer = str(steps[-1])
        return f"{n}-{s}=", ",".join(map(str, steps)) + f"#{answer}", answer

    def problem(self, index: int) -> tuple[str, str]:
        """``(prompt, reference)``: the reference is the worked solution, so the reward can give
        credit for scratchpad progress as well as for the answer."""
        prompt, solution, _ = self.render(*self.numbers(index))
        return prompt, solution

    def solution(self, index: int) -> str:
        return self.render(*self.numbers(index))[1]

    def demonstration(self, index: int, direct_frac: float) -> tuple[str, str]:
        """``(prompt, response)`` of the warm-start teacher: with probability ``direct_frac``
        (a pure function of ``(seed, index)``) the bare answer ``#r`` without the scratchpad,
        otherwise the worked solution. The bare answer is a shortcut a small model cannot take
        reliably (it would have to divide in one token), so a policy imitating this teacher
        starts out mixing the two, and RL has a visible thing to learn: work on the scratchpad."""
        prompt, solution, answer = self.render(*self.numbers(index))
        direct = np.random.default_rng((self.seed, index, 1)).random() < direct_frac
        return prompt, f"#{answer}" if direct else solution

    def source(self) -> PromptSource:
        return PromptSource(self.problem, f"arithmetic(seed={self.seed})")

    @staticmethod
    def answer_reward(response: str, reference: str) -> float:
        """1 for the right remainder after the last ``#``, else 0 (``data.reward: exact``)."""
        answer = reference.rpartition("#")[2]
        return float("#" in response and response.rsplit("#", 1)[1].strip() == answer)

    @staticmethod
    def reward(response: str, reference: str) -> float:
        """``data.reward: partial_credit``. 1 for the right remainder after the last ``#``;
        otherwise partial credit for scratchpad progress: 0.5 x (leading countdown values that
        match the reference) / (values in the reference). A dense signal for long problems that
        are rarely solved outright."""
        if ArithmeticTask.answer_reward(response, reference):
            return 1.0
        want = reference.rpartition("#")[0].split(",")
        got = response.split("#", 1)[0].split(",")
        matched = 0
        for w, g in zip(want, got, strict=False):
            if w != g.strip():
                break
            matched += 1
        return 0.5 * matched / len(want)
