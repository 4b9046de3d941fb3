"""Glue between the control plane and the real arrays: prompts in, GRPO steps out.

- :class:`TokenizedPrompts`: the runtime's prompt source, from a :class:`dora_jax.data.PromptSource`
  and a tokenizer: a string prompt (through ``data.prompt_template``) or the row's chat messages,
  with ``data.system_prompt``, rendered by the chat template (a prompt longer than the engine's
  context fails with a clear error, or with ``data.long_prompts=skip`` is left out and counted).
- :class:`GRPOTrainer`: the runtime's trainer. It scores finished requests with the
  :class:`~dora_jax.data.Scorer` (a pooled scorer starts on each request as it finishes, see
  :meth:`GRPOTrainer.prefetch`), packs them into a train batch, runs one jitted GRPO step on the
  trainer submesh, and keeps the params of every version the rollout side may still ask for.
  Its first ``samples_per_step`` trajectories are kept as text in the step's log
  (:mod:`dora_jax.pipeline.samples`). A trajectory whose reward call or environment call failed
  (it scored 0, counted by kind) is kept in, or left out of, its group's baseline and gradient as
  ``data.on_failure`` says (:func:`dora_jax.train.advantages.valid_members`); the step's log
  counts the failed and the dropped ones.

Versions: the policy version is the number of train steps taken. A step that the non-finite
guard skips leaves the params unchanged and still produces the next version (equal params), so
the control plane goes on; ``metrics["skipped"]`` marks it in the step's log.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from dora_jax import faults
from dora_jax.data.examples import chat_messages
from dora_jax.data.prompts import PromptSource
from dora_jax.data.scoring import Scorer, with_finish_reason
from dora_jax.execution.payloads import Completion, PromptPayload
from dora_jax.model.params import Params
from dora_jax.model.tokenizer import Tokenizer, encode_prompt, response_ids, undecodable
from dora_jax.orchestrator.rollout_manager import PromptSpec
from dora_jax.orchestrator.transfer_queue import ReadyGroup
from dora_jax.pipeline import samples
from dora_jax.train import Trainer, Trajectory
from dora_jax.train.advantages import ON_FAILURE, OnFailure, valid_members


class PromptTooLong(ValueError):
    """A prompt does not fit the engine's ``rollout.max_prompt_len``."""


