"""The arithmetic task with a calculator tool: the model may call ``<call>23-5</call>`` and is
answered ``18``, then goes on; its final turn gives the remainder after ``#``.

The problems are those of the single-turn task's shape (count down from ``n`` by ``s``; the
number of steps is a discretised lognormal, capped), so a model that uses the tool once per step
takes ``steps + 1`` turns: turns per episode are as skewed as the single-turn lengths. The ideal
episode for ``"23-5="``::

    model: <call>23-5</call>   tool: 18
    model: <call>18-5</call>   tool: 13
    ...                        tool: 3
    model: #3                  reward 1 (terminated)

A turn that ends without a call is the final answer (reward 1 if the text after its last ``#``
is the remainder, else 0). More than ``max_calls`` calls truncate the episode with reward 0.

``latency_s`` (default 0) makes the tool slow, as real tools are: each call takes a lognormal
time of median ``latency_s`` seconds and shape ``latency_sigma`` (a pure function of the seed,
the problem and the call's number, so a replayed episode waits the same), for example
``latency_s: 0.05, latency_sigma: 1.0`` (p99 / median about 10).
"""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np

from dora_jax.envs.builtin import check_shape, long_tailed_count
from dora_jax.envs.protocol import task_index

_CALL = re.compile(r"<call>(.*?)</call>\s*$", re.S)
_EXPR = re.compile(r"^\s*(-?\d+)\s*([-+*/])\s*(-?\d+)\s*$")


def calculate(expr: str) -> str:
    """``a op b`` on integers (``/`` rounds down); ``error`` for anything else."""
    m = _EXPR.match(expr)
    if m is None or len(expr) > 40:
        return "error"
    a, op, b = int(m[1]), m[2], int(m[3])
    if op == "/" and b == 0:
        return "error"
    return str({"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op])


class ToolArithmetic:
    stop_strings = ("</call>",)

    def __init__(
        self,
        median_steps: int = 3,
        sigma: float = 1.2,
        max_steps: int = 40,
        max_calls: int = 0,
        latency_s: float = 0.0,
        latency_sigma: float = 0.0,
    ):
        check_shape(median_steps, sigma, max_steps)
        if not (latency_s >= 0 and latency_sigma >= 0):
            raise ValueError(
                f"latency_s and latency_sigma must be >= 0, got {latency_s}, {latency_sigma}"
            )
        self.median_steps, self.sigma, self.max_steps = median_steps, sigma, max_steps
        self.latency_s, self.latency_sigma = float(latency_s), float(latency_sigma)
        self._key: tuple[int, int] = (0, 0)
        # 0: room for twice the longest problem's steps
        self.max_calls = max_calls or 2 * max_steps + 2
        self._problem: tuple[int, int] | None = None
        self.calls = 0

    def numbers(self, seed: int, index: int) -> tuple[int, int, int]:
        """``(n, s, steps)``: count down from ``n`` in steps of ``s``, ``steps`` times."""
        rng = np.random.default_rng((seed, index))
        q = long_tailed_count(rng, self.median_steps, self.sigma, self.max_steps)
        s = int(rng.integers(1, 10))
        return q * s + int(rng.integers(0, s)), s, q

    def prompt(self, seed: int, index: int) -> tuple[str, str]:
        """``(first observation, remainder)`` of problem ``index``."""
        n, s, _ = self.numbers(seed, index)
        return f"{n}-{s}=", str(n % s)

    def ideal_actions(self, seed: int, index: int) -> list[str]:
        """The model turns of an ideal episode: one call per step, then the answer."""
        n, s, q = self.numbers(seed, index)
        calls = [f"<call>{n - k * s}-{s}</call>" for k in range(q)]
        return calls + [f"#{n % s}"]

    def reset(self, seed: int, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        index = task_index(task)
        n, s, q = self.numbers(seed, index)
        self._problem, self.calls, self._key = (n, s), 0, (seed, index)
        return f"{n}-{s}=", {"steps": q}

    def step(self, action_text: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        if self._problem is None:
            raise RuntimeError("step() before reset()")
        call = _CALL.search(action_text)
        if call is not None:
            self.calls += 1
            self._wait()
            if self.calls > self.max_calls:
                return "", 0.0, False, True, {"calls": self.calls, "solved": 0.0}
            reply = [{"role": "tool", "content": calculate(call[1])}]
            return reply, 0.0, False, False, {"calls": self.calls}
        n, s = self._problem
        got = action_text.rsplit("#", 1)[1].strip() if "#" in action_text else None
        solved = float(got == str(n % s))
        return "", solved, True, False, {"calls": self.calls, "solved": solved}

    def _wait(self) -> None:
        """The tool's latency for this call (none by default)."""
        if self.latency_s > 0:
            rng = np.random.default_rng((*self._key, self.calls, 7))
            time.sleep(self.latency_s * float(np.exp(self.latency_sigma * rng.standard_normal())))
