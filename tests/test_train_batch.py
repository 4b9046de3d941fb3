"""Packing trajectories into fixed-shape train batches: layout, buckets, padding, bad input."""

import dataclasses
import math

import numpy as np
import pytest

from dora_jax.config import TrainConfig
from dora_jax.train.batch import (
    Trajectory,
    choose_bucket,
    chunk_rows,
    pack_batch,
    row_ladder,
)

CFG = TrainConfig(group_size=2, length_buckets=(8, 16, 32), packing="rows")


def traj(prompt, response, gid, version=0, reward=1.0, logprobs=None):
    if logprobs is None:
        logprobs = [-0.5 - 0.1 * i for i in range(len(response))]
    return Trajectory(prompt, response, logprobs, reward, version, gid)


def sample_slots(batch, s):
    rows, cols = np.nonzero(batch.sample_index == s)
    assert len(set(rows)) == 1
    return rows[0], cols


def assert_samples_intact(b, ts):
    """Every sample in one row, contiguous, in its own segment, positions from 0, its response
    tokens (and only those) under the loss mask with their behavior logprobs."""
    for s, t in enumerate(ts):
        r, cols = sample_slots(b, s)
        seq = list(t.prompt_tokens) + list(t.response_tokens)
        assert cols.tolist() == list(range(cols[0], cols[0] + len(seq)))
        np.testing.assert_array_equal(b.tokens[r, cols], seq)
        np.testing.assert_array_equal(b.positions[r, cols], np.arange(len(seq)))
        assert len(set(b.segment_ids[r, cols])) == 1 and b.segment_ids[r, cols[0]] > 0
        m = b.loss_mask[r, cols]
        assert m.sum() == len(t.response_tokens) and not m[-1]
        np.testing.assert_array_equal(b.targets[r, cols][m], t.response_tokens)
        np.testing.assert_allclose(b.behavior_logprobs[r, cols][m], t.behavior_logprobs)


def test_one_sample_per_row_layout():
    ts = [
        traj([5, 6, 7], [8, 9], "a", reward=1.0),
        traj([5, 6, 7], [10], "a", reward=0.0),
        traj([1], [2, 3, 4, 11], "b", version=1, reward=0.5),
        traj([1], [12, 13], "b", version=1, reward=0.25),
    ]
    b = pack_batch(ts, CFG, trainer_version=2)
    assert b.tokens.shape == (4, 8)  # bucket 8 fits the longest (5 tokens)
    np.testing.assert_array_equal(b.tokens[0, :5], [5, 6, 7, 8, 9])
    np.testing.assert_array_equal(b.positions[0, :5], np.arange(5))
    np.testing.assert_array_equal(b.segment_ids[0], [1, 1, 1, 1, 1, 0, 0, 0])
    # slot j predicts token j+1: response tokens 8, 9 are predicted at slots 2, 3
    np.testing.assert_array_equal(b.targets[0, :4], [6, 7, 8, 9])
    np.testing.assert_array_equal(b.loss_mask[0], [0, 0, 1, 1, 0, 0, 0, 0])
    np.testing.assert_allclose(b.behavior_logprobs[0, 2:4], [-0.5, -0.6])
    assert b.behavior_logprobs[0][~b.loss_mask[0]].tolist() == [0.0] * 6
    np.testing.assert_array_equal(b.loss_mask[2], [1, 1, 1, 1, 0, 0, 0, 0])  # prompt length 1
    np.testing.assert_array_equal(b.sample_index[0], [0] * 5 + [4] * 3)
    np.testing.assert_allclose(b.rewards, [1.0, 0.0, 0.5, 0.25])
    np.testing.assert_array_equal(b.staleness, [2, 2, 1, 1])
    np.testing.assert_array_equal(b.response_lens, [2, 1, 4, 2])
    assert b.sample_mask.all()
    assert b.loss_mask.sum() == 9


def test_groups_are_group_major_whatever_the_input_order():
    ts = [traj([1], [2], "x", reward=1), traj([1], [3], "y", reward=2)]
    ts += [traj([1], [4], "x", reward=3), traj([1], [5], "y", reward=4)]
    b = pack_batch(ts, CFG, trainer_version=0)
    np.testing.assert_allclose(b.rewards, [1, 3, 2, 4])


