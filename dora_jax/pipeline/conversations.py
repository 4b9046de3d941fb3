"""Multi-turn episodes in a run: the turn driver, the prompt source and their factory.

- :class:`EnvPrompts`: the runtime's prompt source when ``env.spec`` is set. Prompt ``i`` is
  task ``{"index": i}`` of the environment (``i`` from a resumable cursor, the run's seed): one
  episode is reset through the pool (waiting for it, bounded by the pool's timeout), its first
  observation rendered as the prompt, and its state put in the payload, so that each member of
  the prompt group adopts its own copy (:meth:`dora_jax.envs.EnvPool.adopt`) and the reset's
  episode is finished at once.
- :class:`EnvTurnDriver`: :class:`dora_jax.execution.turns.TurnDriver` over an
  :class:`~dora_jax.envs.EnvPool`: one :class:`~dora_jax.envs.conversation.Conversation` per
  request, token-exact against the engine's tokens; each model turn goes to the environment
  off the control loop, and its answer comes back as the next environment turn's token ids or
  as the conversation's end (reward, loss mask, figures).
- :func:`build_env`: both and the pool, from the config's ``env`` section.

Stop strings are matched on the tokenizer's encoding of each string: the engine ends a model
turn when its sampled ids end with ``tokenizer.encode(stop)``. A model that spells the stop
string with other ids (a byte-level BPE may) is not stopped there; its turn then ends at EOS or
at its token budget.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from dora_jax.config import ExperimentConfig
from dora_jax.config.schema import EnvConfig
from dora_jax.envs import (
    ERROR_KINDS,
    EnvOutcome,
    EnvPool,
    EnvPoolError,
    Step,
    check_reset,
    check_step,
    load_environment,
    resolve_spec,
    stop_strings,
)
from dora_jax.envs.conversation import END_REASONS, Conversation, Limits
from dora_jax.envs.protocol import as_messages
from dora_jax.envs.rendering import RenderDriftError, TurnRenderer
from dora_jax.execution.payloads import PromptPayload
from dora_jax.execution.turns import TurnOutcome
from dora_jax.model.tokenizer import Tokenizer, TokenizerError
from dora_jax.orchestrator.rollout_manager import PromptSpec
from dora_jax.pipeline.grpo import PromptTooLong
from dora_jax.pipeline.warm_start import Demonstration

# resets that may fail in a row before the prompt source gives up
MAX_RESET_FAILURES = 20


def env_limits(env: EnvConfig, max_prompt_len: int, max_new_tokens: int) -> Limits:
    """The episode limits of the ``env`` section (``max_tokens`` 0: prompt + response)."""
    return Limits(
        max_turns=env.max_turns,
        max_tokens=env.resolved_max_tokens(max_prompt_len, max_new_tokens),
        max_env_seconds=env.max_env_seconds,
    )


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the prompt source ----------------------------------------------------------------------------


class EnvPrompts:
    """``next_prompt()`` for the runtime: one environment episode per prompt group.

    ``payload.conversation`` is plain data: ``seed``, ``task``, ``observation`` (the first
    observation as chat messages), ``info`` (the reset's) and ``episode`` (the pool's state of the
    reset episode, which each member adopts). ``payload.answer`` is the reset info's ``answer``
    when it is a string (for ``env.reward: function``), else empty. ``payload.max_new_tokens``
    is the request's budget after its prompt: ``min(max_new_tokens, limits.max_tokens -
    prompt_len)``, model and environment turns together.

    A prompt longer than ``max_prompt_len`` (or one that leaves no room in ``limits.max_tokens``)
    raises :class:`~dora_jax.pipeline.grpo.PromptTooLong`, or with ``skip`` is left out and
    counted. A reset that fails is counted by kind and the next task is tried; after
    :data:`MAX_RESET_FAILURES` in a row, :class:`~dora_jax.envs.EnvPoolError` says so in one line
    naming the environment and the last error.
    """

    def __init__(
        self,
        pool: EnvPool,
        tokenizer: Tokenizer,
        limits: Limits,
        max_prompt_len: int,
        max_new_tokens: int,
        seed: int,
        *,
        skip: bool = False,
    ):
        if max_prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(
                f"need max_prompt_len and max_new_tokens >= 1, got {max_prompt_len}, "
                f"{max_new_tokens}"
            )
        self.pool, self.renderer, self.limits = pool, TurnRenderer(tokenizer), limits
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.seed, self.skip = int(seed), skip
        self.cursor = 0  # the next task's index
        self.skipped = 0  # prompts left out (too long)
        self.failures: Counter[str] = Counter()  # failed resets by kind

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "skipped": self.skipped, "failures": dict(self.failures)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor, self.skipped = int(state["cursor"]), int(state["skipped"])
        self.failures = Counter({str(k): int(v) for k, v in state["failures"].items()})

    def figures(self) -> dict[str, float]:
        """Cumulative: ``env/prompts_skipped`` and ``env/reset_failures/<kind>``."""
        failures = {f"env/reset_failures/{k}": float(self.failures[k]) for k in ERROR_KINDS}
        return {"env/prompts_skipped": float(self.skipped), **failures}

    def next_prompt(self) -> PromptSpec:
        in_row = 0
        while True:
            index = self.cursor
            self.cursor += 1
            task = {"index": index}
            episode, future = self.pool.reset(self.seed, task)
            out: EnvOutcome = future.result()  # the pool answers within its timeout
            ids: tuple[int, ...] = ()
            if out.error is None:
                messages = as_messages(out.step.observation)
                try:
                    ids = tuple(self.renderer.prompt_ids(messages))
                except TokenizerError as e:  # the task's data, not the run's: a failed reset
                    out = EnvOutcome(None, error="invalid", message=f"cannot be encoded: {e}")
            if out.error is not None:
                self.pool.finish(episode)
                self.failures[out.error] += 1
                in_row += 1
                if in_row >= MAX_RESET_FAILURES:
                    raise EnvPoolError(
                        f"env: {self.pool.spec}: {in_row} resets failed in a row (tasks "
                        f"{index - in_row + 1}..{index}), the last {out.error}: "
                        f"{_one_line(out.message)}"
                    )
                continue
            in_row = 0
            state = self.pool.episode_state(episode)
            self.pool.finish(episode)
            room = self.limits.max_tokens - len(ids)
            if ids and len(ids) <= self.max_prompt_len and room >= 1:
                info = dict(out.step.info)
                answer = info.get("answer")
                conversation = {
                    "seed": self.seed,
                    "task": task,
                    "observation": messages,
                    "info": info,
                    "episode": state,
                }
                payload = PromptPayload(
                    index,
                    ids,
                    answer if isinstance(answer, str) else "",
                    max_new_tokens=min(self.max_new_tokens, room),
                    conversation=conversation,
                )
                return PromptSpec(len(ids), payload)
            if not self.skip:
                text = _one_line(self.renderer.render(messages, True), 60)
                raise PromptTooLong(
                    f"env: {self.pool.spec}: the first observation of task {index} has "
                    f"{len(ids)} tokens; rollout.max_prompt_len is {self.max_prompt_len} and "
                    f"env.max_tokens {self.limits.max_tokens} (raise them, or set "
                    f"data.long_prompts=skip): {text!r}"
                )
            self.skipped += 1


# -- the turn driver ------------------------------------------------------------------------------


@dataclass
class _Live:
    """One request's conversation and its episode in the pool."""

    conv: Conversation
    episode: int | None  # the pool's episode id (None: ended before a call, nothing in the pool)
    max_tokens: int  # the conversation's token limit: its prompt and its request's budget
    action: str | None = None  # the model turn's text sent to the environment (a call running)
    before: dict[str, Any] | None = None  # the episode's state before that call
    future: Future | None = None


