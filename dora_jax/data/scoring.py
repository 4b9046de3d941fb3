"""Scoring responses, with every failure of a reward function turned into reward 0 and counted.

:class:`Scorer` runs a reward function either inline (the cheap built-in ones) or in a
:class:`~dora_jax.data.reward_pool.RewardPool` of worker processes (``boxed_math`` and your own
functions), with one interface: :meth:`Scorer.prefetch` starts scoring a finished response at
once (it returns immediately), :meth:`Scorer.score_many` returns the outcomes of a batch (those
prefetched are usually ready by then), ``errors_by_kind`` counts the failures
(``timeout``, ``exception``, ``invalid``, ``crash``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any

from dora_jax.data.reward_functions import InvalidReward, arity, call, outcome
from dora_jax.data.reward_pool import ERROR_KINDS, Outcome, RewardPool

log = logging.getLogger(__name__)

Item = tuple[str, str, dict[str, Any] | None]  # (response, answer, metadata)


def with_finish_reason(metadata: dict[str, Any] | None, reason: str) -> dict[str, Any]:
    """The row's fields plus ``finish_reason``, how the response ended (``"eos"``; ``"length"``:
    cut at the token limit), which a reward function may read (for example, to give full
    credit only to an answer that ends properly). The row's own ``finish_reason`` field, if it
    has one, is shadowed."""
    return {**(metadata or {}), "finish_reason": reason}


class Scorer:
    def __init__(self, fn: Callable[..., Any] | None = None, pool: RewardPool | None = None):
        if (fn is None) == (pool is None):
            raise ValueError("a Scorer needs exactly one of a function and a pool")
        self.fn, self.pool = fn, pool
        self._n_args = arity(fn) if fn is not None else 3
        self.errors_by_kind: Counter[str] = Counter({k: 0 for k in ERROR_KINDS})
        self._pending: dict[Hashable, Future] = {}
        self._lock = threading.Lock()  # prefetch: the control loop; score_many: the trainer
        self._warned: set[str] = set()
        self.last_error: str | None = None  # "kind: message" of the newest failure

    @property
    def errors(self) -> int:
        return sum(self.errors_by_kind.values())

    def state_dict(self) -> dict[str, int]:
        """The failure counts (what a resumed run continues; scores in flight are redone)."""
        return self.error_counts()

    def load_state_dict(self, state: dict[str, int]) -> None:
        for k, n in state.items():
            self.errors_by_kind[k] = int(n)

    def error_counts(self) -> dict[str, int]:
        """Failures so far by kind (every kind present, 0 when none)."""
        return {k: int(self.errors_by_kind[k]) for k in ERROR_KINDS}

    def __call__(self, response: str, answer: str, metadata: dict | None = None) -> float:
        """The score of one response (0 on any failure, counted)."""
        return self.score_many([(response, answer, metadata)])[0].score

    def prefetch(self, key: Hashable, item: Item) -> None:
        """Start scoring ``item`` now (pool only; inline scoring waits for :meth:`score_many`)."""
        if self.pool is None:
            return
        with self._lock:
            if key not in self._pending:
                self._pending[key] = self.pool.submit(*item)

    def score_many(
        self, items: Sequence[Item], keys: Sequence[Hashable] | None = None
    ) -> list[Outcome]:
        """Outcomes of ``items`` in order; ``keys`` match earlier :meth:`prefetch` calls."""
        keys = keys if keys is not None else [None] * len(items)
        if self.pool is not None:
            with self._lock:
                found = [self._pending.pop(k, None) for k in keys]
            futures = [
                f if f is not None else self.pool.submit(*item)
                for f, item in zip(found, items, strict=True)
            ]
            outs = [f.result() for f in futures]
        else:
            outs = [self._inline(*item) for item in items]
        for out in outs:
            if out.error is not None:
                self.errors_by_kind[out.error] += 1
                self.last_error = f"{out.error}: {out.message}"
                if out.error not in self._warned:  # once per kind: a broken verifier is loud
                    self._warned.add(out.error)
                    log.warning(
                        "reward function failed (%s): %s; reward 0, counted in the metrics as "
                        "reward_errors/%s (data.on_failure says whether it enters its group's "
                        "baseline)",
                        out.error,
                        out.message,
                        out.error,
                    )
        return outs

    def _inline(self, response: str, answer: str, metadata: dict | None) -> Outcome:
        try:
            value = call(self.fn, self._n_args, response, answer, metadata or {})
        except Exception as e:  # a reward function may raise anything: count and go on
            return Outcome(0.0, error="exception", message=f"{type(e).__name__}: {e}")
        try:
            score, metrics = outcome(value)
        except InvalidReward as e:
            return Outcome(0.0, error="invalid", message=str(e))
        return Outcome(score, metrics)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
