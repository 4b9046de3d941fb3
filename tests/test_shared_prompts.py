"""``train.share_prompts``: a GRPO group's prompt packed once, every response attending to it.

The shared batch must train exactly as the unshared one: per-token log-probabilities of every
response token against the independent float64 reference model run on each trajectory alone
(``tests/reference_model.py``), and the step's loss and gradients against ``jax.grad`` of that
reference over the unshared layout; dense and blockwise attention (small blocks, so the block
skipping meets a prefix and responses in different blocks). The layout itself: the prompt's
first ``P - 1`` tokens once, each member from the prompt's last token on; a group too long for
one row is split into runs, each with its own copy; groups with different prompts are not shared.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_model import as_float64, reference_logprobs  # tests/reference_model.py

from dora_jax.config import ConfigError, ModelConfig, TrainConfig, load_config
from dora_jax.model import init_params
from dora_jax.model.attention import ROOT_SPAN, segment_causal_mask
from dora_jax.train import Trajectory, init_state, pack_batch, token_logprobs, train_step_with_grads

MODEL = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    attention="dense",
)
G = 4
TRAIN = TrainConfig(
    lr=1e-3,
    group_size=G,
    length_buckets=(64,),
    logprob_chunk=16,
    total_steps=10,
    adam_eps=1e-3,
    max_grad_norm=10.0,
    microbatch_tokens=64,
)
SHARED = dataclasses.replace(TRAIN, share_prompts=True)
GRAD_RTOL = 1e-5  # as the train step's gradient oracle (tests/test_train_step.py)


def trajectories(seed=0, groups=3, prompt_len=(3, 9), response_len=(2, 9)):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(0, MODEL.vocab_size, int(rng.integers(*prompt_len))).tolist()
        for i in range(G):
            R = int(rng.integers(*response_len))
            lp = (-rng.random(R) * 3).tolist()
            resp = rng.integers(0, MODEL.vocab_size, R).tolist()
            out.append(Trajectory(prompt, resp, lp, float(i % 2), 0, (seed, g)))
    return out


@pytest.fixture(scope="module")
def params():
    return init_params(MODEL, jax.random.key(0))


def _lp(params, batch, cfg):
    lp, _ = jax.jit(lambda p, t, pos, seg, tgt: token_logprobs(p, t, pos, seg, tgt, cfg, chunk=16))(
        params, batch.tokens, batch.positions, batch.segment_ids, batch.targets
    )
    return np.asarray(lp)


def per_sample(batch, values):
    """Each sample's values on its loss tokens, in order."""
    return [values[(batch.sample_index == s) & batch.loss_mask] for s in range(batch.num_samples)]


def reference_response_logprobs(params, trajs):
    """Each trajectory alone in its own row, by the float64 reference model."""
    p64 = as_float64(params, np)
    out = []
    for t in trajs:
        seq = np.asarray([*t.prompt_tokens, *t.response_tokens])
        L, P = len(seq), len(t.prompt_tokens)
        lp = reference_logprobs(
            p64,
            seq[None, :-1],
            np.arange(L - 1)[None],
            np.ones((1, L - 1), np.int32),
            seq[None, 1:],
            MODEL,
        )
        out.append(np.asarray(lp)[0, P - 1 :])
    return out


def test_layout_holds_each_prompt_once(params):
    trajs = trajectories()
    plain = pack_batch(trajs, TRAIN, trainer_version=0)
    shared = pack_batch(trajs, SHARED, trainer_version=0)
    prompts = [len(trajs[g * G].prompt_tokens) for g in range(3)]
    real = sum(len(t.prompt_tokens) + len(t.response_tokens) for t in trajs)
    assert int(np.sum(plain.segment_ids > 0)) == real
    # each group: P - 1 prompt tokens once, then every member from the prompt's last token on
    assert int(np.sum(shared.segment_ids > 0)) == real - sum((G - 1) * (P - 1) for P in prompts)
    rows, cols = np.nonzero(shared.segment_ids)
    ids = shared.segment_ids[rows, cols]
    assert len({(r, i % ROOT_SPAN) for r, i in zip(rows, ids, strict=True)}) == 3  # prompts
    assert len({(r, i) for r, i in zip(rows, ids, strict=True) if i >= ROOT_SPAN}) == 3 * G
    np.testing.assert_array_equal(shared.loss_mask.sum(), plain.loss_mask.sum())
    np.testing.assert_array_equal(shared.rewards, plain.rewards)


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_response_logprobs_equal_each_trajectory_alone(params, attention):
    cfg = dataclasses.replace(MODEL, attention=attention, attention_block=8)
    trajs = trajectories(seed=1)
    shared = pack_batch(trajs, SHARED, trainer_version=0)
    assert int(np.sum(shared.segment_ids >= ROOT_SPAN)) > 0
    got = per_sample(shared, _lp(params, shared, cfg))
    want = reference_response_logprobs(params, trajs)
    for s, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(g, w, atol=2e-5, err_msg=f"sample {s}")


