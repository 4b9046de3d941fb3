"""Held-out evaluation: deterministic, blind to the run's random streams, scored like training."""

import jax
import numpy as np
import pytest

from dora_jax.config import EvalConfig, ModelConfig, RolloutConfig, WarmStartConfig
from dora_jax.data import ArithmeticTask
from dora_jax.model import init_params
from dora_jax.model.tokenizer import CharTokenizer
from dora_jax.pipeline.evaluation import EvalResult, Evaluator
from dora_jax.pipeline.warm_start import warm_start

TOK = CharTokenizer()
MODEL = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1
)
ROLLOUT = RolloutConfig(max_slots=4, num_pages=64, max_prompt_len=16, max_new_tokens=24)
TASK = ArithmeticTask(seed=5, median_steps=1, max_steps=3)


def evaluator(n=12, reward=TASK.answer_reward):
    problems = [TASK.problem(i) for i in range(n)]
    return Evaluator(MODEL, ROLLOUT, jax.devices()[0], TOK, problems, reward, seed=0)


def test_evaluation_is_paired_and_deterministic():
    params = init_params(MODEL, jax.random.key(0))
    ev = evaluator()
    a, b = ev(params, 0), ev(params, 7)
    assert (a.reward, a.solved, a.response_len) == (b.reward, b.solved, b.response_len)
    assert a.at_k == {} and len(a.scores) == 12  # one sample each: no @k metrics
    assert a.step == 0 and b.step == 7 and a.response_len > 0


def test_evaluation_scores_the_decoded_responses():
    """With a reward that records what it saw: one call per problem, the decoded response and
    the problem's own reference; the means are those of the returned rewards."""
    seen = []

    def recording(response, reference):
        seen.append((response, reference))
        return float(len(response) % 2)

    ev = evaluator(reward=recording)
    r = ev(init_params(MODEL, jax.random.key(0)), 0)
    assert [ref for _, ref in seen] == [TASK.problem(i)[1] for i in range(12)]
    rewards = [len(resp) % 2 for resp, _ in seen]
    assert r.reward == np.mean(rewards) and r.solved == np.mean(rewards)


def test_a_warm_started_policy_scores_higher():
    def demo(i):
        return TASK.demonstration(i + 10_000, 0.0)

    random = init_params(MODEL, jax.random.key(0))
    trained, _ = warm_start(
        random, MODEL, WarmStartConfig(steps=150, batch_size=4, seq_len=64, lr=1e-2), demo, TOK
    )
    ev = evaluator(n=32)
    before, after = ev(random, 0), ev(trained, 1)
    assert after.reward > before.reward + 0.2, (before, after)


def _numpy_pass_at(n: int, c: np.ndarray, k: int) -> np.ndarray:
    """The unbiased pass@k estimator in its product form: 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    out = np.ones(len(c))
    for p, ci in enumerate(c):
        if n - ci >= k:
            out[p] = 1.0 - np.prod(1.0 - k / np.arange(n - ci + 1, n + 1))
    return out


def test_samples_per_prompt_gives_mean_and_pass_at_k():
    """Four samples per problem, a reward that records what it scored: mean@4 and pass@1,2,4
    equal a NumPy computation from the recorded rewards, and reach the logged metrics."""
    seen = []

    def recording(response, reference):
        reward = float(len(response) % 3 == 0)  # about a third solved, varies per sample
        seen.append((reference, reward))
        return reward

    problems = [TASK.problem(i) for i in range(10)]
    ev = Evaluator(
        MODEL, ROLLOUT, jax.devices()[0], TOK, problems, recording, seed=0, samples_per_prompt=4
    )
    r = ev(init_params(MODEL, jax.random.key(0)), 3)
    assert len(seen) == 40
    # calls are problem-major: problem i's four samples, then problem i + 1's
    assert [ref for ref, _ in seen] == [ref for _, ref in problems for _ in range(4)]
    scores = np.array([x for _, x in seen]).reshape(10, 4)
    assert np.array_equal(np.array(r.scores), scores)
    c = scores.sum(axis=1).astype(int)
    assert 0 < c.sum() < 40 and len(set(c.tolist())) > 1  # a case that tells the k apart
    want = {
        "mean@4": scores.mean(),
        "pass@1": _numpy_pass_at(4, c, 1).mean(),
        "pass@2": _numpy_pass_at(4, c, 2).mean(),
        "pass@4": (c > 0).mean(),
    }
    assert set(r.at_k) == set(want)
    for name, value in want.items():
        assert r.at_k[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name
    assert r.reward == pytest.approx(scores.mean()) and r.solved == pytest.approx(c.sum() / 40)
    m = r.metrics()
    assert m["eval/mean@4"] == r.at_k["mean@4"] and m["eval/pass@4"] == r.at_k["pass@4"]
    assert EvalResult.from_metrics(3, m).at_k == r.at_k
    assert EvalConfig().samples_per_prompt == 1  # the default stays one sample per problem
