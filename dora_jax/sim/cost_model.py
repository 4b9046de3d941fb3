"""How long things take on a modeled cluster: roofline formulas over a model and a device preset.

A rollout *group* is ``tp`` devices running one engine (tensor parallel inside). Notation: P
total / active parameters (bytes per parameter ``b``), ``kvb`` KV bytes per token, ``A`` attention
FLOPs per (query, key) pair, ``L`` all-reduces per forward, ``D`` hidden size; device peak ``F``,
HBM bandwidth ``B``, scale-up link ``W``, scale-out link ``N``; efficiencies ``e_*``.

- **Decode step** with ``n`` requests holding ``C`` context tokens in all::

      t = max(mem, compute) + comm + overhead
      mem     = (weight bytes streamed(n) + C * kvb) / (tp * B * e_hbm)
      compute = (2 * P_active * n + A * C) / (tp * F * e_decode)
      comm    = L * (lat + 2 (tp-1)/tp * n * D * 2 bytes / (W * e_comm))   (tp > 1)

  Dense: every weight is streamed once per step; MoE: the shared part plus the experts the batch
  touches, ``1 - (1 - a/E)^n`` of them (``a`` active of ``E`` experts per token).
- **Prefill** of ``T`` tokens with ``Q`` causal (query, key) pairs (``(b^2 - a^2)/2`` for a
  request going from ``a`` to ``b`` cached tokens), in ``ceil(T / chunk)`` forwards::

      t = max((2 * P_active * T + A * Q) / (tp * F * e_prefill), chunks * weight bytes / (tp * B))
          + chunks * L * lat + L * 2 (tp-1)/tp * T * D * 2 / (W * e_comm)

- **Weight transfer** into a group: ``lat_w + P_total * b / (tp * N * e_comm)`` (each of the
  ``tp`` ranks receives its shard over its own link). **KV migration** of ``C`` tokens:
  ``lat_kv + C * kvb / (tp * N * e_comm)``.
- **Train step** on ``g`` devices, sequences of ``S_i`` tokens (prompt + response)::

      t = sum_i [ (6 + 2 f) P_active S_i + (3 + f) A S_i^2 / 2 ] / (g * F * e_train) + overhead

  ``f`` forward passes of experience preparation (old log-probs, reference), 6 = forward and
  backward (PaLM, Chowdhery et al. 2022, appendix B: 6N per token plus attention).
- **KV capacity** of a group: ``(tp * HBM * mem_util - P_total * b) / kvb`` tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dora_jax.sim.config import EfficiencyConfig
from dora_jax.sim.hardware import Hardware
from dora_jax.sim.models import ModelSpec

ACT_BYTES = 2  # bf16 activations in TP all-reduces


@dataclass(frozen=True)
class CostModel:
    model: ModelSpec
    hw: Hardware
    tp: int
    eff: EfficiencyConfig
    mem_util: float = 0.8

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.kv_capacity_tokens < 1:
            need = self.model.weight_bytes / (self.hw.hbm_bytes * self.mem_util)
            raise ValueError(
                f"{self.model.name} does not fit on {self.tp} x {self.hw.name} at mem_util "
                f"{self.mem_util}: its weights alone need {need:.1f} devices"
            )

    # -- memory ----------------------------------------------------------------------------------

    @property
    def kv_capacity_tokens(self) -> int:
        free = self.tp * self.hw.hbm_bytes * self.mem_util - self.model.weight_bytes
        return int(free // self.model.kv_bytes_per_token)

    def weight_bytes_streamed(self, n: np.ndarray | float) -> np.ndarray:
        """Weight bytes one decode step reads for a batch of ``n`` requests."""
        m = self.model
        n = np.asarray(n, dtype=np.float64)
        if not m.is_moe:
            return np.full_like(n, m.weight_bytes)
        touched = 1.0 - (1.0 - m.active_experts / m.num_experts) ** np.maximum(n, 0.0)
        shared = (m.params_total - m.expert_params) * m.bytes_per_param
        return shared + m.expert_params * m.bytes_per_param * touched

    # -- rollout -----------------------------------------------------------------------------------

    def _allreduce_s(self, tokens: np.ndarray | float, count: float) -> np.ndarray:
        """``count`` TP all-reduces of ``tokens`` hidden vectors each (0 when tp == 1)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        if self.tp == 1:
            return np.zeros_like(tokens)
        ring = 2.0 * (self.tp - 1) / self.tp
        bw = self.hw.intra_bw * self.eff.comm
        per = ring * tokens * self.model.hidden * ACT_BYTES / bw
        return count * self.eff.allreduce_latency_s + self.model.allreduces_per_forward * per

    def decode_step_s(self, n: np.ndarray | float, ctx: np.ndarray | float) -> np.ndarray:
        """Seconds of one decode step for ``n`` requests holding ``ctx`` context tokens in all."""
        m, hw, e = self.model, self.hw, self.eff
        n = np.asarray(n, dtype=np.float64)
        ctx = np.asarray(ctx, dtype=np.float64)
        mem = (self.weight_bytes_streamed(n) + ctx * m.kv_bytes_per_token) / (
            self.tp * hw.hbm_bw * e.hbm
        )
        compute = (2.0 * m.params_active * n + m.attn_flops_per_pair * ctx) / (
            self.tp * hw.peak_flops * e.decode_mfu
        )
        comm = self._allreduce_s(n, m.allreduces_per_forward)
        return np.maximum(mem, compute) + comm + e.step_overhead_s

    def prefill_s(self, tokens: np.ndarray | float, pairs: np.ndarray | float) -> np.ndarray:
        """Seconds to prefill ``tokens`` new tokens with ``pairs`` causal attention pairs."""
        m, hw, e = self.model, self.hw, self.eff
        tokens = np.asarray(tokens, dtype=np.float64)
        pairs = np.asarray(pairs, dtype=np.float64)
        chunks = np.ceil(tokens / e.prefill_chunk_tokens)
        compute = (2.0 * m.params_active * tokens + m.attn_flops_per_pair * pairs) / (
            self.tp * hw.peak_flops * e.prefill_mfu
        )
        mem = chunks * m.weight_bytes / (self.tp * hw.hbm_bw)
        comm = self._allreduce_s(tokens, chunks * m.allreduces_per_forward)
        return np.where(tokens > 0, np.maximum(compute, mem) + comm, 0.0)

    @staticmethod
    def causal_pairs(start: np.ndarray | float, end: np.ndarray | float) -> np.ndarray:
        """(query, key) pairs computed when a sequence's cache grows from ``start`` to ``end``."""
        start = np.asarray(start, dtype=np.float64)
        end = np.asarray(end, dtype=np.float64)
        return (end * end - start * start) / 2.0

    # -- moves -------------------------------------------------------------------------------------

    def weight_transfer_s(self) -> float:
        """Seconds to load a full set of weights into a group (from the trainer or a peer)."""
        bw = self.tp * self.hw.inter_bw * self.eff.comm
        return self.eff.weight_sync_latency_s + self.model.weight_bytes / bw

    def weight_trip_s(self) -> float:
        """Seconds a load from the trainer waits before its transfer, holding no device (none
        here: the latency is part of :meth:`weight_transfer_s`)."""
        return 0.0

    def kv_transfer_s(self, tokens: float) -> float:
        """Seconds to move the KV cache of ``tokens`` cached tokens between two groups."""
        bw = self.tp * self.hw.inter_bw * self.eff.comm
        return self.eff.kv_transfer_latency_s + tokens * self.model.kv_bytes_per_token / bw

    # -- training ----------------------------------------------------------------------------------

    def train_step_s(self, seq_lens: np.ndarray, devices: int) -> float:
        """Seconds of one train step (experience preparation included) on ``devices`` devices."""
        m, e = self.model, self.eff
        s = np.asarray(seq_lens, dtype=np.float64)
        f = e.exp_prep_forwards
        flops = (6.0 + 2.0 * f) * m.params_active * s.sum() + (3.0 + f) * m.attn_flops_per_pair * (
            (s * s).sum() / 2.0
        )
        return flops / (devices * self.hw.peak_flops * e.train_mfu) + e.train_step_overhead_s


