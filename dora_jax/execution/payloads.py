"""What travels with a request through the control plane without the control plane reading it.

The control plane sees request ids, prompt groups and lengths; a request's prompt tokens and
reference answer ride along as a :class:`PromptPayload`, and a finished request's tokens and
behavior logprobs come back as a :class:`Completion`. The backends build these, the pipeline
reads them; neither the control plane nor the engine depends on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PromptPayload:
    """What a request needs beyond the control plane's view: its prompt and answer."""

    index: int  # position of the prompt in the prompt stream
    tokens: tuple[int, ...]
    answer: str
    max_new_tokens: int | None = None  # None: the backend's default
    metadata: dict | None = None  # the dataset row's other fields, for the reward function
    # a multi-turn episode (execution.turns): the environment's seed, task and first observation,
    # plain data the turn driver reads; None for a single-turn prompt
    conversation: dict | None = None


@dataclass(frozen=True)
class Completion:
    """Payload of a finished request: everything the trainer needs to score and learn."""

    prompt: PromptPayload
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    prefill_tokens: int
    migrations: int
    routes: Any = None  # MoE: int16[P + R - 1, L, k], each fed token's experts (engine-recorded)
    # Multi-turn episodes: ``tokens`` holds model and environment turns alternating;
    # ``loss_mask[i]`` is true where ``tokens[i]`` was sampled by the model (None: all were);
    # ``env_reward`` is the episode's reward from its environment (None: score it with the
    # reward function); ``conversation`` its figures (turns, environment seconds, end reason,
    # error kind, ``info/<name>``) for the metrics.
    loss_mask: tuple[bool, ...] | None = None
    env_reward: float | None = None
    conversation: dict | None = None
