"""The built-in verifiable task: chained single-digit additions with a scratchpad.

Prompt ``"3+5+2+9="``; the expected response writes one line per addition, carrying the running
sum modulo 10, then the answer after ``#``::

    3+5=8
    8+2=0
    0+9=9
    #9

Response length grows linearly with the number of terms, and the number of terms is drawn from a
heavy-tailed (discretised lognormal) distribution, so response lengths in tokens have
p99/median >= 10: the long tail that DORA is about. Every problem is a pure function of
``(seed, index)``.
"""

from __future__ import annotations

import numpy as np

from dora_jax.data.prompts import PromptSource


class ArithmeticTask:
    def __init__(self, seed: int, median_terms: int = 3, sigma: float = 1.0, max_terms: int = 40):
        if not 2 <= median_terms <= max_terms:
            raise ValueError(f"need 2 <= median_terms <= max_terms, got {median_terms}, "
                             f"{max_terms}")  # fmt: skip
        self.seed, self.median_terms, self.sigma, self.max_terms = (
            seed, median_terms, sigma, max_terms
        )  # fmt: skip

    def terms(self, index: int) -> list[int]:
        rng = np.random.default_rng((self.seed, index))
        n = int(round(self.median_terms * float(np.exp(self.sigma * rng.standard_normal()))))
        n = min(max(n, 2), self.max_terms)
        return [int(d) for d in rng.integers(0, 10, n)]

    @staticmethod
    def render(terms: list[int]) -> tuple[str, str, str]:
        """(prompt, full solution, answer) for ``terms``."""
        prompt = "+".join(map(str, terms)) + "="
        lines, acc = [], terms[0]
        for t in terms[1:]:
            nxt = (acc + t) % 10
            lines.append(f"{acc}+{t}={nxt}")
            acc = nxt
        answer = str(acc)
        return prompt, "\n".join(lines) + f"\n#{answer}", answer

    def problem(self, index: int) -> tuple[str, str]:
        prompt, _, answer = self.render(self.terms(index))
        return prompt, answer

    def solution(self, index: int) -> str:
        return self.render(self.terms(index))[1]

    def source(self) -> PromptSource:
        return PromptSource(self.problem, f"arithmetic(seed={self.seed})")

    @staticmethod
    def reward(response: str, answer: str) -> float:
        """1 for the right answer after ``#`` (the last line), else 0."""
        last = response.strip().rsplit("\n", 1)[-1]
        return 1.0 if last.startswith("#") and last[1:].strip() == answer else 0.0
