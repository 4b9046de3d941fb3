"""Multi-turn (agentic) workloads: how many turns a conversation has, how long each model turn and
each observation is, and how long each environment call takes.

A conversation is one request whose response alternates model turns and environment turns: the
model writes turn 0, the environment answers (``latency`` seconds, then ``observation`` tokens
appended to the sequence), the model writes turn 1, and so on, up to its number of turns. Every
number is a pure function of ``(seed, prompt group, member, turn)``, so every mode, and every
run with the same seed, sees the same conversations whatever order they are admitted, migrated
or interrupted in. The draws are counter-based (a hash of those ids mapped to uniforms, and
through Box-Muller to normals), so nothing is cached per block of prompts however many turns a
conversation has.

- **Turns** per trajectory: ``median * exp(sigma * z)`` rounded (or, from a file of ``n``
  measured turn counts, sorted, the ``floor(n Phi(z))``-th: their own distribution), in
  ``[1, max_turns]``, with
  ``z = sqrt(c) * z_prompt + sqrt(1 - c) * z_own`` and ``z_prompt`` the prompt's difficulty, the
  one :class:`~dora_jax.sim.workload.ResponseLengths` gives its members' lengths: hard prompts get
  both more turns and longer ones.
- **Model tokens** of turn ``t``: turn 0 is the request's single-turn response length; later turns
  are drawn from the same distribution (the ``response`` section, per turn), with the same
  difficulty share.
- **Observation tokens** and **environment seconds** after model turn ``t``: log-normal (or
  measured seconds from a file, mapped by quantile), independent of the difficulty; with
  ``latency.per_prompt`` the seconds of call ``t`` are the same for every member of a prompt
  group. (How long a call waits for an environment worker, ``latency.workers``, is the
  backend's: :mod:`dora_jax.sim.waiting`.)
- The response (model and observation tokens) is cut at ``max_total_tokens``: a model turn that
  reaches it ends the conversation, and so does an observation that would.

:class:`ConversationFigures` are a run's figures about conversations (turns, environment time,
requests waiting on their environment and the KV they hold), computed by
:func:`conversation_figures` from what :class:`~dora_jax.sim.backend.SimBackend` recorded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dora_jax.sim.config import TurnsConfig
from dora_jax.sim.workload import Z99, ResponseLengths, _phi, read_numbers

# streams of the counter-based draws (one per random quantity)
_TURNS, _MODEL, _MIX, _OBS, _LATENCY = 1, 2, 3, 4, 5
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
US = 1_000_000  # environment times are kept in integer microseconds


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit finalizer (splitmix64): every input bit affects every output bit."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def uniforms(*keys) -> np.ndarray:
    """Uniforms in (0, 1), a pure function of the integer ``keys`` (arrays broadcast)."""
    with np.errstate(over="ignore"):
        h = np.zeros((), np.uint64)
        for k in keys:
            h = _mix(h + _GOLDEN + np.asarray(k, dtype=np.int64).astype(np.uint64))
        return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def normals(*keys) -> np.ndarray:
    """Standard normals, a pure function of ``keys`` (Box-Muller over two uniform streams)."""
    u1, u2 = uniforms(*keys, 0), uniforms(*keys, 1)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


def load_seconds(path: str | Path) -> np.ndarray:
    """Measured environment seconds: one number per line."""
    return read_numbers(
        path,
        "environment latency",
        float,
        lambda v: v > 0 and math.isfinite(v),
        "seconds",
        "seconds must be finite and > 0",
    )


def load_turns(path: str | Path) -> np.ndarray:
    """Measured model turns per conversation: one integer >= 1 per line."""
    return read_numbers(
        path, "turn count", int, lambda v: v >= 1, "a number of turns", "turns must be >= 1"
    )


@dataclass(frozen=True)
class TrajectoryPlan:
    """The whole of some conversations, one entry each (what :class:`Conversations` draws)."""

    turns: np.ndarray  # model turns it gets (after the token cap)
    model_tokens: np.ndarray
    observation_tokens: np.ndarray
    env_s: np.ndarray  # environment seconds, all its calls together

    @property
    def response_tokens(self) -> np.ndarray:
        return self.model_tokens + self.observation_tokens


class Conversations:
    """The multi-turn workload of one run: see the module docstring."""

    def __init__(self, cfg: TurnsConfig, lengths: ResponseLengths, seed: int = 0):
        self.cfg, self.lengths, self.seed = cfg, lengths, int(seed)
        self.group_size = lengths.group_size
        self._measured = load_seconds(cfg.latency.path) if cfg.latency.kind == "file" else None
        self._turns = load_turns(cfg.path) if cfg.kind == "file" else None

    def _ids(self, pg, members) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(pg, dtype=np.int64), np.asarray(members, dtype=np.int64)

    def turns(self, pg, members) -> np.ndarray:
        """Model turns each conversation is given (before the token cap)."""
        pg, j = self._ids(pg, members)
        c = self.cfg
        zp = self.lengths.difficulty(pg)
        z = math.sqrt(c.prompt_corr) * zp + math.sqrt(1.0 - c.prompt_corr) * normals(
            self.seed, _TURNS, pg, j
        )
        if self._turns is not None:  # the measured counts' own distribution: no interpolation
            data = self._turns
            x = data[np.minimum((_phi(z) * len(data)).astype(np.int64), len(data) - 1)]
        else:
            x = c.median * np.exp(math.log(c.p99_ratio) / Z99 * z)
        return np.clip(np.rint(x), 1, c.max_turns).astype(np.int64)

    def model_tokens(self, pg, members, turn) -> np.ndarray:
        """Tokens of model turn ``turn``: turn 0 is the single-turn response length."""
        pg, j = self._ids(pg, members)
        turn = np.broadcast_to(np.asarray(turn, dtype=np.int64), pg.shape)
        out = self.lengths.lengths(pg, j)
        later = turn > 0
        if later.any():
            p, m, t = pg[later], j[later], turn[later]
            corr = self.lengths.cfg.prompt_corr
            z = math.sqrt(corr) * self.lengths.difficulty(p) + math.sqrt(1.0 - corr) * normals(
                self.seed, _MODEL, p, m, t
            )
            u = uniforms(self.seed, _MIX, p, m, t)
            out[later] = self.lengths.from_normal(z, u)
        return out

    def observation_tokens(self, pg, members, turn) -> np.ndarray:
        """Tokens the environment appends after model turn ``turn``."""
        pg, j = self._ids(pg, members)
        o = self.cfg.observation
        z = normals(self.seed, _OBS, pg, j, turn)
        x = o.median * np.exp(math.log(o.p99_ratio) / Z99 * z)
        return np.clip(np.rint(x), 1, o.max_tokens).astype(np.int64)

    def latency_us(self, pg, members, turn) -> np.ndarray:
        """Microseconds the environment call after model turn ``turn`` takes (>= 1)."""
        pg, j = self._ids(pg, members)
        lat = self.cfg.latency
        if lat.per_prompt:  # one draw per (prompt group, call), whichever member makes it
            j = np.full(j.shape, -1, np.int64)
        if self._measured is not None:
            data = self._measured
            u = uniforms(self.seed, _LATENCY, pg, j, turn, 2)
            s = np.interp(u * (len(data) - 1), np.arange(len(data)), data)
        else:
            z = normals(self.seed, _LATENCY, pg, j, turn)
            s = lat.median_s * np.exp(math.log(lat.p99_ratio) / Z99 * z)
        s = np.minimum(s, lat.max_s)
        return np.maximum(np.rint(s * US), 1).astype(np.int64)

    def first_target(self, pg, members) -> np.ndarray:
        """Response tokens at the end of model turn 0."""
        return np.minimum(self.model_tokens(pg, members, 0), self.cfg.max_total_tokens)

    def after_turn(self, pg, members, turn, gen) -> tuple[np.ndarray, ...]:
        """What follows model turn ``turn`` of conversations holding ``gen`` response tokens:
        ``(goes_on, observation tokens, environment microseconds, response tokens at the end of
        the next model turn)``; the last three are meaningful where ``goes_on``."""
        pg, j = self._ids(pg, members)
        turn = np.asarray(turn, dtype=np.int64)
        gen = np.asarray(gen, dtype=np.int64)
        cap = self.cfg.max_total_tokens
        obs = self.observation_tokens(pg, j, turn)
        goes_on = (turn + 1 < self.turns(pg, j)) & (gen + obs < cap)
        nxt = self.model_tokens(pg, j, turn + 1)
        target = np.minimum(gen + obs + nxt, cap)
        return goes_on, obs, self.latency_us(pg, j, turn), target

    def plan(self, pg, members) -> TrajectoryPlan:
        """Every conversation ``(pg[i], members[i])`` from its first turn to its last, by the same
        rule the backend follows turn by turn."""
        pg, j = self._ids(pg, members)
        gen = self.first_target(pg, j)
        turns = np.ones(pg.shape, np.int64)
        obs_total = np.zeros(pg.shape, np.int64)
        env = np.zeros(pg.shape, np.int64)
        alive = np.ones(pg.shape, bool)
        for t in range(self.cfg.max_turns - 1):
            idx = np.nonzero(alive)[0]
            if not len(idx):
                break
            goes, obs, lat, target = self.after_turn(pg[idx], j[idx], t, gen[idx])
            on = idx[goes]
            obs_total[on] += obs[goes]
            env[on] += lat[goes]
            gen[on] = target[goes]
            turns[on] += 1
            alive[idx[~goes]] = False
        return TrajectoryPlan(turns, gen - obs_total, obs_total, env / US)

    def sample(self, num_prompt_groups: int, first: int = 0) -> TrajectoryPlan:
        """The conversations of prompt groups ``first .. first + n - 1`` (member-major)."""
        pg = np.repeat(np.arange(first, first + num_prompt_groups), self.group_size)
        j = np.tile(np.arange(self.group_size), num_prompt_groups)
        return self.plan(pg, j)


def conversation_stats(conv: Conversations, batch_prompts: int, batches: int = 8) -> dict:
    """Summary of ``batches`` batches of ``batch_prompts`` prompt groups of conversations:
    turns, model / observation / response tokens and environment seconds per trajectory
    (median, p99, mean), and the share cut by the token cap."""
    p = conv.sample(batch_prompts * batches)
    out: dict = {}
    for name, x in (
        ("turns", p.turns),
        ("model_tokens", p.model_tokens),
        ("observation_tokens", p.observation_tokens),
        ("response_tokens", p.response_tokens),
        ("env_s", p.env_s),
    ):
        x = np.asarray(x, dtype=np.float64)
        out[name] = {
            "median": float(np.median(x)),
            "p99": float(np.percentile(x, 99)),
            "mean": float(x.mean()),
            "max": float(x.max()),
        }
    out["capped_share"] = float(np.mean(p.response_tokens >= conv.cfg.max_total_tokens))
    return out


@dataclass(frozen=True)
class ConversationFigures:
    """A run's conversation figures over the same span as its other figures.

    Per consumed trajectory: model turns (mean, p99, max), model and observation tokens (mean),
    environment seconds (mean, p99). ``model_tokens_per_s``: model tokens of the consumed
    trajectories per modeled second (the throughput of an agentic run; ``tokens_per_s`` of
    :class:`~dora_jax.sim.run.SimMetrics` counts observation tokens too). Over the span's ticks:
    requests waiting on their environment (mean, max), the KV tokens they hold (mean, max, and
    the mean as a share of the rollout groups' KV capacity), and ``env_wait_frac``: group-seconds
    a group spent idle while its requests waited on their environments / group-seconds (part of
    the bubble). ``reprefill_tokens``: tokens prefilled again after an interrupt (``partial``).
    """

    trajectories: int
    turns_mean: float
    turns_p99: float
    turns_max: int
    model_tokens_mean: float
    observation_tokens_mean: float
    env_s_mean: float
    env_s_p99: float
    model_tokens_per_s: float
    waiting_mean: float
    waiting_max: int
    waiting_kv_tokens_mean: float
    waiting_kv_tokens_max: int
    waiting_kv_frac_mean: float
    env_wait_frac: float
    reprefill_tokens: int


def conversation_figures(backend, records, consumed, t0: int, t1: int, span_s: float):
    """:class:`ConversationFigures` of the ``consumed`` trajectories (``ConsumedRecord``) and of
    ticks ``[t0, t1)`` of ``backend`` (a :class:`~dora_jax.sim.backend.SimBackend` with
    conversations) and its run's ``records``, ``span_s`` modeled seconds long."""
    done = backend.waiting.conversation_log()
    ids = np.array([c.request_id for c in consumed], np.int64)
    rows = np.searchsorted(done["rid"], ids) if len(ids) else np.zeros(0, np.int64)
    if len(ids) and not np.array_equal(done["rid"][np.minimum(rows, len(done["rid"]) - 1)], ids):
        raise ValueError("a consumed trajectory has no conversation record")
    turns, model = done["turns"][rows], done["model_tokens"][rows]
    obs, env = done["observation_tokens"][rows], done["env_us"][rows] / US
    waiting = np.asarray(backend.waiting.waiting_requests[t0:t1], np.int64).reshape(
        -1, backend.num_groups
    )
    kv = np.asarray(backend.waiting.waiting_kv[t0:t1], np.int64).reshape(-1, backend.num_groups)
    per_tick, kv_tick = waiting.sum(axis=1), kv.sum(axis=1)
    env_idle = float(np.sum(backend.waiting.env_wait_s[t0:t1]))
    capacity = backend.capacity * backend.num_groups

    def stat(f, x, empty=0.0):
        return float(f(x)) if len(x) else empty

    return ConversationFigures(
        trajectories=len(ids),
        turns_mean=stat(np.mean, turns),
        turns_p99=stat(lambda x: np.percentile(x, 99), turns),
        turns_max=int(turns.max()) if len(turns) else 0,
        model_tokens_mean=stat(np.mean, model),
        observation_tokens_mean=stat(np.mean, obs),
        env_s_mean=stat(np.mean, env),
        env_s_p99=stat(lambda x: np.percentile(x, 99), env),
        model_tokens_per_s=float(model.sum()) / span_s if span_s > 0 else 0.0,
        waiting_mean=stat(np.mean, per_tick),
        waiting_max=int(per_tick.max()) if len(per_tick) else 0,
        waiting_kv_tokens_mean=stat(np.mean, kv_tick),
        waiting_kv_tokens_max=int(kv_tick.max()) if len(kv_tick) else 0,
        waiting_kv_frac_mean=stat(np.mean, kv_tick) / capacity,
        env_wait_frac=env_idle / max(span_s * backend.num_groups, 1e-12),
        reprefill_tokens=sum(g.reprefill_tokens for row in records.groups[t0:t1] for g in row),
    )
