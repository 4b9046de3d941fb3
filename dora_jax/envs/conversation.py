"""One multi-turn episode as one token sequence: the prompt, then model turns and environment
turns alternating, with a per-token mask (the loss covers model tokens only) and the model's
behavior logprobs.

The model's ids are appended verbatim (never decoded and encoded again); an environment turn is
rendered by :class:`~dora_jax.envs.rendering.TurnRenderer` and appended as tokens with no
logprob. :class:`Limits` bound an episode; whatever ends it is recorded in ``end_reason``:

- ``terminated`` / ``truncated``: the environment said so;
- ``max_turns``: the model took its last allowed turn;
- ``max_tokens``: the sequence is full (or the next environment turn would not fit with room for
  one model token);
- ``max_env_seconds``: the environment's calls took longer than allowed in all;
- ``env_timeout`` / ``env_error``: a call failed (``error`` is its kind: ``timeout``,
  ``exception``, ``invalid`` or ``crash``); the episode's reward is then 0.

The environment sees every model turn, even the last one a limit allows: a limit ends the
episode only after that turn's step, so a final answer is always judged. (The one exception: a
model turn longer than the tokens left, taken with ``over_budget="end"``, ends it ``max_tokens``
unseen; an engine that limits its turns to :attr:`Conversation.tokens_left` never gives one.)

:meth:`Conversation.state_dict` is the whole conversation as plain JSON data, and
:meth:`Conversation.from_state` builds it again (a checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dora_jax.envs.protocol import EnvOutcome, Observation, as_messages
from dora_jax.envs.rendering import TurnRenderer

END_REASONS = (
    "terminated",
    "truncated",
    "max_turns",
    "max_tokens",
    "max_env_seconds",
    "env_timeout",
    "env_error",
)


@dataclass(frozen=True)
class Limits:
    """Per-episode limits: model turns, tokens of the whole sequence, environment seconds."""

    max_turns: int = 16
    max_tokens: int = 4096
    max_env_seconds: float = 300.0

    def __post_init__(self):
        if self.max_turns < 1 or self.max_tokens < 2:
            raise ValueError(
                f"need max_turns >= 1 and max_tokens >= 2, got {self.max_turns}, {self.max_tokens}"
            )
        if not (self.max_env_seconds > 0 and math.isfinite(self.max_env_seconds)):
            raise ValueError(f"max_env_seconds must be > 0, got {self.max_env_seconds}")


class Conversation:
    """Start it from the reset's outcome (:meth:`start`), then alternate :meth:`add_model_turn`
    (returns the action text to send to the environment) and :meth:`add_env_outcome` until
    :attr:`done`."""

    def __init__(self, renderer: TurnRenderer, limits: Limits):
        self.renderer, self.limits = renderer, limits
        self.messages: list[dict[str, str]] = []
        self.ids: list[int] = []
        self._model: list[bool] = []
        self._logprobs: list[float] = []
        self.prompt_len = 0
        self.turns = 0
        self.rewards: list[float] = []
        self.env_seconds = 0.0
        self.info: dict[str, Any] = {}
        self.end_reason: str | None = None
        self.error: str | None = None
        self.message = ""
        self._last_model_ids: list[int] = []
        self._turn: Literal["model", "env"] = "model"

    @classmethod
    def start(cls, renderer: TurnRenderer, reset: EnvOutcome, limits: Limits) -> Conversation:
        conv = cls(renderer, limits)
        conv.env_seconds += reset.seconds
        if reset.error is not None:
            conv._fail(reset)
            return conv
        conv.info.update(reset.step.info)
        conv.messages = as_messages(reset.step.observation)
        conv._append(renderer.prompt_ids(conv.messages), model=False)
        conv.prompt_len = len(conv.ids)
        if conv.prompt_len >= limits.max_tokens:
            conv._end("max_tokens")
        return conv

    # -- state -----------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.end_reason is not None

    @property
    def awaiting(self) -> Literal["model", "env"] | None:
        """Whose turn it is (None once done)."""
        return None if self.done else self._turn

    @property
    def tokens_left(self) -> int:
        """How many tokens the next model turn may take."""
        return max(0, self.limits.max_tokens - len(self.ids))

    @property
    def token_ids(self) -> np.ndarray:
        return np.asarray(self.ids, np.int32)

    @property
    def loss_mask(self) -> np.ndarray:
        """True at model tokens, False at prompt and environment tokens."""
        return np.asarray(self._model, bool)

    @property
    def behavior_logprobs(self) -> np.ndarray:
        """One logprob per token: the sampler's at model tokens, 0 elsewhere (masked out)."""
        return np.asarray(self._logprobs, np.float32)

    @property
    def model_logprobs(self) -> np.ndarray:
        """The sampler's logprobs of the model tokens, in order."""
        return self.behavior_logprobs[self.loss_mask]

    def reward(self, how: Literal["sum", "last"] = "sum") -> float:
        """The episode's reward: its step rewards summed, or the last; 0 after a failed call."""
        if self.error is not None or not self.rewards:
            return 0.0
        return float(sum(self.rewards)) if how == "sum" else float(self.rewards[-1])

    def summary(self) -> dict[str, Any]:
        """Per-episode figures for the metrics; numeric ``info`` fields as ``info/<name>``."""
        model = int(sum(self._model))
        out: dict[str, Any] = {
            "turns": self.turns,
            "tokens": len(self.ids),
            "model_tokens": model,
            "env_tokens": len(self.ids) - self.prompt_len - model,
            "env_seconds": self.env_seconds,
            "end_reason": self.end_reason,
            "error": self.error,
        }
        for k, v in self.info.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                out[f"info/{k}"] = float(v)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The conversation as plain JSON data (its renderer and limits are the caller's)."""
        return {
            "messages": [dict(m) for m in self.messages],
            "ids": list(self.ids),
            "model": list(self._model),
            "logprobs": list(self._logprobs),
            "prompt_len": self.prompt_len,
            "turns": self.turns,
            "rewards": list(self.rewards),
            "env_seconds": self.env_seconds,
            "info": dict(self.info),
            "end_reason": self.end_reason,
            "error": self.error,
            "message": self.message,
            "last_model_ids": list(self._last_model_ids),
            "turn": self._turn,
        }

    @classmethod
    def from_state(
        cls, renderer: TurnRenderer, limits: Limits, state: dict[str, Any]
    ) -> Conversation:
        """The conversation :meth:`state_dict` gave, rendered by ``renderer`` from now on."""
        conv = cls(renderer, limits)
        conv.messages = [
            {"role": str(m["role"]), "content": str(m["content"])} for m in state["messages"]
        ]
        conv.ids = [int(t) for t in state["ids"]]
        conv._model = [bool(m) for m in state["model"]]
        conv._logprobs = [float(x) for x in state["logprobs"]]
        if not len(conv.ids) == len(conv._model) == len(conv._logprobs):
            raise ValueError(
                f"a conversation state needs one mask entry and logprob per token, "
                f"got {len(conv.ids)} ids, {len(conv._model)} mask entries and "
                f"{len(conv._logprobs)} logprobs"
            )
        conv.prompt_len, conv.turns = int(state["prompt_len"]), int(state["turns"])
        conv.rewards = [float(r) for r in state["rewards"]]
        conv.env_seconds = float(state["env_seconds"])
        conv.info = dict(state["info"])
        conv.end_reason, conv.error = state["end_reason"], state["error"]
        conv.message = str(state["message"])
        conv._last_model_ids = [int(t) for t in state["last_model_ids"]]
        if state["turn"] not in ("model", "env") or (
            conv.end_reason is not None and conv.end_reason not in END_REASONS
        ):
            raise ValueError(
                f"not a conversation state: turn {state['turn']!r}, end reason {conv.end_reason!r}"
            )
        conv._turn = state["turn"]
        return conv

    # -- turns -----------------------------------------------------------------------------------

    def add_model_turn(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        *,
        over_budget: Literal["raise", "end"] = "raise",
    ) -> str:
        """Append the sampled ``ids`` with their behavior ``logprobs``; the turn's text (what
        the environment's ``step`` gets). A turn longer than :attr:`tokens_left` is refused, or
        with ``over_budget="end"`` appended and the episode ended ``max_tokens`` (the
        environment does not see it)."""
        if self.awaiting != "model":
            raise ValueError(f"the conversation is not waiting for the model ({self._state()})")
        ids, logprobs = [int(t) for t in ids], [float(x) for x in logprobs]
        if len(ids) != len(logprobs) or not ids:
            raise ValueError(
                f"a model turn needs one logprob per token and at least one token, "
                f"got {len(ids)} ids and {len(logprobs)} logprobs"
            )
        over = len(ids) > self.tokens_left
        if over and over_budget != "end":
            raise ValueError(
                f"the model turn has {len(ids)} tokens, only {self.tokens_left} "
                "are left (limit the turn to tokens_left)"
            )
        self._append(ids, model=True, logprobs=logprobs)
        self._last_model_ids = ids
        self.turns += 1
        self._turn = "env"
        text = self.renderer.model_text(ids)
        self.messages.append({"role": "assistant", "content": text})
        if over:
            self._end("max_tokens")
        return text

    def add_env_outcome(self, outcome: EnvOutcome) -> None:
        """The environment's answer to the last model turn: record it, then end the episode or
        append the observation as the next environment turn."""
        if self.awaiting != "env":
            raise ValueError(
                f"the conversation is not waiting for the environment ({self._state()})"
            )
        self.env_seconds += outcome.seconds
        if outcome.error is not None:
            self._fail(outcome)
            return
        step = outcome.step
        self.rewards.append(step.reward)
        self.info.update(step.info)
        if step.terminated or step.truncated:
            self._end("terminated" if step.terminated else "truncated")
        elif self.env_seconds > self.limits.max_env_seconds:
            self._end("max_env_seconds")
        elif self.turns >= self.limits.max_turns:
            self._end("max_turns")
        else:
            self._append_observation(step.observation)

    def _append_observation(self, observation: Observation) -> None:
        new = as_messages(observation)
        ids = self.renderer.env_turn_ids(self.messages, self._last_model_ids, new)
        if len(self.ids) + len(ids) >= self.limits.max_tokens:
            self._end("max_tokens")
            return
        self.messages.extend(new)
        self._append(ids, model=False)
        self._turn = "model"

    def _append(self, ids: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.ids.extend(ids)
        self._model.extend([model] * len(ids))
        self._logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def fail(self, kind: str, message: str) -> None:
        """End the episode as a failed call of ``kind`` (one of the pool's error kinds; reward
        0): what the environment gave cannot be used (an observation the tokenizer cannot
        encode counts as ``invalid``)."""
        self.error, self.message = kind, message
        self._end("env_timeout" if kind == "timeout" else "env_error")

    def _fail(self, outcome: EnvOutcome) -> None:
        self.fail(outcome.error, outcome.message)

    def _end(self, reason: str) -> None:
        assert reason in END_REASONS, reason
        self.end_reason = reason

    def _state(self) -> str:
        return f"ended: {self.end_reason}" if self.done else f"waiting for the {self.awaiting}"
