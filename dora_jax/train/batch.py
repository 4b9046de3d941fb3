"""Packing finished trajectories into fixed-shape train batches (host side, NumPy only).

Layout of a :class:`TrainBatch` (``B`` rows, ``T`` the length bucket, ``S = NG * G`` samples):

- Samples are ordered group-major: sample ``s`` is member ``s % G`` of prompt group ``s // G``.
  Per-sample arrays are ``[S]``; batch padding (fewer groups than ``num_groups``) is a whole masked
  group (``sample_mask`` false, reward 0, no tokens).
- Token arrays are ``[B, T]``. A sample occupies ``P + R`` consecutive slots of one row (prompt
  then response), with its own ``segment_ids`` value (1, 2, ... within the row; 0 is padding) and
  ``positions`` counting from 0, so attention stays causal within the sample. With
  ``packing="rows"`` every sample has its own row (``B = S``); with ``packing="tokens"`` samples
  are packed first-fit-decreasing into rows (several per row): ``cfg.pack_rows`` of them if set,
  else the fewest positions ``B x T`` over the length buckets ``T`` and the row counts ``B`` of
  :func:`row_ladder`, so the trainer's cost follows the real tokens while the step compiles for
  a bounded set of shapes.
- Per-token arrays are aligned with the position that *predicts* the token: at slot ``j`` of a
  sample, ``targets`` is the token at ``j + 1``; ``loss_mask`` is true exactly where that target is
  a response token the model sampled (so prompt tokens, a multi-turn conversation's environment
  turns, the last token and padding never enter the loss), and
  ``behavior_logprobs`` holds the engine's log-probability of that response token there.
  ``sample_index`` names the sample of every slot (``S`` for padding).
- Mixture-of-experts models also get ``routes int16[B, T, L, k]``: at slot ``j`` the experts the
  engine routed that slot's token to in each layer (recorded while sampling), -1 where nothing
  was recorded (the last token of a sample, never fed; padding; a trajectory without routes):
  the trainer
  can replay them (``train.routing_replay``) and reports how often its own router disagrees.
- ``T`` is one of ``TrainConfig.length_buckets`` (one sample per row: the smallest that fits),
  so the jitted step compiles once per (rows, bucket) shape, not once per maximum length.

Advantages are *not* computed here: the batch carries the raw ``rewards`` and the jitted step
computes group-relative advantages on device (:mod:`dora_jax.train.advantages`), since the
group-major order makes the groups a plain reshape ``[NG, G]``. ``valid`` marks the samples that
count (a trajectory's own ``valid``, false where ``data.on_failure`` drops a failed call's
trajectory or group): the others stay in the batch (consumed, counted, their tokens computed) but
are left out of their group's baseline and get no loss weight.

Bad input raises ``ValueError`` naming the trajectory: a non-finite reward or behavior
log-probability, a log-probability count that differs from the response length, an empty prompt,
a sample longer than the largest bucket, a prompt group with a missing or extra member, members
of one group with different versions, a version newer than the trainer's (negative staleness),
token ids outside the vocabulary, an empty trajectory list.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import flax.struct
import numpy as np

from dora_jax.config import TrainConfig
from dora_jax.model.attention import ROOT_SPAN


@dataclass(frozen=True)
class Trajectory:
    """A finished request with its reward (any object with these attributes is accepted)."""

    prompt_tokens: Sequence[int]
    response_tokens: Sequence[int]
    behavior_logprobs: Sequence[float]  # one per response token, recorded by the engine
    reward: float
    version: int  # the policy version that generated every token
    group_id: Hashable  # prompt group
    routes: Any = None  # MoE: int[P + R, L, k], the engine's experts per token (-1: not fed)
    # multi-turn: bool[R], true at the response tokens the model sampled (the loss covers
    # those; environment turns are context); None: all of them
    loss_mask: Any = None
    # false: left out of its group's baseline and of the loss (a failed reward or environment
    # call under data.on_failure=drop_sample or drop_group)
    valid: bool = True


def _per(axis: str, dtype: type) -> Any:
    """A :class:`TrainBatch` field laid out per ``token`` (``[B, T]``) or per ``sample``
    (``[S]``), of ``dtype``: what its shardings and abstract shapes are made from."""
    return flax.struct.field(metadata={"per": axis, "dtype": dtype})


@flax.struct.dataclass
class TrainBatch:
    """One fixed-shape train batch of NumPy (or device) arrays; a pytree."""

    tokens: Any = _per("token", np.int32)
    positions: Any = _per("token", np.int32)
    segment_ids: Any = _per("token", np.int32)  # 0 = padding
    targets: Any = _per("token", np.int32)  # next token
    loss_mask: Any = _per("token", np.bool_)  # target is a response token
    # the engine's log-prob of the target (0 off the mask)
    behavior_logprobs: Any = _per("token", np.float32)
    sample_index: Any = _per("token", np.int32)  # sample of the slot, S for padding
    rewards: Any = _per("sample", np.float32)
    sample_mask: Any = _per("sample", np.bool_)  # false for batch padding
    staleness: Any = _per("sample", np.int32)  # trainer version - trajectory version
    response_lens: Any = _per("sample", np.int32)
    routes: Any = None  # int16[B, T, L, k] MoE only: the engine's experts per token, -1 unknown
    # train.microbatch_tokens only: bool[M], the microbatches that hold samples (a prefix); the
    # step loops over those. Microbatch m is rows m, m + M, m + 2M, ...
    chunk_mask: Any = None
    # false for a sample left out of its group's baseline and of the loss (a failed call under
    # data.on_failure; batch padding); None: every sample of sample_mask counts
    valid: Any = flax.struct.field(default=None, metadata={"per": "sample", "dtype": np.bool_})

    @classmethod
    def laid_out(cls, per_token: Any, per_sample: Any, **rest: Any) -> TrainBatch:
        """A batch whose every per-token field is ``per_token(dtype)`` and every per-sample one
        ``per_sample(dtype)`` (shardings, abstract shapes), the others as ``rest`` gives them."""
        make = {"token": per_token, "sample": per_sample}
        laid = {f.name: make[f.metadata["per"]](f.metadata["dtype"]) for f in _LAID_OUT}
        return cls(**laid, **rest)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_samples(self) -> int:
        return self.rewards.shape[0]


_LAID_OUT = tuple(f for f in fields(TrainBatch) if "per" in f.metadata)  # per token or sample


def choose_bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket ``>= length``; ``ValueError`` if none fits."""
    for b in buckets:
        if b >= length:
            return b
    raise ValueError(
        f"a sequence of {length} tokens exceeds the largest length bucket {max(buckets)}; "
        "raise train.length_buckets or shorten prompts/responses"
    )


