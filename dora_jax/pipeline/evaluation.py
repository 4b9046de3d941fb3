"""Held-out evaluation: the current policy on a fixed set of problems it never trains on.

The per-step training reward of an asynchronous run mixes policy quality with which prompts
happen to finish first (short ones come back early), so it is a noisy and biased view of
learning. :class:`Evaluator` instead samples one response to each of ``num_prompts`` fixed
held-out problems, with the same per-problem sampling keys at every evaluation, so two
evaluations differ only through the policy (paired, low-variance comparisons).

It owns a small engine on one device of the trainer submesh and runs between train steps, so it
never touches the rollout groups, their requests or any random stream of the run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from dora_jax import faults
from dora_jax.config import ModelConfig, RolloutConfig
from dora_jax.mesh import make_mesh
from dora_jax.model.params import Params
from dora_jax.model.tokenizer import Tokenizer, encode_prompt, response_ids
from dora_jax.rollout.engine import Engine
from dora_jax.rollout.requests import Request, request_key

_EVAL_STREAM = 0x45564C  # keeps evaluation keys apart from the run's request keys


@dataclass(frozen=True)
class EvalResult:
    step: int
    reward: float  # mean reward over the held-out problems
    solved: float  # share with full reward
    response_len: float  # mean response tokens
    seconds: float

    @classmethod
    def from_metrics(cls, step: int, m: dict[str, float]) -> EvalResult:
        """The inverse of :meth:`metrics` (a line of ``eval.jsonl``)."""
        return cls(step, m["eval/reward"], m["eval/solved"], m["eval/response_len"],
                   m["eval/seconds"])  # fmt: skip

    def metrics(self) -> dict[str, float]:
        return {
            "eval/reward": self.reward,
            "eval/solved": self.solved,
            "eval/response_len": self.response_len,
            "eval/seconds": self.seconds,
        }


def binomial_se(p: float, n: int) -> float:
    """Standard error of a share ``p`` measured on ``n`` independent problems."""
    return float(np.sqrt(max(p * (1 - p), 0.0) / max(n, 1)))


class Evaluator:
    def __init__(
        self,
        model_cfg: ModelConfig,
        rollout_cfg: RolloutConfig,
        device: jax.Device,
        tokenizer: Tokenizer,
        problems: Sequence[tuple[str, str]],  # (prompt text, reference answer)
        reward_fn: Callable[[str, str], float],
        seed: int,
    ):
        if not problems:
            raise ValueError("an evaluation needs at least one problem")
        self.tokenizer, self.reward_fn, self.seed = tokenizer, reward_fn, seed
        self.references = [ref for _, ref in problems]
        self.prompts = [encode_prompt(tokenizer, p) for p, _ in problems]
        longest = max(len(p) for p in self.prompts)
        if longest > rollout_cfg.max_prompt_len:
            raise ValueError(
                f"an evaluation prompt has {longest} tokens; rollout.max_prompt_len is "
                f"{rollout_cfg.max_prompt_len}"
            )
        # Enough slots and pages for a wide batch; results need not be batch-invariant here
        # (nothing migrates), so the engine may use its cheaper shape buckets.
        slots = min(64, len(problems))
        pages_per_request = -(-(longest + rollout_cfg.max_new_tokens) // rollout_cfg.page_size)
        cfg = dataclasses.replace(
            rollout_cfg,
            max_slots=slots,
            num_pages=slots * pages_per_request + 1,
            batch_invariant=False,
            decode_steps=max(rollout_cfg.decode_steps, 8),
        )
        self.max_new_tokens = cfg.max_new_tokens
        self.engine = Engine(model_cfg, cfg, make_mesh([device], 1, 1), tokenizer.eos_id)

    def __call__(self, params: Params, step: int) -> EvalResult:
        t0 = time.perf_counter()
        self.engine.load_params(params, step)
        self.engine.submit(
            Request(i, list(p), step, request_key(self.seed, _EVAL_STREAM, i), self.max_new_tokens)
            for i, p in enumerate(self.prompts)
        )
        responses: dict[int, list[int]] = {}
        faults.point("eval")
        while self.engine.num_requests:
            for f in self.engine.step().finished:
                responses[f.id] = response_ids(self.tokenizer, f.tokens)
        rewards = [
            self.reward_fn(self.tokenizer.decode(responses[i]), ref)
            for i, ref in enumerate(self.references)
        ]
        return EvalResult(
            step=step,
            reward=float(np.mean(rewards)),
            solved=float(np.mean([r >= 1.0 for r in rewards])),
            response_len=float(np.mean([len(r) for r in responses.values()])),
            seconds=time.perf_counter() - t0,
        )
