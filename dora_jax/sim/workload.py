"""Simulated workloads: response lengths per request, prompt lengths per prompt.

Response lengths are a pure function of ``(seed, prompt group, member)``, so every mode, and every
run with the same seed, sees the same workload whatever order requests are admitted in. Draws
are made in blocks of prompt groups with one numpy generator per block (fast, order-free).

Each request gets a standard normal ``z = sqrt(c) * z_prompt + sqrt(1 - c) * z_own``: ``z_prompt``
is the prompt's difficulty, shared by its ``G`` samples, ``c = prompt_corr``. ``z`` is mapped to a
length by the configured distribution (log-normal: ``median * exp(sigma * z)`` with ``sigma =
ln(p99 / median) / 2.326``; file: the empirical quantile of ``Phi(z)``), then capped.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from dora_jax.orchestrator.rollout_manager import PromptSpec
from dora_jax.sim.config import PromptConfig, ResponseConfig

Z99 = 2.3263478740408408  # 0.99 quantile of the standard normal
_BLOCK = 256  # prompt groups per generator block


def _sigma(p99_ratio: float) -> float:
    return math.log(p99_ratio) / Z99


def _phi(z: np.ndarray) -> np.ndarray:
    """Standard normal CDF."""
    erf = np.frompyfunc(math.erf, 1, 1)
    return 0.5 * (1.0 + erf(z / math.sqrt(2.0)).astype(np.float64))


def read_numbers(path: str | Path, what: str, parse, check, unit: str, bound: str) -> np.ndarray:
    """The numbers of a measurement file, sorted: one per line (blank lines and ``#`` comments
    skipped); ``parse`` reads one (``expected {unit}`` when it cannot), ``check`` says whether
    it is in range (``{bound}``)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} file {str(p)!r} does not exist")
    vals = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        s = line.split("#", 1)[0].strip()
        if not s:
            continue
        try:
            v = parse(s)
        except ValueError:
            raise ValueError(f"{p}:{i}: expected {unit}, got {s!r}") from None
        if not check(v):
            raise ValueError(f"{p}:{i}: {bound}, got {s}")
        vals.append(v)
    if not vals:
        raise ValueError(f"{p}: no {what} in the file")
    return np.sort(np.asarray(vals, dtype=np.float64))


def load_lengths(path: str | Path) -> np.ndarray:
    """Measured response lengths: one integer per line."""
    return read_numbers(
        path,
        "response length",
        lambda s: int(float(s)),
        lambda v: v > 0,
        "a token count",
        "token counts must be > 0",
    )