def test_padding_groups_and_buckets():
    ts = [traj([1] * 6, [2] * 5, "a"), traj([1] * 2, [2], "a")]
    b = pack_batch(ts, CFG, trainer_version=0, num_groups=3)
    assert b.tokens.shape == (6, 16)
    assert b.sample_mask.tolist() == [True, True, False, False, False, False]
    assert b.segment_ids[2:].sum() == 0 and b.loss_mask[2:].sum() == 0
    assert (b.sample_index[2:] == 6).all()
    assert choose_bucket(16, CFG.length_buckets) == 16
    assert choose_bucket(17, CFG.length_buckets) == 32


def test_packed_rows_hold_several_samples():
    rng = np.random.default_rng(0)
    ts = []
    for g in range(4):
        for _ in range(2):
            P, R = int(rng.integers(1, 5)), int(rng.integers(1, 6))
            ts.append(traj(list(rng.integers(0, 50, P)), list(rng.integers(0, 50, R)), g))
    b = pack_batch(ts, CFG, trainer_version=0, rows=2)
    total = sum(len(t.prompt_tokens) + len(t.response_tokens) for t in ts)
    assert b.tokens.shape[0] == 2
    assert b.tokens.shape[1] in CFG.length_buckets and 2 * b.tokens.shape[1] >= total
    assert_samples_intact(b, ts)
    # segments differ between neighbours in a row
    for r in range(2):
        segs = b.segment_ids[r][b.segment_ids[r] > 0]
        assert len(set(segs)) == len(set(b.sample_index[r][b.segment_ids[r] > 0]))


def test_too_many_tokens_for_the_rows():
    ts = [traj([1] * 10, [2] * 10, "a"), traj([1] * 10, [2] * 10, "a")]
    with pytest.raises(ValueError, match="do not fit 1 rows"):
        pack_batch(ts, CFG, trainer_version=0, rows=1)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: [traj([1], [2], "a", reward=math.nan), traj([1], [2], "a")], "non-finite reward"),
        (lambda: [traj([1], [2], "a", reward=math.inf), traj([1], [2], "a")], "non-finite reward"),
        (
            lambda: [traj([1], [2, 3], "a", logprobs=[-1.0, math.nan]), traj([1], [2], "a")],
            "non-finite behavior logprob at response index 1",
        ),
        (lambda: [traj([1], [2, 3], "a", logprobs=[-1.0]), traj([1], [2], "a")], "1 behavior"),
        (lambda: [traj([1], [2], "a")], "has 1 trajectories, expected group_size=2"),
        (lambda: [traj([1], [2], "a")] * 3, "has 3 trajectories"),
        (lambda: [traj([1], [2], "a", 0), traj([1], [2], "a", 1)], "mixes policy versions"),
        (lambda: [traj([1], [2], "a", 5), traj([1], [2], "a", 5)], "newer than the trainer"),
        (lambda: [traj([], [2], "a"), traj([1], [2], "a")], "empty prompt"),
        (lambda: [traj([1] * 30, [2] * 5, "a"), traj([1], [2], "a")], "largest length bucket"),
        (lambda: [traj([1], [99], "a"), traj([1], [2], "a")], "outside"),
        (lambda: [], "empty batch"),
    ],
)
def test_bad_input_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        pack_batch(bad(), CFG, trainer_version=2, vocab_size=64)


def test_too_many_groups_for_num_groups():
    ts = [traj([1], [2], g) for g in "aabb"]
    with pytest.raises(ValueError, match="do not fit num_groups=1"):
        pack_batch(ts, CFG, trainer_version=0, num_groups=1)


TOKENS = TrainConfig(group_size=2, length_buckets=(8, 16, 32))  # packing="tokens", the default


def test_row_ladder_is_every_count_to_eight_then_four_steps_per_doubling():
    assert row_ladder(1, 64) == [
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        10,
        12,
        14,
        16,
        20,
        24,
        28,
        32,
        40,
        48,
        56,
        64,
    ]
    assert row_ladder(2, 5) == [2, 4, 6]  # the last holds every sample in a row of its own
    assert row_ladder(4, 4) == [4]


