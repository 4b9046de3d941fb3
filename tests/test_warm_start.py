"""The supervised warm start: packed batches keep every example once, intact and separated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.config import ModelConfig, WarmStartConfig
from dora_jax.data import ArithmeticTask
from dora_jax.model import forward, init_params
from dora_jax.model.tokenizer import CharTokenizer
from dora_jax.model.transformer import default_positions
from dora_jax.pipeline.warm_start import make_batch, warm_start

TOK = CharTokenizer()
MODEL = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2
)
TASK = ArithmeticTask(seed=3)


def example(i):
    return TASK.problem(i)[0], TASK.solution(i)


def encoded(i):
    prompt, solution = example(i)
    p = TOK.encode(TOK.apply_chat_template([{"role": "user", "content": prompt}]))
    return p, TOK.encode(solution) + [TOK.eos_id]


@pytest.mark.parametrize("rows,seq_len", [(1, 40), (4, 64), (3, 192)])
def test_packed_batch_holds_consecutive_examples_intact(rows, seq_len):
    cfg = WarmStartConfig(batch_size=rows, seq_len=seq_len)
    start = 17
    (tokens, seg, mask), nxt = make_batch(example, TOK, start, cfg)
    assert tokens.shape == seg.shape == mask.shape == (rows, seq_len)
    # Walk the rows segment by segment: each is the next example, untouched (or cut to a row).
    index = start
    for r in range(rows):
        ids = [s for s in np.unique(seg[r]) if s]
        assert ids == list(range(1, len(ids) + 1))
        for s in ids:
            where = np.flatnonzero(seg[r] == s)
            assert np.all(np.diff(where) == 1)  # contiguous
            p, resp = encoded(index)
            full = (p + resp)[:seq_len]
            np.testing.assert_array_equal(tokens[r, where], full)
            # the loss mask marks exactly the positions predicting a response token
            want = np.zeros(len(full))
            want[len(p) - 1 : len(full) - 1] = 1
            np.testing.assert_array_equal(mask[r, where], want)
            index += 1
        assert np.all(mask[r, seg[r] == 0] == 0)
    assert nxt == index > start
    # the example that did not fit is the first of the next batch
    (tokens2, seg2, _), _ = make_batch(example, TOK, nxt, cfg)
    p, resp = encoded(nxt)
    np.testing.assert_array_equal(
        tokens2[0, : min(len(p) + len(resp), seq_len)], (p + resp)[:seq_len]
    )


def test_packed_loss_equals_separate_sequences():
    """Packing changes nothing a segment sees: per-segment logits equal running it alone."""
    cfg_m = MODEL
    params = init_params(cfg_m, jax.random.key(0))
    start = 0
    while True:  # a row holding at least three examples
        (tokens, seg, _), start = make_batch(
            example, TOK, start, WarmStartConfig(batch_size=1, seq_len=96)
        )
        if seg.max() >= 3:
            break
    packed = forward(
        params, jnp.asarray(tokens), default_positions(jnp.asarray(seg)), jnp.asarray(seg), cfg_m
    )
    for s in range(1, int(seg.max()) + 1):
        where = np.flatnonzero(seg[0] == s)
        alone = tokens[:, where]
        T = alone.shape[1]
        ref = forward(
            params, jnp.asarray(alone), jnp.arange(T)[None], jnp.ones((1, T), jnp.int32), cfg_m
        )
        np.testing.assert_allclose(packed[0, where], ref[0], atol=1e-5)


def test_warm_start_lowers_the_loss():
    cfg_m = MODEL
    params = init_params(cfg_m, jax.random.key(0))
    _, losses = warm_start(
        params, cfg_m, WarmStartConfig(steps=30, batch_size=2, seq_len=96), example, TOK
    )
    assert len(losses) == 30 and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