class ResponseLengths:
    """Response length of any (prompt group, member): see the module docstring."""

    def __init__(self, cfg: ResponseConfig, group_size: int, seed: int = 0):
        self.cfg = cfg
        self.group_size = group_size
        self.seed = seed
        self._blocks: dict[int, np.ndarray] = {}
        self._difficulty: dict[int, np.ndarray] = {}  # block -> z_prompt, shape (_BLOCK,)
        self._empirical = load_lengths(cfg.path) if cfg.kind == "file" else None

    def _map(self, z: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Lengths of standard normals ``z`` (``u``: uniforms that pick the mixture's tail)."""
        c = self.cfg
        if c.kind == "file":
            q = _phi(z)
            data = self._empirical
            x = np.interp(q * (len(data) - 1), np.arange(len(data)), data)
        else:
            x = c.median * np.exp(_sigma(c.p99_ratio) * z)
            if c.kind == "mixture" and c.tail_weight > 0:
                tail = c.tail_median * np.exp(_sigma(c.tail_p99_ratio) * z)
                x = np.where(u < c.tail_weight, tail, x)
        return np.clip(np.rint(x), 1, c.max_tokens).astype(np.int64)

    def _block(self, b: int) -> np.ndarray:
        arr = self._blocks.get(b)
        if arr is None:
            rng = np.random.default_rng([self.seed, 0x5EED, b])
            zp = rng.standard_normal((_BLOCK, 1))
            zo = rng.standard_normal((_BLOCK, self.group_size))
            u = rng.random((_BLOCK, self.group_size))
            c = self.cfg.prompt_corr
            z = math.sqrt(c) * zp + math.sqrt(1.0 - c) * zo
            arr = self._map(z, u)
            self._blocks[b] = arr
            self._difficulty[b] = zp[:, 0]
        return arr

    def difficulty(self, prompt_groups: np.ndarray) -> np.ndarray:
        """``z_prompt`` of each prompt group: the standard normal its members' lengths share."""
        pg = np.asarray(prompt_groups, dtype=np.int64)
        out = np.empty(pg.shape, dtype=np.float64)
        blocks = pg // _BLOCK
        for b in np.unique(blocks):
            sel = blocks == b
            self._block(int(b))
            out[sel] = self._difficulty[int(b)][pg[sel] % _BLOCK]
        return out

    def from_normal(self, z: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Lengths of the configured distribution at standard normals ``z`` (``u``: uniforms in
        [0, 1) that pick the mixture's tail), capped: the map every drawn length goes through."""
        return self._map(np.asarray(z, dtype=np.float64), np.asarray(u, dtype=np.float64))

    def lengths(self, prompt_groups: np.ndarray, members: np.ndarray) -> np.ndarray:
        """Lengths of the requests ``(prompt_groups[i], members[i])``."""
        pg = np.asarray(prompt_groups, dtype=np.int64)
        j = np.asarray(members, dtype=np.int64)
        out = np.empty(pg.shape, dtype=np.int64)
        blocks = pg // _BLOCK
        for b in np.unique(blocks):
            sel = blocks == b
            out[sel] = self._block(int(b))[pg[sel] % _BLOCK, j[sel]]
        return out

    def sample(self, num_prompt_groups: int, first: int = 0) -> np.ndarray:
        """Lengths of prompt groups ``first .. first + n - 1``, shape ``(n, G)``."""
        pg = np.repeat(np.arange(first, first + num_prompt_groups), self.group_size)
        j = np.tile(np.arange(self.group_size), num_prompt_groups)
        return self.lengths(pg, j).reshape(num_prompt_groups, self.group_size)


class SimPrompts:
    """A :class:`~dora_jax.orchestrator.rollout_manager.PromptStream` of prompt lengths only:
    log-normal (``median``, ``p99_ratio``) clipped to ``[min_tokens, max_tokens]``, one sequence
    per seed (the i-th prompt handed out is the same in every mode)."""

    def __init__(self, cfg: PromptConfig, seed: int = 0):
        self.cfg = cfg
        self._rng = np.random.default_rng([seed, 0x9E0])
        self._buf: list[int] = []

    def next_prompt(self) -> PromptSpec:
        if not self._buf:
            c = self.cfg
            x = c.median * np.exp(_sigma(c.p99_ratio) * self._rng.standard_normal(4096))
            self._buf = np.clip(np.rint(x), c.min_tokens, c.max_tokens).astype(int).tolist()[::-1]
        return PromptSpec(self._buf.pop())


def workload_stats(lengths: ResponseLengths, batch_prompts: int, batches: int = 8) -> dict:
    """Summary of the response lengths of ``batches`` batches of ``batch_prompts`` prompt
    groups: median, p99, mean, share capped, and the synchronous inter-node bubble of the paper's
    appendix C.3, ``mean_i (max L - L_i) / max L`` within a batch (averaged over batches)."""
    x = lengths.sample(batch_prompts * batches).reshape(batches, -1).astype(np.float64)
    flat = x.ravel()
    bubble = float(np.mean(1.0 - x.mean(axis=1) / x.max(axis=1)))
    med = float(np.median(flat))
    return {
        "median": med,
        "p99": float(np.percentile(flat, 99)),
        "p99_over_median": float(np.percentile(flat, 99) / med),
        "mean": float(flat.mean()),
        "max": float(flat.max()),
        "capped_share": float(np.mean(flat >= lengths.cfg.max_tokens)),
        "sync_inter_node_bubble": bubble,
    }