@pytest.mark.parametrize("seed", range(6))
def test_token_packing_takes_the_fewest_positions_that_fit(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(1.2, 0.9, size=12).astype(int).clip(1, 30)  # long-tailed, <= 32
    ts = []
    for s, L in enumerate(lengths):
        P = int(rng.integers(1, L + 1)) if L > 1 else 1
        R = max(int(L) - P, 1)
        ts.append(traj(list(rng.integers(0, 50, P)), list(rng.integers(0, 50, R)), s // 2))
    multiple = int(rng.integers(1, 4))
    b = pack_batch(ts, TOKENS, trainer_version=0, row_multiple=multiple)
    sizes = [len(t.prompt_tokens) + len(t.response_tokens) for t in ts]

    # the oracle: every (rows, bucket) of the ladder for which some assignment of the samples to
    # rows exists (first-fit-decreasing is the packer's rule, so the oracle uses it too, written
    # out again here), the fewest positions among them
    def fits(B, T):
        free = [T] * B
        for L in sorted(sizes, reverse=True):
            i = next((i for i in range(B) if free[i] >= L), None)
            if i is None:
                return False
            free[i] -= L
        return True

    shapes = [
        (B, T)
        for T in TOKENS.length_buckets
        if T >= max(sizes)
        for B in row_ladder(multiple, len(ts))
        if fits(B, T)
    ]
    best = min(B * T for B, T in shapes)
    assert b.num_rows * b.seq_len == best and b.num_rows % multiple == 0
    assert int((b.segment_ids > 0).sum()) == sum(sizes)  # every token placed once
    assert_samples_intact(b, ts)


def test_token_packing_beats_one_sample_per_row_on_a_long_tail():
    rng = np.random.default_rng(1)
    cfg = TrainConfig(group_size=8, length_buckets=(192,))
    ts = []
    for g in range(8):
        for _ in range(8):
            R = int(min(150, max(1, rng.lognormal(1.5, 1.0))))
            ts.append(traj([1] * 6, [2] * R, g))
    packed = pack_batch(ts, cfg, trainer_version=0, row_multiple=2)
    padded = pack_batch(ts, dataclasses.replace(cfg, packing="rows"), trainer_version=0)
    share = lambda b: float((b.segment_ids > 0).mean())  # noqa: E731
    assert padded.num_rows == 64 and packed.num_rows < 16
    assert share(packed) > 0.75 > 0.25 > share(padded)


@pytest.mark.parametrize("seed", range(4))
def test_token_budget_microbatches_hold_the_samples_in_the_first_ones(seed):
    """``train.microbatch_tokens``: room for one sample per row in whole microbatches of the
    budget's rows (microbatch m is rows m, m + M, ...), the samples packed into the fewest
    positions of whole microbatches over the buckets, those microbatches first."""
    rng = np.random.default_rng(seed)
    cfg = dataclasses.replace(TOKENS, microbatch_tokens=32)
    ts = []
    for s in range(12):
        L = int(np.clip(rng.lognormal(1.5, 0.8), 2, 30))
        ts.append(traj(list(rng.integers(0, 50, 1)), list(rng.integers(0, 50, L - 1)), s // 2))
    multiple = int(rng.integers(1, 3))
    b = pack_batch(ts, cfg, trainer_version=0, row_multiple=multiple)
    assert_samples_intact(b, ts)
    T = b.seq_len
    R = chunk_rows(cfg, T, multiple)
    M = len(b.chunk_mask)
    assert R == multiple * max(1, 32 // T) and b.num_rows == M * R and M == -(-len(ts) // R)
    used = int(b.chunk_mask.sum())
    assert b.chunk_mask[:used].all() and not b.chunk_mask[used:].any()
    rows = b.segment_ids.reshape(R, M, T)  # [slot, microbatch, position]: row j * M + m
    assert (rows[:, used:] == 0).all() and (rows[:, used - 1] > 0).any()
    # the oracle: the fewest positions of whole microbatches over the buckets that hold them
    sizes = sorted((len(t.prompt_tokens) + len(t.response_tokens) for t in ts), reverse=True)

    def fits(B, T):
        free = [T] * B
        for L in sizes:
            i = next((i for i in range(B) if free[i] >= L), None)
            if i is None:
                return False
            free[i] -= L
        return True

    shapes = [
        (k * chunk_rows(cfg, U, multiple), U)
        for U in cfg.length_buckets
        if U >= sizes[0]
        for k in range(1, len(ts) + 1)
    ]
    best = min(B * U for B, U in shapes if fits(B, U))
    assert used * R * T == best