def test_mask_lets_a_member_see_its_prompt_and_itself_only():
    # row: prompt prefix (root 1) of 3, member 1 of 2, member 2 of 3, an unshared sample (2)
    m1, m2 = 1 + ROOT_SPAN, 1 + 2 * ROOT_SPAN
    seg = np.array([[1, 1, 1, m1, m1, m2, m2, m2, 2, 2, 0]], np.int32)
    mask = np.asarray(segment_causal_mask(jnp.asarray(seg)))[0]
    # NumPy oracle: each slot's sequence (a prefix slot belongs to both members); a query sees
    # the slots of its own sequence up to itself
    sequence = [[0, 1, 2, 3, 4], [0, 1, 2, 5, 6, 7], [8, 9]]
    want = np.zeros_like(mask)
    for slots in sequence:
        for i, q in enumerate(slots):
            want[q, slots[: i + 1]] = True
    np.testing.assert_array_equal(mask, want)


def test_step_loss_and_gradients_match_the_reference_on_the_unshared_batch(params):
    from test_train_step import oracle_grads  # the float64 reference step (tests/)

    trajs = trajectories(seed=2)
    plain = pack_batch(trajs, TRAIN, trainer_version=0)
    shared = pack_batch(trajs, SHARED, trainer_version=0)
    loss, want = oracle_grads(params, plain, TRAIN)
    state = init_state(params, MODEL, SHARED)
    _, metrics, grads = jax.jit(train_step_with_grads)(state, shared)
    assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-5, abs=1e-7)
    for path, g, w in zip(
        jax.tree_util.tree_leaves_with_path(grads),
        jax.tree.leaves(grads),
        jax.tree.leaves(want),
        strict=True,
    ):
        scale = float(np.max(np.abs(w))) or 1.0
        assert float(np.max(np.abs(np.asarray(g) - w))) <= GRAD_RTOL * scale, path[0]


def test_a_group_longer_than_a_row_is_split_with_a_prompt_copy_each(params):
    trajs = trajectories(seed=3, groups=1, prompt_len=(8, 9), response_len=(12, 13))
    cfg = dataclasses.replace(SHARED, length_buckets=(40,), microbatch_tokens=40)
    shared = pack_batch(trajs, cfg, trainer_version=0)
    # 7 prompt tokens + 13 a member: two members a row of 40, so two runs, two copies
    rows, cols = np.nonzero(shared.segment_ids)
    ids = shared.segment_ids[rows, cols] % ROOT_SPAN
    assert len(set(zip(rows, ids, strict=True))) == 2
    got = per_sample(shared, _lp(params, shared, MODEL))
    for g, w in zip(got, reference_response_logprobs(params, trajs), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)


def test_members_with_different_prompts_are_not_shared():
    trajs = trajectories(seed=4, groups=1)
    first = trajs[0]
    trajs[0] = dataclasses.replace(first, prompt_tokens=[*first.prompt_tokens, 1])
    shared = pack_batch(trajs, SHARED, trainer_version=0)
    assert int(np.sum(shared.segment_ids >= ROOT_SPAN)) == 0


def test_config_refuses_share_prompts_where_it_cannot_hold():
    with pytest.raises(ConfigError, match="share_prompts"):
        TrainConfig(share_prompts=True, packing="rows")
    with pytest.raises(ConfigError, match="share_prompts"):
        load_config(
            None, ["train.share_prompts=true", "model.sliding_window=8", "model.attention=dense"]
        )
