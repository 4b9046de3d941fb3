"""Environments written outside the package, loaded by the tests through the public config
(``env.spec: tests/agentic_envs.py:Chatter``), as a user's would be.

``Chatter`` suits a random tiny policy: any digit ends a model turn, so a conversation has many
short turns. It answers ``(k)`` after turn ``k`` and ends after ``turns`` turns (the task's index
adds up to two more), rewarding an even last digit; its ``info`` carries ``digits`` (an extra
field that reaches the metrics as ``env/info/digits``).

``Faulty`` is ``Chatter`` whose episodes misbehave by task index: ``index % 8 == 3`` raises in
``step``, ``== 5`` hangs (sleeps past any test timeout), ``== 6`` returns junk (a 2-tuple).
"""

from __future__ import annotations

import time

DIGITS = tuple("0123456789")


class Chatter:
    stop_strings = DIGITS

    def __init__(self, turns: int = 2):
        self.turns = turns

    def reset(self, seed, task):
        self.index, self.k, self.digits = task["index"], 0, 0
        self.limit = self.turns + self.index % 3
        return "go:", {"limit": self.limit}

    def step(self, action_text):
        self.k += 1
        last = action_text[-1:] if action_text else ""
        self.digits += last in DIGITS
        info = {"digits": self.digits}
        if self.k >= self.limit:
            return "", float(last in "02468" and last != ""), True, False, info
        return f"({self.k})", 0.0, False, False, info


class Faulty(Chatter):
    def step(self, action_text):
        bad = self.index % 8
        if bad == 3:
            raise RuntimeError("the tool broke")
        if bad == 5:
            time.sleep(60)
        if bad == 6:
            return "junk", 1.0
        return super().step(action_text)


class Shouting(Chatter):
    """Chatter whose every other task answers its first turn in capitals, which the character
    tokenizer cannot encode."""

    def step(self, action_text):
        if self.index % 2 == 1 and self.k == 0:
            self.k += 1
            return "(LOUD)", 0.0, False, False, {}
        return super().step(action_text)
