"""Held-out evaluation: the current policy on a fixed set of problems it never trains on.

The per-step training reward of an asynchronous run mixes policy quality with which prompts
happen to finish first (short ones come back early), so it is a noisy and biased view of
learning. :class:`Evaluator` instead samples one response (``eval.samples_per_prompt=k``: k
responses) to each of ``num_prompts`` fixed held-out problems, with the same per-problem sampling
keys at every evaluation, so two evaluations differ only through the policy (paired,
low-variance comparisons). With k > 1 it also reports mean@k (the mean reward of the k samples,
averaged over problems) and pass@j for j = 1, 2, 4, ..., k: the chance that at least one of j
samples is solved, from the unbiased estimator ``1 - C(k - c, j) / C(k, j)`` with c solved
samples of k (Chen et al., 2021), averaged over problems. Every response comes back as text too
(:attr:`EvalResult.samples`: prompt, response, reward and correctness per problem and sample,
the rows of ``eval_samples.jsonl``; :mod:`dora_jax.pipeline.samples`).

It owns a small engine on one device of the trainer submesh and runs between train steps, so it
never touches the rollout groups, their requests or any random stream of the run.

A multi-turn run evaluates on held-out episodes of its environment (``conversations``: their
first observations as prompt payloads, and a turn driver of its own over the run's environment
pool): each sample plays its episode to the end, the environment answering every model turn;
its reward is the episode's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from dora_jax import faults
from dora_jax.config import ModelConfig, RolloutConfig
from dora_jax.data.examples import Example
from dora_jax.data.reward_pool import Outcome
from dora_jax.data.scoring import Scorer, with_finish_reason
from dora_jax.execution.payloads import PromptPayload
from dora_jax.execution.turns import TurnDriver
from dora_jax.mesh import make_mesh
from dora_jax.model.params import Params
from dora_jax.model.tokenizer import Tokenizer, encode_prompt, eos_ids, response_ids
from dora_jax.pipeline import samples
from dora_jax.rollout.engine import Engine
from dora_jax.rollout.requests import EngineFinished, Request, request_key

_EVAL_STREAM = 0x45564C  # keeps evaluation keys apart from the run's request keys


@dataclass(frozen=True)
class EvalResult:
    step: int
    reward: float  # mean reward over the held-out problems
    solved: float  # share with full reward
    response_len: float  # mean response tokens
    seconds: float
    at_k: dict[str, float] = field(default_factory=dict)  # "mean@k", "pass@j" (k > 1 samples)
    scores: tuple[tuple[float, ...], ...] = ()  # [problem][sample] rewards (not logged)
    # one row per problem and sample: texts, reward, correctness (eval_samples.jsonl, not in
    # eval.jsonl; dora_jax.pipeline.samples)
    samples: tuple[dict, ...] = ()

    @classmethod
    def from_metrics(cls, step: int, m: dict[str, float]) -> EvalResult:
        """The inverse of :meth:`metrics` (a line of ``eval.jsonl``)."""
        at_k = {k[len("eval/") :]: v for k, v in m.items() if "@" in k}
        return cls(
            step,
            m["eval/reward"],
            m["eval/solved"],
            m["eval/response_len"],
            m["eval/seconds"],
            at_k,
        )

    def metrics(self) -> dict[str, float]:
        return {
            "eval/reward": self.reward,
            "eval/solved": self.solved,
            "eval/response_len": self.response_len,
            "eval/seconds": self.seconds,
            **{f"eval/{k}": v for k, v in self.at_k.items()},
        }


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are solved."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def at_k_metrics(scores: np.ndarray) -> dict[str, float]:
    """``mean@k`` and ``pass@j`` (j = 1, 2, 4, ..., and k) from ``scores[problem, sample]``;
    a sample is solved when its reward is full (>= 1)."""
    k = scores.shape[1]
    solved = (scores >= 1.0).sum(axis=1)
    out = {f"mean@{k}": float(scores.mean())}
    js = sorted({2**i for i in range(k.bit_length()) if 2**i <= k} | {k})
    for j in js:
        out[f"pass@{j}"] = float(np.mean([pass_at_k(k, int(c), j) for c in solved]))
    return out


class Evaluator:
    def __init__(
        self,
        model_cfg: ModelConfig,
        rollout_cfg: RolloutConfig,
        device: jax.Device,
        tokenizer: Tokenizer,
        problems: Sequence[tuple[str, str] | Example],  # (prompt, reference answer)
        reward_fn: Scorer | Callable[[str, str], float],
        seed: int,
        *,
        encode: Callable[[object], list[int]] | None = None,  # prompt -> ids (chat template)
        samples_per_prompt: int = 1,
        conversations: tuple[Sequence[PromptPayload], TurnDriver] | None = None,
    ):
        self.payloads, self.driver = conversations if conversations else (None, None)
        if self.payloads is not None:
            problems = [Example(p.tokens, p.answer, p.metadata or {}) for p in self.payloads]
        if not problems:
            raise ValueError("an evaluation needs at least one problem")
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        self.tokenizer, self.seed, self.k = tokenizer, seed, samples_per_prompt
        self.scorer = reward_fn if isinstance(reward_fn, Scorer) else Scorer(reward_fn)
        examples = [p if isinstance(p, Example) else Example(*p) for p in problems]
        self.references = [ex.answer for ex in examples]
        self.metadata = [ex.metadata or None for ex in examples]
        encode = encode or (lambda p: encode_prompt(tokenizer, p))
        if self.payloads is not None:
            self.prompts = [list(p.tokens) for p in self.payloads]
        else:
            self.prompts = [encode(ex.prompt) for ex in examples]
        # (problem i, sample j) in scores[i, j] order; its request id is j * n + i
        self.order = [(i, j) for i in range(len(self.prompts)) for j in range(self.k)]
        longest = max(len(p) for p in self.prompts)
        if longest > rollout_cfg.max_prompt_len:
            raise ValueError(
                f"an evaluation prompt has {longest} tokens; rollout.max_prompt_len is "
                f"{rollout_cfg.max_prompt_len}"
            )
        # Enough slots and pages for a wide batch; results need not be batch-invariant here
        # (nothing migrates), so the engine may use its cheaper shape buckets.
        slots = min(64, len(problems) * samples_per_prompt)
        pages_per_request = -(-(longest + rollout_cfg.max_new_tokens) // rollout_cfg.page_size)
        cfg = dataclasses.replace(
            rollout_cfg,
            max_slots=slots,
            num_pages=slots * pages_per_request + 1,
            batch_invariant=False,
            decode_steps=max(rollout_cfg.decode_steps, 8),
        )
        self.max_new_tokens = cfg.max_new_tokens
        self._prompt_texts: list[str] | None = None
        self.engine = Engine(model_cfg, cfg, make_mesh([device], 1, 1), eos_ids(tokenizer))

    def __call__(self, params: Params, step: int) -> EvalResult:
        t0 = time.perf_counter()
        self.engine.load_params(params, step)
        if self.payloads is not None:
            return self._conversations(step, t0)
        n = len(self.prompts)
        # sample j of problem i is request j * n + i; the first sample's key is the one a
        # single-sample evaluation uses, so k = 1 is unchanged
        self.engine.submit(
            Request(j * n + i, list(p), step, self._key(i, j), self.max_new_tokens)
            for j in range(self.k)
            for i, p in enumerate(self.prompts)
        )
        sampled: dict[int, EngineFinished] = {}
        faults.point("eval")
        while self.engine.num_requests:
            for f in self.engine.step().finished:
                sampled[f.id] = f
        responses = {rid: response_ids(self.tokenizer, f.tokens) for rid, f in sampled.items()}
        lens = [len(r) for r in responses.values()]
        reasons = {rid: f.finish_reason for rid, f in sampled.items()}
        texts, outcomes = self._scored(responses, reasons)
        rows = [
            {
                **self._row_head(i, j),
                "response": text,
                **self._row_tail(i, o, o.score, sampled[j * n + i]),
            }
            for (i, j), text, o in zip(self.order, texts, outcomes, strict=True)
        ]
        return self._result(step, t0, [o.score for o in outcomes], lens, rows)

    def _conversations(self, step: int, t0: float) -> EvalResult:
        """Play every held-out episode to its end (``k`` samples each), the driver answering
        each model turn; rewards are the episodes' (or the reward function's of the text)."""
        n, driver = len(self.prompts), self.driver
        requests = []
        for j in range(self.k):
            for i, payload in enumerate(self.payloads):
                r = Request(
                    j * n + i,
                    list(payload.tokens),
                    step,
                    self._key(i, j),
                    payload.max_new_tokens or self.max_new_tokens,
                    multi_turn=True,
                    stop_seqs=driver.stop_sequences,
                )
                driver.begin(r.id, payload)
                requests.append(r)
        self.engine.submit(requests)
        ended: dict[int, tuple] = {}  # id -> (turn-end record, outcome)
        last: dict[int, object] = {}
        faults.point("eval")
        while self.engine.num_requests:
            if self.engine.has_work:
                for rec in self.engine.step().turn_ends:
                    last[rec.id] = rec
                    driver.turn_ended(rec.id, rec.tokens, rec.logprobs, rec.turn_start)
            for o in driver.outcomes(wait=True):
                if o.over:
                    self.engine.end([o.request_id])
                    ended[o.request_id] = (last.pop(o.request_id), o)
                else:
                    self.engine.extend(o.request_id, o.observation)
        if driver.env_rewards:
            outcomes = [None] * len(self.order)
            flat = [ended[j * n + i][1].reward for i, j in self.order]
        else:
            _, outcomes = self._scored(
                {rid: r.tokens for rid, (r, _) in ended.items()},
                {rid: r.finish_reason for rid, (r, _) in ended.items()},
            )
            flat = [o.score for o in outcomes]
        rows = []
        for (i, j), o, reward in zip(self.order, outcomes, flat, strict=True):
            rec, turn = ended[j * n + i]
            end = (turn.figures or {}).get("end_reason") or "env"
            rows.append(
                {
                    **self._row_head(i, j),
                    **samples.response_text(self.tokenizer, rec.tokens, turn.loss_mask),
                    **self._row_tail(i, o, reward, rec, finish=end),
                }
            )
        model_tokens = [sum(o.loss_mask) for _, o in ended.values()]
        return self._result(step, t0, flat, model_tokens, rows)

    def _scored(
        self, responses: dict[int, list[int]], reasons: dict[int, str]
    ) -> tuple[list[str], list[Outcome]]:
        """The decoded responses (token ids and finish reasons by request id) and the reward
        function's outcomes of them, in ``order``."""
        n, decode = len(self.prompts), self.tokenizer.decode
        texts = [decode(responses[j * n + i]) for i, j in self.order]
        items = [
            (t, self.references[i], with_finish_reason(self.metadata[i], reasons[j * n + i]))
            for t, (i, j) in zip(texts, self.order, strict=True)
        ]
        return texts, self.scorer.score_many(items)

    def _row_head(self, i: int, j: int) -> dict:
        """An ``eval_samples.jsonl`` row's problem, sample and prompt text."""
        if self._prompt_texts is None:  # decoded once, at the first evaluation
            self._prompt_texts = [samples.prompt_text(self.tokenizer, p) for p in self.prompts]
        return {"problem": i, "sample": j, "prompt": self._prompt_texts[i]}

    def _row_tail(self, i: int, outcome, reward: float, f, finish: str | None = None) -> dict:
        """An ``eval_samples.jsonl`` row's answer, reward and its parts, length and end."""
        answer = self.references[i]
        return {
            "answer": answer if answer not in (None, "") else None,
            **samples.scoring(reward, outcome),
            "correct": reward >= 1.0,
            "response_len": len(f.tokens),
            "finish": finish or f.finish_reason,
        }

    def _result(
        self, step: int, t0: float, flat: list[float], lens: list[int], rows: list[dict]
    ) -> EvalResult:
        scores = np.array(flat, np.float64).reshape(len(self.prompts), self.k)
        return EvalResult(
            step=step,
            reward=float(scores.mean()),
            solved=float(np.mean(scores >= 1.0)),
            response_len=float(np.mean(lens)),
            seconds=time.perf_counter() - t0,
            at_k=at_k_metrics(scores) if self.k > 1 else {},
            scores=tuple(tuple(row) for row in scores.tolist()),
            samples=tuple(rows),
        )

    def _key(self, i: int, j: int) -> np.ndarray:
        if j == 0:
            return request_key(self.seed, _EVAL_STREAM, i)
        return request_key(self.seed, _EVAL_STREAM, i, j)
