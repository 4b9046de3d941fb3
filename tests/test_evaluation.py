"""Held-out evaluation: deterministic, blind to the run's random streams, scored like training."""

import jax
import numpy as np

from dora_jax.config import ModelConfig, RolloutConfig, WarmStartConfig
from dora_jax.data import ArithmeticTask
from dora_jax.model import init_params
from dora_jax.model.tokenizer import CharTokenizer
from dora_jax.pipeline.evaluation import Evaluator
from dora_jax.pipeline.warm_start import warm_start

TOK = CharTokenizer()
MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=2, num_kv_heads=1)  # fmt: skip
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
    trained, _ = warm_start(random, MODEL, WarmStartConfig(steps=150, batch_size=4, seq_len=64,
                                                           lr=1e-2), demo, TOK)  # fmt: skip
    ev = evaluator(n=32)
    before, after = ev(random, 0), ev(trained, 1)
    assert after.reward > before.reward + 0.2, (before, after)
