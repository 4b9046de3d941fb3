"""The seam between the rollout backend and multi-turn environments: :class:`TurnDriver`.

A *conversation* is one request whose tokens alternate model turns and environment turns. The
engine stops it at the end of a model turn (an EOS, one of the driver's stop sequences, or its
token budget) and keeps its KV; the backend hands the turn to the driver, which asks the
environment off the control loop (a worker pool with a per-call timeout). When the answer is
there the driver says either "extend with these observation tokens" (the engine prefills them
into the same KV and samples the next model turn) or "the conversation is over" (its reward,
loss mask and figures). The backend never reads text and the driver never touches arrays.

The driver is built by the pipeline (it imports the environment package); execution only knows
this protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dora_jax.execution.payloads import PromptPayload


@dataclass(frozen=True)
class TurnOutcome:
    """What the driver decided after a model turn of request ``request_id``.

    ``observation``: the environment turn's token ids to append (the conversation goes on); None:
    the conversation is over, and ``reward`` (the environment's), ``loss_mask`` (over every token
    after the prompt, true at model tokens) and ``figures`` (turns, environment seconds, end
    reason, error kind, ``info/<name>``) describe it.
    """

    request_id: int
    observation: tuple[int, ...] | None = None
    reward: float = 0.0
    loss_mask: tuple[bool, ...] = ()
    figures: dict[str, Any] | None = None

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> TurnOutcome:
        """An outcome as ``dataclasses.asdict`` wrote it (a checkpoint)."""
        obs = None if d["observation"] is None else tuple(d["observation"])
        return cls(d["request_id"], obs, float(d["reward"]), tuple(d["loss_mask"]), d["figures"])

    @property
    def over(self) -> bool:
        return self.observation is None


class TurnDriver(Protocol):
    """Multi-turn episodes for the rollout backend. Called from the control loop's thread."""

    # token id sequences that end a model turn besides the tokenizer's EOS ids (the tokenized
    # stop strings the environment declares, e.g. the end of a tool call)
    stop_sequences: tuple[tuple[int, ...], ...]
    # whether ``TurnOutcome.reward`` is the episode's reward (False: the run's reward function
    # scores the conversation's text instead)
    env_rewards: bool

    def begin(self, request_id: int, payload: PromptPayload) -> None:
        """A conversation's request was submitted (its episode starts from ``payload``)."""

    def turn_ended(
        self, request_id: int, tokens: Sequence[int], logprobs: Sequence[float], turn_start: int
    ) -> None:
        """The model ended a turn: ``tokens`` (and their behavior ``logprobs``, 0 at environment
        tokens) are everything after the prompt so far, the model's turn is
        ``tokens[turn_start:]``. Starts the environment's call and returns at once."""

    def outcomes(self, wait: bool) -> list[TurnOutcome]:
        """The outcomes of the environment calls that have answered, in the order their turns
        ended; ``wait``: first wait until every call started so far has answered (the logical
        clock, so that a run is reproducible)."""

    def drop(self, request_id: int) -> None:
        """Forget a conversation that will not go on (discarded by the oversampling baseline)."""

    def pending(self) -> int:
        """Environment calls started and not yet handed out by :meth:`outcomes`."""

    def state_dict(self) -> dict[str, Any]:
        """Every live conversation and its episode as plain data (calls in flight included, to
        be started again on restore)."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