class EnvTurnDriver:
    """:class:`~dora_jax.execution.turns.TurnDriver` over an environment pool.

    ``reward``: ``"sum"`` or ``"last"`` of the step rewards is the ``TurnOutcome.reward`` of an
    ended conversation (0 after a failed call); with ``"function"`` it is still the sum, and
    :attr:`env_rewards` is False: the backend leaves ``Completion.env_reward`` None so that
    ``data.reward`` scores the conversation's text.

    Each conversation's token limit is its prompt plus its request's budget
    (``payload.max_new_tokens``, at most ``limits.max_tokens``), so an environment turn is
    appended only where the engine has room for it and one more model token. A model turn
    longer than the tokens left (an engine that ignores the budget) ends the conversation
    ``max_tokens`` instead of raising. An environment turn that the renderer cannot append
    token-exactly (:class:`~dora_jax.envs.rendering.RenderDriftError`), or that the tokenizer
    cannot encode, raises from :meth:`outcomes` naming the request: the chat template or the
    tokenizer does not suit the environment.
    """

    def __init__(
        self, pool: EnvPool, tokenizer: Tokenizer, limits: Limits, reward: str = "sum"
    ) -> None:
        if reward not in ("sum", "last", "function"):
            raise ValueError(f"reward must be 'sum', 'last' or 'function', got {reward!r}")
        self.pool, self.limits, self.reward_mode = pool, limits, reward
        self.renderer = TurnRenderer(tokenizer)
        stops = []
        for text in pool.stop_strings:
            try:
                ids = tuple(int(t) for t in tokenizer.encode(text))
            except TokenizerError as e:
                raise ValueError(
                    f"env: {pool.spec}: the stop string {text!r} cannot be encoded "
                    f"by the tokenizer: {e}"
                ) from None
            if not ids:
                raise ValueError(f"env: {pool.spec}: the stop string {text!r} encodes to no tokens")
            stops.append(ids)
        self.stop_sequences: tuple[tuple[int, ...], ...] = tuple(stops)
        self._live: dict[int, _Live] = {}
        self._calls: dict[int, None] = {}  # requests with an outcome to hand out, in turn order
        self._turns = 0
        self._env_seconds = 0.0
        self._ended: Counter[str] = Counter()
        self._dropped = 0
        self._failures_base: Counter[str] = Counter()  # failures before this pool (a restore)
        self._warned_invalid = False
        self.last_error: str | None = None  # "kind: message" of the newest failed episode
        # called (on the pool's thread) when an environment call answers: a wall-clock control
        # loop is woken to apply it at once
        self.on_answer: Callable[[], None] | None = None

    @property
    def env_rewards(self) -> bool:
        """Whether ``TurnOutcome.reward`` is the episode's reward (else ``data.reward``'s)."""
        return self.reward_mode != "function"

    # -- the protocol ----------------------------------------------------------------------------

    def begin(self, request_id: int, payload: PromptPayload) -> None:
        c = payload.conversation
        if c is None:
            raise ValueError(
                f"request {request_id}: its payload has no conversation (a "
                "single-turn prompt given to the turn driver)"
            )
        if request_id in self._live:
            raise ValueError(f"request {request_id} already has a conversation")
        prompt = [int(t) for t in payload.tokens]
        max_tokens = self.limits.max_tokens
        if payload.max_new_tokens is not None:
            max_tokens = min(max_tokens, len(prompt) + int(payload.max_new_tokens))
        limits = dataclasses.replace(self.limits, max_tokens=max_tokens)
        reset = EnvOutcome(Step(c["observation"], info=dict(c.get("info") or {})))
        conv = Conversation.start(self.renderer, reset, limits)
        if conv.ids != prompt:
            raise ValueError(
                f"request {request_id}: the conversation's first observation renders to "
                f"{len(conv.ids)} tokens that differ from the payload's {len(prompt)} prompt "
                "tokens (the prompt must be TurnRenderer.prompt_ids of the first observation, "
                "with the same tokenizer)"
            )
        if conv.done:
            raise ValueError(
                f"request {request_id}: its prompt of {len(prompt)} tokens leaves no "
                f"room in its token limit of {limits.max_tokens}"
            )
        episode = self.pool.adopt(c["episode"])
        self._live[request_id] = _Live(conv, episode, limits.max_tokens)

    def turn_ended(
        self, request_id: int, tokens: Sequence[int], logprobs: Sequence[float], turn_start: int
    ) -> None:
        live = self._live.get(request_id)
        if live is None:
            raise ValueError(
                f"request {request_id} has no conversation (not begun, dropped or over)"
            )
        conv = live.conv
        if conv.awaiting != "model":
            why = "it is over" if conv.done else "its environment call runs"
            raise ValueError(
                f"request {request_id}: the conversation is not waiting for a model turn ({why})"
            )
        if len(tokens) != len(logprobs) or not 0 <= turn_start < len(tokens):
            raise ValueError(
                f"request {request_id}: a turn needs one logprob per token and at "
                f"least one token, got {len(tokens)} tokens, {len(logprobs)} "
                f"logprobs and turn_start {turn_start}"
            )
        so_far = conv.ids[conv.prompt_len :]
        before = [int(t) for t in tokens[:turn_start]]
        if before != so_far:
            pairs = enumerate(zip(before, so_far, strict=False))
            at = next((i for i, (a, b) in pairs if a != b), min(len(before), len(so_far)))
            raise ValueError(
                f"request {request_id}: the engine's {turn_start} tokens before this turn are not "
                f"the conversation's {len(so_far)} tokens after its prompt (first difference at "
                f"{at}): the engine and the conversation have drifted apart"
            )
        ids = [int(t) for t in tokens[turn_start:]]
        text = conv.add_model_turn(
            ids, [float(x) for x in logprobs[turn_start:]], over_budget="end"
        )
        self._turns += 1
        if not conv.done:  # else over its budget: ended max_tokens, no call
            live.before = self.pool.episode_state(live.episode)
            live.action = text
            live.future = self._call(live.episode, text)
        self._calls[request_id] = None

    def outcomes(self, wait: bool) -> list[TurnOutcome]:
        out = []
        for rid in list(self._calls):
            live = self._live[rid]
            if live.future is not None and not (wait or live.future.done()):
                continue
            del self._calls[rid]
            if live.future is None:  # ended at the turn itself
                out.append(self._end(rid, live))
                continue
            answer: EnvOutcome = live.future.result()
            live.action = live.before = live.future = None
            conv = live.conv
            start = len(conv.ids)
            self._env_seconds += answer.seconds
            try:
                conv.add_env_outcome(answer)
            except TokenizerError as e:  # this episode's data, not the run's: an invalid call
                self._invalid(rid, conv, f"its observation cannot be encoded: {e}")
            except ValueError as e:  # RenderDriftError (the template's): name the request
                kind = type(e) if isinstance(e, RenderDriftError) else ValueError
                raise kind(f"request {rid}: env {self.pool.spec}: {e}") from e
            if conv.done:
                out.append(self._end(rid, live))
            else:
                out.append(TurnOutcome(rid, observation=tuple(conv.ids[start:])))
        return out

    def drop(self, request_id: int) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self._calls.pop(request_id, None)
        if live.episode is not None:
            self.pool.finish(live.episode)  # a call still running is answered to nobody
        self._dropped += 1

    def pending(self) -> int:
        return len(self._calls)

    def state_dict(self) -> dict[str, Any]:
        conversations = []
        for rid, live in self._live.items():
            if live.action is not None:
                episode = live.before  # the call is started again on restore
            elif live.conv.done or live.episode is None:
                episode = None
            else:
                episode = self.pool.episode_state(live.episode)
            conversations.append(
                {
                    "request": rid,
                    "conversation": live.conv.state_dict(),
                    "max_tokens": live.max_tokens,
                    "episode": episode,
                    "action": live.action,
                }
            )
        failures = self._failures_base + self.pool.errors
        return {
            "conversations": conversations,
            "calls": list(self._calls),
            "counters": {
                "turns": self._turns,
                "env_seconds": self._env_seconds,
                "ended": dict(self._ended),
                "dropped": self._dropped,
                "failures": {k: int(v) for k, v in failures.items()},
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._live:
            raise ValueError(
                f"load_state_dict needs a driver without conversations, this one "
                f"has {len(self._live)}"
            )
        for item in state["conversations"]:
            rid = int(item["request"])
            limits = dataclasses.replace(self.limits, max_tokens=int(item["max_tokens"]))
            conv = Conversation.from_state(self.renderer, limits, item["conversation"])
            episode = None if item["episode"] is None else self.pool.adopt(item["episode"])
            live = _Live(conv, episode, limits.max_tokens)
            if item["action"] is not None:
                live.action, live.before = str(item["action"]), item["episode"]
            self._live[rid] = live
        for rid in state["calls"]:  # started again in the order their turns ended
            rid = int(rid)
            live = self._live[rid]
            if live.action is not None:
                live.future = self._call(live.episode, live.action)
            self._calls[rid] = None
        c = state["counters"]
        self._turns, self._env_seconds = int(c["turns"]), float(c["env_seconds"])
        self._ended = Counter({str(k): int(v) for k, v in c["ended"].items()})
        self._dropped = int(c["dropped"])
        self._failures_base = Counter({str(k): int(v) for k, v in c["failures"].items()})
        self._failures_base.subtract(self.pool.errors)  # figures(): saved + failures from now on

    # -- metrics ---------------------------------------------------------------------------------

    def figures(self) -> dict[str, float]:
        """Cumulative figures (a restored driver goes on from the saved ones):
        ``env/conversations`` (ended), ``env/end/<reason>``, ``env/turns`` (model turns),
        ``env/env_seconds`` (of the step calls), ``env/dropped``, and ``env/failures/<kind>``
        (every failed call of the pool, resets included)."""
        out = {
            "env/conversations": float(sum(self._ended.values())),
            "env/turns": float(self._turns),
            "env/env_seconds": float(self._env_seconds),
            "env/dropped": float(self._dropped),
        }
        for reason in END_REASONS:
            out[f"env/end/{reason}"] = float(self._ended[reason])
        for kind in ERROR_KINDS:
            out[f"env/failures/{kind}"] = float(self._failures_base[kind] + self.pool.errors[kind])
        return out

    def live(self) -> int:
        """Conversations begun and not yet over or dropped."""
        return len(self._live)

    def _call(self, episode: int, action: str) -> Future:
        future = self.pool.step(episode, action)
        if self.on_answer is not None:
            on_answer = self.on_answer
            future.add_done_callback(lambda _: on_answer())
        return future

    def _invalid(self, rid: int, conv: Conversation, message: str) -> None:
        """End ``conv`` as an ``invalid`` environment failure, counted in ``env/failures``; the
        first of a run is printed, naming the request."""
        conv.fail("invalid", message)
        self._failures_base["invalid"] += 1
        if not self._warned_invalid:
            self._warned_invalid = True
            print(
                f"warning: env {self.pool.spec}: request {rid}: {_one_line(message)}; the episode "
                "ends with reward 0, counted as env/failures/invalid (the run goes on)",
                flush=True,
            )

    def _end(self, rid: int, live: _Live) -> TurnOutcome:
        conv = live.conv
        how = "sum" if self.reward_mode == "function" else self.reward_mode
        mask = tuple(bool(m) for m in conv.loss_mask[conv.prompt_len :])
        if live.episode is not None:
            self.pool.finish(live.episode)
        del self._live[rid]
        self._ended[conv.end_reason] += 1
        if conv.error is not None:
            self.last_error = f"{conv.error}: {_one_line(conv.message)}"
        return TurnOutcome(rid, None, conv.reward(how), mask, conv.summary())


# -- the factory ----------------------------------------------------------------------------------


@dataclass
class EnvRun:
    """The environment side of a run: the pool, the turn driver and the prompt source."""

    pool: EnvPool
    driver: EnvTurnDriver
    prompts: EnvPrompts
    limits: Limits

    def figures(self) -> dict[str, float]:
        return self.driver.figures() | self.prompts.figures()

    def state_dict(self) -> dict[str, Any]:
        return {"driver": self.driver.state_dict(), "prompts": self.prompts.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.driver.load_state_dict(state["driver"])

    def close(self) -> None:
        self.pool.close()


def build_env(
    cfg: ExperimentConfig,
    tokenizer: Tokenizer,
    max_prompt_len: int | None = None,
    max_new_tokens: int | None = None,
    *,
    now: Callable[[], float] | None = None,
) -> EnvRun | None:
    """The pool, driver and prompt source of ``cfg.env`` (None when ``env.spec`` is null).

    ``max_prompt_len`` and ``max_new_tokens`` default to the rollout section's; ``now`` is the
    pool's clock for its spans. A spec that cannot load fails here, in one ``env:`` line
    (:class:`~dora_jax.envs.EnvPoolError` from the workers)."""
    env = cfg.env
    if env.spec is None:
        return None
    max_prompt_len = max_prompt_len or cfg.rollout.max_prompt_len
    max_new_tokens = max_new_tokens or cfg.rollout.max_new_tokens
    limits = env_limits(env, max_prompt_len, max_new_tokens)
    extra = {"max_workers": env.max_workers} | ({} if now is None else {"now": now})
    pool = EnvPool(resolve_spec(env.spec), env.kwargs, env.workers, env.timeout_s, **extra)
    try:
        driver = EnvTurnDriver(pool, tokenizer, limits, env.reward)
        prompts = EnvPrompts(
            pool,
            tokenizer,
            limits,
            max_prompt_len,
            max_new_tokens,
            cfg.seed,
            skip=cfg.data.long_prompts == "skip",
        )
    except BaseException:
        pool.close()
        raise
    return EnvRun(pool, driver, prompts, limits)


# -- the warm start's teacher ---------------------------------------------------------------------


# keyword arguments that shape how an environment's calls take time, not what they answer: the
# teacher's play leaves them out (tool_arithmetic's simulated tool latency)
TIMING_KWARGS = ("latency_s", "latency_sigma")


def teacher_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``env.kwargs`` without the ones that only slow an environment down (the warm start's
    teacher plays in this process, and its episodes do not depend on them)."""
    return {k: v for k, v in kwargs.items() if k not in TIMING_KWARGS}


def env_demonstrations(
    cfg: ExperimentConfig, tokenizer: Tokenizer, seed: int
) -> Callable[[int], Demonstration] | None:
    """The warm-start teacher of an environment that knows its ideal play (the built-ins'
    ``ideal_actions(seed, index)``): episode ``index`` of ``seed`` played by it in this
    process, as the token sequence a run would see (the same renderer and limits), the model's
    turns to learn. With probability ``warm_start.direct_frac`` (a pure function of ``seed`` and
    ``index``) the teacher skips to its last action (for ``tool_arithmetic``: the bare answer,
    no tool calls). A model turn that does not end with a stop string ends with the tokenizer's
    EOS, as a sampled one does. None for an environment without ``ideal_actions``."""
    env = load_environment(cfg.env.spec, teacher_kwargs(cfg.env.kwargs))
    if not callable(getattr(env, "ideal_actions", None)):
        return None
    renderer = TurnRenderer(tokenizer)
    limits = env_limits(cfg.env, cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens)
    stops = stop_strings(env)
    direct_frac = cfg.warm_start.direct_frac

    def example(index: int) -> Demonstration:
        actions = list(env.ideal_actions(seed, index))
        if np.random.default_rng((seed, index, 1)).random() < direct_frac:
            actions = actions[-1:]
        first = check_reset(env.reset(seed, {"index": index}))
        conv = Conversation.start(renderer, EnvOutcome(first), limits)
        for action in actions:
            if conv.done:
                break
            ids = list(tokenizer.encode(action))
            if not any(action.endswith(s) for s in stops):
                ids.append(tokenizer.eos_id)
            text = conv.add_model_turn(ids, [0.0] * len(ids), over_budget="end")
            if not conv.done:
                conv.add_env_outcome(EnvOutcome(check_step(env.step(text))))
        return Demonstration(tuple(conv.ids), tuple(bool(m) for m in conv.loss_mask))

    return example


def held_out_episodes(
    run: EnvRun, cfg: ExperimentConfig, tokenizer: Tokenizer, seed: int
) -> tuple[list[PromptPayload], EnvTurnDriver]:
    """``eval.num_prompts`` held-out episodes of ``seed`` (their first observations, reset once
    through the run's pool) and a turn driver of their own, for the held-out evaluation."""
    r = cfg.rollout
    prompts = EnvPrompts(
        run.pool,
        tokenizer,
        run.limits,
        r.max_prompt_len,
        r.max_new_tokens,
        seed,
        skip=cfg.data.long_prompts == "skip",
    )
    payloads = [prompts.next_prompt().payload for _ in range(cfg.eval.num_prompts)]
    return payloads, EnvTurnDriver(run.pool, tokenizer, run.limits, cfg.env.reward)