def row_ladder(multiple: int, samples: int) -> list[int]:
    """The row counts a packed batch may have: ``multiple`` times 1, 2, ..., 8, then four steps
    per doubling (10, 12, 14, 16, 20, 24, 28, 32, 40, ...), up to the first that holds
    ``samples`` rows (one sample per row, the worst case). Padding rows are at most a quarter
    of the batch past 8 x ``multiple`` rows; a run meets a handful of these shapes."""
    out, k = [], 1
    while True:
        out.append(k * multiple)
        if k * multiple >= samples:
            return out
        k += 1 if k < 8 else 2 ** (k.bit_length() - 3)


def chunk_rows(cfg: TrainConfig, seq_len: int, multiple: int) -> int:
    """Rows of one microbatch of ``train.microbatch_tokens`` at rows of ``seq_len``: the budget
    per device over the row length (at least one row) times ``multiple``, the data-parallel
    devices the rows are spread over."""
    return multiple * max(1, cfg.microbatch_tokens // seq_len)


def chunked_shape(cfg: TrainConfig, seq_len: int, multiple: int, samples: int) -> tuple[int, int]:
    """``(rows, microbatches)`` of a batch of ``samples`` under ``train.microbatch_tokens`` at
    rows of ``seq_len``: room for one sample per row (the worst case), in whole microbatches."""
    R = chunk_rows(cfg, seq_len, multiple)
    M = -(-samples // R)
    return M * R, M


def _first_fit(lengths: Sequence[int], rows: int, capacity: int) -> list[tuple[int, int]] | None:
    """First-fit-decreasing: ``(row, offset)`` per item, or None if it does not fit."""
    free = [capacity] * rows
    place: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r in range(rows):
            if free[r] >= lengths[i]:
                place[i] = (r, capacity - free[r])
                free[r] -= lengths[i]
                break
        else:
            return None
    return place


@dataclass(frozen=True)
class _Unit:
    """What one segment run of a row holds: ``samples`` (indices), after one copy of their shared
    prompt's first ``prefix`` tokens (0: a single sample, unshared)."""

    samples: tuple[int, ...]
    prefix: int
    length: int


def _sharing_groups(groups: Sequence[Sequence[Any]]) -> list[bool]:
    """Per group: whether its members can share one copy of their prompt (the same prompt of at
    least two tokens)."""
    out = []
    for members in groups:
        first = [int(t) for t in members[0].prompt_tokens]
        out.append(
            len(first) >= 2 and all([int(t) for t in m.prompt_tokens] == first for m in members[1:])
        )
    return out


def _units(
    samples: Sequence[Any], lengths: Sequence[int], shared: Sequence[bool], G: int, T: int
) -> list[_Unit]:
    """The segment runs that packing places in rows of ``T`` positions: a sample of an unshared
    group alone; the members of a sharing group after one copy of their prompt's first ``P - 1``
    tokens, split first-fit-decreasing into as few runs of at most ``T`` as hold them (each run
    its own copy of the prefix)."""
    out: list[_Unit] = []
    for g in range(len(samples) // G):
        ids = range(g * G, (g + 1) * G)
        if not shared[g]:
            out += [_Unit((s,), 0, lengths[s]) for s in ids]
            continue
        prefix = len(samples[g * G].prompt_tokens) - 1
        runs: list[list[int]] = []
        used: list[int] = []
        for s in sorted(ids, key=lambda s: (-lengths[s], s)):
            need = lengths[s] - prefix
            k = next((i for i, u in enumerate(used) if u + need <= T), None)
            if k is None:
                runs.append([])
                used.append(prefix)
                k = len(runs) - 1
            runs[k].append(s)
            used[k] += need
        out += [_Unit(tuple(sorted(r)), prefix, u) for r, u in zip(runs, used, strict=True)]
    return out


def _smallest_shape(
    units_for: Any, shapes: Sequence[tuple[int, int]], offered: str
) -> tuple[int, int, list[_Unit], list[tuple[int, int]]]:
    """``(rows, bucket, units, placement)``: of the ``(rows, bucket)`` ``shapes``, the one with the
    fewest positions ``rows x bucket`` (ties: the longer rows) that first-fit-decreasing fills
    with ``units_for(bucket)``; :class:`NoShapeFits` naming ``offered`` (what the shapes came
    from) if none does."""
    by_bucket = {T: units_for(T) for T in sorted({T for _, T in shapes})}
    lengths = {T: [u.length for u in units] for T, units in by_bucket.items()}
    fitting = [(B, T) for B, T in set(shapes) if T >= max(lengths[T]) and B * T >= sum(lengths[T])]
    for B, T in sorted(fitting, key=lambda s: (s[0] * s[1], -s[1])):
        units = by_bucket[T]
        place = _first_fit(lengths[T], B, T)
        if place is not None:
            return B, T, units, place
    units = by_bucket[max(by_bucket)] if by_bucket else units_for(1 << 30)
    sizes = [u.length for u in units]
    raise NoShapeFits(
        f"{sum(len(u.samples) for u in units)} samples ({sum(sizes)} tokens, the longest "
        f"{max(sizes)}) fit none of {offered}"
    )


class NoShapeFits(ValueError):
    """The samples fit none of the train-batch shapes offered to :func:`pack_batch`."""


def _validate(
    t: Any, where: str, trainer_version: int, vocab_size: int | None, finite: bool = True
) -> None:
    P, R = len(t.prompt_tokens), len(t.response_tokens)
    if P == 0:
        raise ValueError(f"{where}: empty prompt (the first response token needs a context)")
    if len(t.behavior_logprobs) != R:
        raise ValueError(
            f"{where}: {len(t.behavior_logprobs)} behavior logprobs for {R} response tokens"
        )
    if not math.isfinite(float(t.reward)):
        raise ValueError(f"{where}: non-finite reward {t.reward!r}")
    lp = np.asarray(t.behavior_logprobs, np.float64)
    if finite and not np.all(np.isfinite(lp)):
        raise ValueError(
            f"{where}: non-finite behavior logprob at response index "
            f"{int(np.argmin(np.isfinite(lp)))}"
        )
    if int(t.version) > trainer_version:
        raise ValueError(
            f"{where}: version {t.version} is newer than the trainer's version {trainer_version}"
        )
    if vocab_size is not None:
        ids = np.concatenate([np.asarray(t.prompt_tokens), np.asarray(t.response_tokens)])
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"{where}: token id outside [0, {vocab_size})")


def pack_batch(
    trajectories: Sequence[Any],
    cfg: TrainConfig,
    *,
    trainer_version: int,
    num_groups: int | None = None,
    rows: int | None = None,
    row_multiple: int = 1,
    vocab_size: int | None = None,
    allow_nonfinite_logprobs: bool = False,
    routes_shape: tuple[int, int] | None = None,
    shapes: Sequence[tuple[int, int]] | None = None,
) -> TrainBatch:
    """Pack complete prompt groups of finished trajectories into a :class:`TrainBatch`.

    ``trajectories``: every member of each prompt group (``cfg.group_size`` per ``group_id``), in
    any order; groups keep their first-appearance order, members their relative order.
    ``trainer_version``: the version the update will be applied to (staleness is measured
    against it). ``num_groups``: pad to this many groups (default: as many as given) so ``S``
    stays fixed across steps. ``rows``: override ``cfg.pack_rows`` (0: one sample per row).
    ``row_multiple``: with ``packing="tokens"``, the row count is a multiple of it (the
    trainer's microbatches x data-parallel devices).
    ``vocab_size``: if given, token ids are checked against it. ``allow_nonfinite_logprobs``:
    pack non-finite behavior logprobs (a broken policy sampled them) instead of raising; the
    train step's non-finite guard then skips the step. ``routes_shape``: ``(layers, experts per
    token)`` of a mixture-of-experts policy: the batch then carries ``routes`` (each
    trajectory's recorded ones, -1 where it has none). ``shapes``: with ``packing="tokens"`` and
    no fixed row count, the ``(rows, bucket)`` shapes to choose from instead of the buckets
    times :func:`row_ladder` (e.g. the shapes a trainer has compiled); :class:`NoShapeFits` if
    the samples fit none of them.
    """
    G = cfg.group_size
    if len(trajectories) == 0:
        raise ValueError("no trajectories to pack (empty batch)")
    groups: dict[Hashable, list[Any]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    for gid, members in groups.items():
        if len(members) != G:
            raise ValueError(
                f"prompt group {gid!r} has {len(members)} trajectories, expected group_size={G} "
                "(a missing or duplicated member)"
            )
        versions = {int(m.version) for m in members}
        if len(versions) != 1:
            raise ValueError(f"prompt group {gid!r} mixes policy versions {sorted(versions)}")
        for i, m in enumerate(members):
            _validate(
                m,
                f"group {gid!r} member {i}",
                trainer_version,
                vocab_size,
                finite=not allow_nonfinite_logprobs,
            )
    NG = len(groups) if num_groups is None else num_groups
    if len(groups) > NG:
        raise ValueError(f"{len(groups)} prompt groups do not fit num_groups={NG}")
    S = NG * G
    samples = [m for members in groups.values() for m in members]
    lengths = [len(m.prompt_tokens) + len(m.response_tokens) for m in samples]
    buckets = cfg.length_buckets
    n_rows = rows if rows is not None else (cfg.pack_rows if cfg.packing == "tokens" else 0)
    choose_bucket(max(lengths), buckets)  # raises if one sample is too long
    # train.share_prompts (the config allows it with packing "tokens" only), unless a fixed row
    # count or per-sample routes are asked for
    if cfg.share_prompts and n_rows == 0 and routes_shape is None:
        shared = _sharing_groups(list(groups.values()))
    else:
        shared = [False] * len(groups)

    def units_for(T: int) -> list[_Unit]:
        return _units(samples, lengths, shared, G, T)

    chunk_mask = None
    if rows is None and cfg.microbatch_tokens:
        B, T, units, place, chunk_mask = _pack_chunked(units_for, cfg, row_multiple, S, shapes)
    elif rows is None and cfg.packing == "tokens" and n_rows == 0:
        if shapes is None:
            shapes = [(B, T) for T in buckets for B in row_ladder(row_multiple, S)]
        B, T, units, place = _smallest_shape(units_for, shapes, f"the shapes {sorted(set(shapes))}")
    elif n_rows == 0:
        B = S
        T = choose_bucket(max(lengths), buckets)
        units = units_for(T)
        place = [(i, 0) for i in range(len(samples))]
    else:  # the smallest bucket whose n_rows rows hold the samples
        try:
            B, T, units, place = _smallest_shape(units_for, [(n_rows, b) for b in buckets], "")
        except NoShapeFits:
            raise ValueError(
                f"{len(samples)} samples ({sum(lengths)} tokens) do not fit {n_rows} rows of the "
                f"largest bucket {buckets[-1]}; raise train.pack_rows or train.length_buckets"
            ) from None

    tokens = np.zeros((B, T), np.int32)
    positions = np.zeros((B, T), np.int32)
    segment_ids = np.zeros((B, T), np.int32)
    targets = np.zeros((B, T), np.int32)
    loss_mask = np.zeros((B, T), bool)
    behavior = np.zeros((B, T), np.float32)
    sample_index = np.full((B, T), S, np.int32)
    routes = None if routes_shape is None else np.full((B, T, *routes_shape), -1, np.int16)
    next_segment = np.ones((B,), np.int32)
    for unit, (r, o) in zip(units, place, strict=True):
        root = int(next_segment[r])
        next_segment[r] += 1
        if root >= ROOT_SPAN:
            raise ValueError(f"a row of {T} positions holds more than {ROOT_SPAN - 1} segments")
        # a shared prompt: its first P - 1 tokens once, as the root segment; each member then
        # starts at the prompt's last token (whose logits predict the member's first token)
        prefix = unit.prefix
        if prefix:
            prompt = np.asarray(samples[unit.samples[0]].prompt_tokens, np.int32)
            tokens[r, o : o + prefix] = prompt[:-1]
            positions[r, o : o + prefix] = np.arange(prefix, dtype=np.int32)
            segment_ids[r, o : o + prefix] = root
            targets[r, o : o + prefix] = prompt[1:]
            sample_index[r, o : o + prefix] = unit.samples[0]
            o += prefix
        for k, s in enumerate(unit.samples, start=1):
            m = samples[s]
            P, R = len(m.prompt_tokens), len(m.response_tokens)
            seq = np.concatenate(
                [np.asarray(m.prompt_tokens, np.int32), np.asarray(m.response_tokens, np.int32)]
            )[prefix:]
            L = len(seq)
            tokens[r, o : o + L] = seq
            positions[r, o : o + L] = np.arange(prefix, P + R, dtype=np.int32)
            segment_ids[r, o : o + L] = root + k * ROOT_SPAN if prefix else root
            targets[r, o : o + L - 1] = seq[1:]
            own = getattr(m, "loss_mask", None)
            first = o + P - 1 - prefix  # the slot that predicts the first response token
            loss_mask[r, first : o + L - 1] = True if own is None else np.asarray(own, bool)
            behavior[r, first : o + L - 1] = np.asarray(m.behavior_logprobs, np.float32)
            sample_index[r, o : o + L] = s
            if routes is not None and getattr(m, "routes", None) is not None:
                rt = np.asarray(m.routes)
                if rt.shape != (L, *routes_shape):
                    raise ValueError(
                        f"sample {s} of group {m.group_id!r}: routes of shape {rt.shape}, "
                        f"expected {(L, *routes_shape)} (one [layers, experts per token] entry "
                        "per token)"
                    )
                routes[r, o : o + L] = rt
            o += L

    def per_sample(values: Any, dtype: Any) -> np.ndarray:
        """``[S]``: ``values`` for the samples, 0 for the batch padding after them."""
        out = np.zeros((S,), dtype)
        out[: len(samples)] = values
        return out

    return TrainBatch(
        tokens=tokens,
        positions=positions,
        segment_ids=segment_ids,
        targets=targets,
        loss_mask=loss_mask,
        behavior_logprobs=behavior,
        sample_index=sample_index,
        rewards=per_sample([float(m.reward) for m in samples], np.float32),
        sample_mask=per_sample(True, bool),
        valid=per_sample([bool(getattr(m, "valid", True)) for m in samples], bool),
        staleness=per_sample([trainer_version - int(m.version) for m in samples], np.int32),
        response_lens=per_sample([_model_tokens(m) for m in samples], np.int32),
        routes=routes,
        chunk_mask=chunk_mask,
    )


def _pack_chunked(
    units_for: Any,
    cfg: TrainConfig,
    multiple: int,
    samples: int,
    shapes: Sequence[tuple[int, int]] | None,
) -> tuple[int, int, list[_Unit], list[tuple[int, int]], np.ndarray]:
    """``train.microbatch_tokens`` packing: the bucket and number of microbatches with the fewest
    positions that hold the samples (of the buckets of ``shapes`` if given), laid out so that
    microbatch ``m`` is rows ``m, m + M, ...`` and the used ones come first."""
    buckets = sorted({T for _, T in shapes}) if shapes is not None else cfg.length_buckets
    cands = []
    for T in buckets:
        R = chunk_rows(cfg, T, multiple)
        cands += [(k * R, T) for k in range(1, chunked_shape(cfg, T, multiple, samples)[1] + 1)]
    used, T, units, place = _smallest_shape(units_for, cands, f"the buckets {list(buckets)}")
    R = chunk_rows(cfg, T, multiple)
    B, M = chunked_shape(cfg, T, multiple, samples)
    # logical row r is row r % R of microbatch r // R
    place = [((r % R) * M + r // R, o) for r, o in place]
    return B, T, units, place, np.arange(M) < used // R


def _model_tokens(t: Trajectory) -> int:
    """Response tokens the model sampled (all of them unless ``loss_mask`` says otherwise)."""
    own = getattr(t, "loss_mask", None)
    return len(t.response_tokens) if own is None else int(np.count_nonzero(own))
