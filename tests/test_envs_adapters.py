"""The optional adapters (the envs extra): reasoning-gym as single-turn episodes scored by its
own score_answer, and a GEM game played to its end, both in-process and through the pool. Each
test is skipped when its library is not installed."""

import pytest
from envs_fixtures import play

from dora_jax.envs import EnvPool, EnvSpecError, load_environment


def test_reasoning_gym_questions_are_scored_by_the_dataset():
    pytest.importorskip("reasoning_gym")
    env = load_environment("reasoning_gym", {"dataset": "basic_arithmetic", "size": 20})
    for index in range(5):
        question, answer = env.prompt(3, index)
        first, last = play(env, 3, index, [f"let me see... <answer>{answer}</answer>"])
        assert first.observation == question and last.terminated and last.reward == 1.0
        wrong = play(env, 3, index, [f"<answer>{answer}1</answer>"])[-1]
        assert wrong.terminated and wrong.reward < 1.0
    assert env.prompt(3, 0) == env.prompt(3, 20) != env.prompt(4, 0)  # index mod size, by seed
    with pytest.raises(EnvSpecError, match="reasoning-gym has no dataset 'nope'"):
        load_environment("reasoning_gym", {"dataset": "nope"})
    with pytest.raises(EnvSpecError, match="raised TypeError"):
        load_environment("reasoning_gym", {"dataset": "basic_arithmetic", "colour": 1})


def bisect(pool_step, high):
    lo, hi, steps = 1, high, []
    while True:
        guess = (lo + hi) // 2
        step = pool_step(f"my guess is \\boxed{{{guess}}}")
        steps.append(step)
        if step.terminated or step.truncated:
            return steps
        lo, hi = (guess + 1, hi) if "higher" in step.observation else (lo, guess - 1)


def test_a_gem_game_plays_to_its_end_through_the_pool():
    pytest.importorskip("gem")
    spec, kwargs = "gem", {"env_id": "game:GuessTheNumber-v0-easy"}
    local = load_environment(spec, kwargs)
    prompt = local.prompt(1, 2)[0]
    assert "between 1 and 10" in prompt and local.prompt(1, 2)[0] == prompt
    pool = EnvPool(spec, kwargs, workers=1, timeout_s=30.0)
    try:
        eid, fut = pool.reset(1, {"index": 2})
        first = fut.result(timeout=60)
        assert first.error is None and first.step.observation == prompt
        steps = bisect(lambda a: pool.step(eid, a).result(timeout=60).step, 10)
        assert steps[-1].terminated and steps[-1].reward == 1.0
        assert all(s.reward == 0.0 for s in steps[:-1]) and len(steps) <= 4
        assert pool.errors == {}
    finally:
        pool.close()
    with pytest.raises(EnvSpecError, match="raised ValueError: Environment game:Nope"):
        load_environment("gem", {"env_id": "game:Nope"})