@dataclass(frozen=True)
class MeasuredCost:
    """The cost model of a machine measured rather than derived (``benchmarks/calibrate_cpu.py``
    writes its constants): where the roofline does not hold, as for the default task's 78k-
    parameter model on a CPU, whose engine steps cost about the same whatever they hold (the
    engine's shapes are batch-invariant and overheads dominate). Same interface as
    :class:`CostModel`:

    - a decode step: ``decode_call_s / decode_steps`` (one engine call samples ``decode_steps``
      tokens per request);
    - a prefill: one engine call per ``max_slots`` requests of up to ``prefill_chunk_tokens``
      tokens each (``ceil(tokens / (max_slots * chunk))`` calls of ``prefill_call_s``);
    - a weight load, a KV move (any size here) and a train step: their measured times;
    - ``call_overhead_s`` (optional constant ``engine_call_overhead_s``): the host's own seconds
      per engine call where the engines run (reports, commands, other threads on that core),
      added to every decode and prefill call;
    - ``weight_trip_s`` (optional constant): a load from the trainer crossing processes waits
      this long before its own ``weight_load_s`` of work, holding no device meanwhile.
    """

    decode_call_s: float
    decode_steps: int
    prefill_call_s: float
    prefill_chunk_tokens: int
    max_slots: int
    weight_load_s: float
    kv_move_s: float
    train_step_fixed_s: float
    kv_capacity: int
    call_overhead_s: float = 0.0
    trip_s: float = 0.0

    @classmethod
    def from_file(cls, path: str | Path) -> MeasuredCost:
        """The ``constants`` of a ``calibrate_cpu.json``."""
        c = json.loads(Path(path).read_text())["constants"]
        return cls(
            decode_call_s=c["decode_step_s"],
            decode_steps=c["decode_steps_per_call"],
            prefill_call_s=c["prefill_step_s"],
            prefill_chunk_tokens=c["prefill_chunk_tokens"],
            max_slots=c["max_slots"],
            weight_load_s=c["weight_load_s"],
            kv_move_s=c["kv_move_s"],
            train_step_fixed_s=c["train_step_s"],
            kv_capacity=c["kv_capacity_tokens"],
            call_overhead_s=c.get("engine_call_overhead_s", 0.0),
            trip_s=c.get("weight_trip_s", 0.0),
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_capacity

    def decode_step_s(self, n: np.ndarray | float, ctx: np.ndarray | float) -> np.ndarray:
        n = np.asarray(n, dtype=np.float64)
        return np.full_like(n, (self.decode_call_s + self.call_overhead_s) / self.decode_steps)

    def prefill_s(self, tokens: np.ndarray | float, pairs: np.ndarray | float) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.float64)
        calls = np.ceil(tokens / (self.max_slots * self.prefill_chunk_tokens))
        return np.where(tokens > 0, calls * (self.prefill_call_s + self.call_overhead_s), 0.0)

    causal_pairs = staticmethod(CostModel.causal_pairs)

    def weight_transfer_s(self) -> float:
        return self.weight_load_s

    def weight_trip_s(self) -> float:
        return self.trip_s

    def kv_transfer_s(self, tokens: float) -> float:
        return self.kv_move_s

    def train_step_s(self, seq_lens: np.ndarray, devices: int) -> float:
        return self.train_step_fixed_s