class TokenizedPrompts:
    """``next_prompt()`` for the runtime: text -> chat template -> token ids."""

    def __init__(
        self,
        source: PromptSource,
        tokenizer: Tokenizer,
        max_prompt_len: int,
        system_prompt: str | None = None,
        template: str = "{prompt}",
        *,
        skip: bool = False,
    ):
        self.source, self.tokenizer, self.max_prompt_len = source, tokenizer, max_prompt_len
        self.system_prompt, self.template = system_prompt, template
        self.skip = skip
        self.skipped = 0  # prompts left out (too long), part of the checkpoint

    def state_dict(self) -> dict:
        return {"cursor": self.source.cursor, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.source.cursor = int(state["cursor"])
        self.skipped = int(state["skipped"])

    def next_prompt(self) -> PromptSpec:
        while True:
            (p,) = self.source.take(1)
            tokens = tuple(encode_chat(self.tokenizer, p.text, self.system_prompt, self.template))
            if tokens and len(tokens) <= self.max_prompt_len:
                payload = PromptPayload(p.index, tokens, p.answer, metadata=p.metadata or None)
                return PromptSpec(len(tokens), payload)
            if not self.skip:
                raise PromptTooLong(
                    f"prompt {p.index} of the stream has {len(tokens)} tokens; "
                    f"rollout.max_prompt_len is {self.max_prompt_len} (raise it, filter the data, "
                    f"or set data.long_prompts=skip): {str(p.text)[:60]!r}"
                )
            self.skipped += 1


def encode_chat(
    tokenizer: Tokenizer, prompt, system_prompt: str | None = None, template: str = "{prompt}"
) -> list[int]:
    """Token ids of a prompt (a string or chat messages) as the run renders it: ``template``,
    ``system_prompt``, the tokenizer's chat template."""
    return encode_prompt(tokenizer, chat_messages(prompt, system_prompt, template))


def conversation_metrics(comp: Completion) -> dict[str, float]:
    """A multi-turn trajectory's figures, averaged over the step's trajectories:
    ``env/turns_mean``, ``env/env_seconds_mean``, ``env/model_tokens_mean``,
    ``env/env_tokens_mean``, ``env/failed_share`` (a failed environment call ended it) and
    ``env/info/<name>`` (numeric fields of the environment's info); none for a single-turn
    one."""
    c = comp.conversation
    if c is None:
        return {}
    names = ("turns", "env_seconds", "model_tokens", "env_tokens")
    out = {f"env/{k}_mean": float(c[k]) for k in names if isinstance(c.get(k), int | float)}
    out["env/failed_share"] = float(c.get("error") is not None)
    out.update((f"env/{k}", float(v)) for k, v in c.items() if k.startswith("info/"))
    return out


FAILURE_FIGURES = ("failed_samples", "failed_samples_dropped", "failed_groups_dropped")


def failure_figures(failed, valid) -> dict[str, int]:
    """A step's failed calls and what ``data.on_failure`` dropped, from ``failed`` and ``valid``
    (``bool[NG, G]``): ``failed_samples`` (trajectories whose reward or environment call failed),
    ``failed_samples_dropped`` (trajectories left out of their group's baseline and gradient: the
    failed ones under ``drop_sample``, every member of their groups under ``drop_group``, none
    under ``zero``) and ``failed_groups_dropped`` (groups with a failed member left with fewer
    than two members, so with no baseline and no gradient at all)."""
    failed, valid = np.asarray(failed, bool), np.asarray(valid, bool)
    hit = failed.any(axis=1)
    return {
        "failed_samples": int(failed.sum()),
        "failed_samples_dropped": int((~valid[hit]).sum()),
        "failed_groups_dropped": int((valid[hit].sum(axis=1) < 2).sum() if hit.any() else 0),
    }


@dataclass
class StepLog:
    version: int
    metrics: dict[str, Any]
    rewards: list[float]
    trajectories: list[int] = field(default_factory=list)  # request ids consumed
    # the means of the extra metrics the reward function returned (over the responses that
    # returned each), and the failed calls of this step by kind
    reward_metrics: dict[str, float] = field(default_factory=dict)
    # the train step's own seconds (dispatch to computed) and real tokens per second; kept out
    # of ``metrics``, which two runs of one config reproduce bit for bit
    timing: dict[str, float] = field(default_factory=dict)
    # the first consumed trajectories as text (dora_jax.pipeline.samples: samples.jsonl rows
    # without their step)
    samples: list[dict[str, Any]] = field(default_factory=list)


class GRPOTrainer:
    """Implements the runtime's ``Trainer`` protocol over :class:`dora_jax.train.Trainer`."""

    def __init__(
        self,
        trainer: Trainer,
        tokenizer: Tokenizer,
        reward_fn: Scorer | Callable[[str, str], float],
        *,
        train_ticks: int = 1,
        samples_per_step: int = 0,
        on_failure: OnFailure = "drop_sample",
    ):
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
        self.trainer, self.tokenizer = trainer, tokenizer
        # data.on_failure: what a failed reward or environment call does to its group
        self.on_failure = on_failure
        # trajectories per step kept as text for the run's record (the first ones consumed)
        self.samples_per_step = samples_per_step
        self.scorer = reward_fn if isinstance(reward_fn, Scorer) else Scorer(reward_fn)
        self.train_ticks = train_ticks
        self.params: dict[int, Params] = {self.version: trainer.export_params()}
        # Where exports go (None: the trainer's own shardings). A multi-process run exports in
        # the rollout groups' layout on process 0, so that a published version can be pulled by
        # another process at once, without a copy that would wait for the next train step.
        self.export_shardings: Params | None = None
        # the step logs from ``log_start`` on (a run with history files trims the published
        # ones, :meth:`trim_log`: they are in metrics.jsonl)
        self.log: list[StepLog] = []
        self.log_start = 0
        self.keep_log = True
        # told of every consumed trajectory: (request id, version, completion)
        self.on_consume: list[Callable[[int, int, Completion], None]] = []
        # sampled ids the tokenizer cannot decode (a model vocabulary larger than the
        # tokenizer's): they read as nothing to the reward, so they are counted, per step
        self.undecodable_tokens = 0

    @property
    def version(self) -> int:
        """The policy version: steps taken, applied or skipped (blocks on the device)."""
        state = self.trainer.state
        return int(state.version) + int(state.skipped)

    def item(self, comp: Completion) -> tuple[str, str, dict | None]:
        """What the reward function reads: the response text, the answer, the row's fields and
        ``finish_reason`` (``"eos"``, or ``"length"`` for a response cut at the token limit)."""
        text = self.tokenizer.decode(response_ids(self.tokenizer, comp.tokens))
        return (
            text,
            comp.prompt.answer,
            with_finish_reason(comp.prompt.metadata, comp.finish_reason),
        )

    def prefetch(self, request_id: int, comp: Completion) -> None:
        """Start scoring a request the moment it finishes (returns at once); its train step
        then finds the score ready, or waits at most the reward timeout for it. A conversation
        rewarded by its environment needs no scoring."""
        if comp.env_reward is None:
            self.scorer.prefetch(request_id, self.item(comp))

    def step(self, batch: list[ReadyGroup]) -> int:
        trajectories, rewards, ids, failed = [], [], [], []
        picked = samples.chosen(batch, self.samples_per_step)
        kept: dict[int, dict[str, Any]] = {}
        found = [(t.request_id, t.payload) for rg in batch for t in rg.trajectories]
        # counted here, once per consumed response (``item`` also runs for prefetches)
        self.undecodable_tokens += sum(
            undecodable(self.tokenizer, response_ids(self.tokenizer, c.tokens)) for _, c in found
        )
        scored = [(rid, c) for rid, c in found if c.env_reward is None]
        outcomes = iter(
            self.scorer.score_many(
                [self.item(c) for _, c in scored], keys=[rid for rid, _ in scored]
            )
        )
        extra: dict[str, list[float]] = {}
        for rg in batch:
            for t in rg.trajectories:
                comp: Completion = t.payload
                out = None
                if comp.env_reward is None:
                    out = next(outcomes)
                    reward = out.score
                    for k, v in out.metrics.items():
                        extra.setdefault(k, []).append(v)
                else:
                    reward = comp.env_reward
                # a failed reward call, or an environment call that ended the conversation
                conv = comp.conversation
                failed.append(
                    (out is not None and out.error is not None)
                    or (conv is not None and conv.get("error") is not None)
                )
                if t.request_id in picked:  # decoded here, the chosen ones only
                    kept[t.request_id] = samples.trajectory_sample(
                        self.tokenizer, t, rg, picked[t.request_id], reward, out
                    )
                for k, v in conversation_metrics(comp).items():
                    extra.setdefault(k, []).append(v)
                rewards.append(reward)
                ids.append(t.request_id)
                for observe in self.on_consume:
                    observe(t.request_id, rg.version, comp)
                trajectories.append(
                    Trajectory(
                        prompt_tokens=np.asarray(comp.prompt.tokens, np.int32),
                        response_tokens=np.asarray(comp.tokens, np.int32),
                        behavior_logprobs=np.asarray(comp.logprobs, np.float32),
                        reward=reward,
                        version=rg.version,
                        group_id=rg.prompt_group,
                        routes=comp.routes,
                        loss_mask=comp.loss_mask,
                    )
                )
        # data.on_failure: which members stay in their group's baseline and gradient
        figures = dict.fromkeys(FAILURE_FIGURES, 0)
        start = 0
        for rg in batch:
            end = start + len(rg.trajectories)
            group = np.asarray(failed[start:end], bool)[None]
            valid = valid_members(group, self.on_failure)[0]
            for i, v in enumerate(valid, start):
                trajectories[i] = dataclasses.replace(trajectories[i], valid=bool(v))
            for k, n in failure_figures(group, valid[None]).items():
                figures[k] += n
            start = end
        # a broken policy may have sampled non-finite logprobs: the step's guard skips the step
        fallbacks = getattr(self.trainer, "fallback_batches", 0)
        trainer_version = self.version  # (waits for the previous step on the device)
        packed = self.trainer.pack(
            trajectories,
            num_groups=len(batch),
            version=trainer_version,
            allow_nonfinite_logprobs=True,
        )
        t0 = time.perf_counter()
        metrics = self.trainer.step(packed)
        # the step's own seconds. Waiting for it keeps the host from dispatching further work
        # meanwhile: on the wall clock this runs on the trainer's own thread, so only the
        # logical clock (one thread, reproducible, not timed) gives up that overlap
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - t0
        real = sum(len(t.prompt_tokens) + len(t.response_tokens) for t in trajectories)
        # (a conversation's environment turns are real tokens too: the step computes them)
        # fallback_shape 1: run in a bigger compiled shape while its own compiled
        # (train.compile_shapes)
        fallback = getattr(self.trainer, "fallback_batches", 0) - fallbacks
        timing = {
            "train_step_s": seconds,
            "real_tokens_per_s": real / max(seconds, 1e-9),
            "fallback_shape": float(fallback),
        }
        metrics["undecodable_tokens"] = self.undecodable_tokens  # cumulative
        metrics.update(figures)  # this step's
        faults.point("train_step")
        version = self.version
        self.params[version] = self.trainer.export_params(self.export_shardings)
        means = {k: float(np.mean(v)) for k, v in extra.items()}
        rows = [kept[rid] | {"staleness": trainer_version - kept[rid]["version"]} for rid in picked]
        self.log.append(StepLog(version, metrics, rewards, ids, means, timing, rows))
        return version

    def drift(self) -> tuple[list[int], list[float]] | None:
        """The newest step's response tokens and importance-weight ESS per version lag (what
        ``staleness_k: auto`` reads; ``dora_jax/train/step.py``), or None before any step."""
        if not self.log:
            return None
        m = self.log[-1].metrics
        return np.asarray(m["lag_tokens"]).tolist(), np.asarray(m["lag_ess"]).tolist()

    def step_logs(self, start: int) -> list[StepLog]:
        """The step logs from the ``start``-th on (0: the run's first step)."""
        if start < self.log_start:
            raise IndexError(
                f"step log {start} was trimmed (the logs from {self.log_start} on are kept)"
            )
        return self.log[start - self.log_start :]

    def trim_log(self, version: int) -> None:
        """Forget the step logs of versions up to ``version`` (published and written out)."""
        n = sum(1 for s in self.log if s.version <= version)
        del self.log[:n]
        self.log_start += n

    def state_dict(self) -> dict[str, Any]:
        """The kept step logs, the cumulative counter and the versions whose params the
        checkpoint holds (the params themselves are arrays: :meth:`version_params`)."""
        return {
            "log": [
                (
                    s.version,
                    jax.device_get(s.metrics),
                    s.rewards,
                    s.trajectories,
                    s.reward_metrics,
                    s.timing,
                    s.samples,
                )
                for s in self.log
            ],
            "log_start": self.log_start,
            "undecodable_tokens": self.undecodable_tokens,
            "versions": sorted(self.params),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The host part of :meth:`state_dict` (the params are placed by the checkpoint)."""
        self.log = [StepLog(*entry) for entry in state["log"]]
        self.log_start = int(state["log_start"])
        self.undecodable_tokens = int(state["undecodable_tokens"])

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
