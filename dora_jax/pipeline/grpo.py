"""Glue between the control plane and the real arrays: prompts in, GRPO steps out.

- :class:`TokenizedPrompts`: the runtime's prompt source, from a :class:`dora_jax.data.PromptSource`
  and a tokenizer (a prompt longer than the engine's context fails with a clear error, or with
  ``data.long_prompts=skip`` is left out and counted).
- :class:`GRPOTrainer`: the runtime's trainer. It scores finished requests with the reward
  function, packs them into a train batch, runs one jitted GRPO step on the trainer submesh,
  and keeps the params of every version the rollout side may still ask for.

Versions: the policy version is the number of train steps taken. A step that the non-finite
guard skips leaves the params unchanged and still produces the next version (equal params), so
the control plane goes on; ``metrics["skipped"]`` marks it in the step's log.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from dora_jax import faults
from dora_jax.data.prompts import PromptSource
from dora_jax.execution.payloads import Completion, PromptPayload
from dora_jax.model.params import Params
from dora_jax.model.tokenizer import Tokenizer, encode_prompt, response_ids
from dora_jax.orchestrator.rollout_manager import PromptSpec
from dora_jax.orchestrator.transfer_queue import ReadyGroup
from dora_jax.train import Trainer, Trajectory


class PromptTooLong(ValueError):
    """A prompt does not fit the engine's ``rollout.max_prompt_len``."""


class TokenizedPrompts:
    """``next_prompt()`` for the runtime: text -> chat template -> token ids."""

    def __init__(
        self, source: PromptSource, tokenizer: Tokenizer, max_prompt_len: int, skip: bool = False
    ):
        self.source, self.tokenizer, self.max_prompt_len = source, tokenizer, max_prompt_len
        self.skip = skip
        self.skipped = 0  # prompts left out (too long), part of the checkpoint

    def next_prompt(self) -> PromptSpec:
        while True:
            (p,) = self.source.take(1)
            tokens = tuple(encode_prompt(self.tokenizer, p.text))
            if tokens and len(tokens) <= self.max_prompt_len:
                return PromptSpec(len(tokens), PromptPayload(p.index, tokens, p.answer))
            if not self.skip:
                raise PromptTooLong(
                    f"prompt {p.index} of the stream has {len(tokens)} tokens; "
                    f"rollout.max_prompt_len is {self.max_prompt_len} (raise it, filter the data, "
                    f"or set data.long_prompts=skip): {p.text[:60]!r}"
                )
            self.skipped += 1


@dataclass
class StepLog:
    version: int
    metrics: dict[str, Any]
    rewards: list[float]
    trajectories: list[int] = field(default_factory=list)  # request ids consumed


class GRPOTrainer:
    """Implements the runtime's ``Trainer`` protocol over :class:`dora_jax.train.Trainer`."""

    def __init__(
        self,
        trainer: Trainer,
        tokenizer: Tokenizer,
        reward_fn: Callable[[str, str], float],
        *,
        train_ticks: int = 1,
    ):
        self.trainer, self.tokenizer, self.reward_fn = trainer, tokenizer, reward_fn
        self.train_ticks = train_ticks
        self.params: dict[int, Params] = {self.version: trainer.export_params()}
        # Where exports go (None: the trainer's own shardings). A multi-process run exports in
        # the rollout groups' layout on process 0, so that a published version can be pulled by
        # another process at once, without a copy that would wait for the next train step.
        self.export_shardings: Params | None = None
        self.log: list[StepLog] = []
        self.consumed: list[tuple[int, int, Completion]] = []  # (request id, version, completion)

    @property
    def version(self) -> int:
        """The policy version: steps taken, applied or skipped (blocks on the device)."""
        state = self.trainer.state
        return int(state.version) + int(state.skipped)

    def score(self, comp: Completion) -> float:
        text = self.tokenizer.decode(response_ids(self.tokenizer, comp.tokens))
        return self.reward_fn(text, comp.prompt.answer)

    def step(self, batch: list[ReadyGroup]) -> int:
        trajectories, rewards, ids = [], [], []
        for rg in batch:
            for t in rg.trajectories:
                comp: Completion = t.payload
                reward = self.score(comp)
                rewards.append(reward)
                ids.append(t.request_id)
                self.consumed.append((t.request_id, rg.version, comp))
                trajectories.append(
                    Trajectory(
                        prompt_tokens=np.asarray(comp.prompt.tokens, np.int32),
                        response_tokens=np.asarray(comp.tokens, np.int32),
                        behavior_logprobs=np.asarray(comp.logprobs, np.float32),
                        reward=reward,
                        version=rg.version,
                        group_id=rg.prompt_group,
                    )
                )
        # a broken policy may have sampled non-finite logprobs: the step's guard skips the step
        packed = self.trainer.pack(
            trajectories, num_groups=len(batch), version=self.version,
            allow_nonfinite_logprobs=True,
        )  # fmt: skip
        metrics = self.trainer.step(packed)
        faults.point("train_step")
        version = self.version
        export = self.trainer.export_params()
        if self.export_shardings is not None:
            export = jax.device_put(export, self.export_shardings)
        self.params[version] = export
        self.log.append(StepLog(version, metrics, rewards, ids))
        return version

    def wait(self, version: int) -> None:
        """Block until ``version``'s params exist (``step`` returns once the step is dispatched;
        a worker thread calls this so that "the step has ended" means computed)."""
        jax.block_until_ready(self.params[version])

    def duration_ticks(self, batch: list[ReadyGroup]) -> int:
        return self.train_ticks

    def params_for(self, version: int) -> Params:
        if version not in self.params:
            raise KeyError(f"params of version {version} were not kept")
        return self.params[version]

    def forget(self, keep: set[int]) -> None:
        """Free the params of versions no longer referenced (invariant 5)."""
        current = self.version
        for v in [v for v in self.params if v not in keep and v != current]:
            del self.params[v]
