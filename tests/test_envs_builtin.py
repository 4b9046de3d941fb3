"""The built-in environments: they follow the protocol, an ideal player solves them and a wrong
one does not, every episode is a pure function of (seed, index), and turns per episode are
long-tailed."""

import numpy as np
import pytest
from envs_fixtures import play

from dora_jax.envs import Environment, load_environment, stop_strings
from dora_jax.envs.builtin.calculator import ToolArithmetic, calculate
from dora_jax.envs.builtin.guess import GuessNumbers

BUILT_INS = [ToolArithmetic, GuessNumbers]


@pytest.mark.parametrize("cls", BUILT_INS)
def test_ideal_play_is_solved_through_checked_returns(cls):
    env = cls()
    assert isinstance(env, Environment) and stop_strings(env)
    for index in range(40):
        prompt, _ = env.prompt(7, index)
        steps = play(env, 7, index, env.ideal_actions(7, index))
        assert steps[0].observation == prompt
        *middle, last = steps[1:]
        assert len(steps) - 1 == len(env.ideal_actions(7, index))
        assert not any(s.terminated or s.truncated for s in middle)
        assert all(s.reward == 0.0 for s in middle)
        assert last.terminated and last.reward == 1.0 and last.info["solved"] == 1.0


def test_calculator_answers_calls_and_judges_the_final_answer():
    env = ToolArithmetic()
    n, s, _ = env.numbers(0, 3)
    env.reset(0, {"index": 3})
    obs, reward, terminated, _, info = env.step(f"{n},<call>{n}-{s}</call>")
    assert obs == [{"role": "tool", "content": str(n - s)}] and not terminated
    assert info["calls"] == 1 and reward == 0.0
    obs, reward, terminated, _, _ = env.step(f"#{n % s + 1}")
    assert terminated and reward == 0.0
    env.reset(0, {"index": 3})
    assert env.step("no answer at all")[1:3] == (0.0, True)
    assert [calculate(e) for e in ("23-5", " 7 * 6 ", "9/2", "1/0", "2**8", "x")] == [
        "18",
        "42",
        "4",
        "error",
        "error",
        "error",
    ]


def test_calculator_truncates_past_max_calls():
    env = ToolArithmetic(max_calls=3)
    env.reset(1, {"index": 0})
    flags = [env.step("<call>1+1</call>")[2:4] for _ in range(4)]
    assert flags == [(False, False)] * 3 + [(False, True)]


def test_guess_feedback_and_budget():
    env = GuessNumbers(high=16, guesses_per_round=2)
    secrets = env.secrets(3, 5)
    env.reset(3, {"index": 5})
    low = "1?" if secrets[0] != 1 else "16?"
    obs, reward, *_ = env.step(low)
    assert obs == ("higher\n" if secrets[0] != 1 else "lower\n") and reward == 0.0
    assert env.step("no idea")[0] == "not a number\n"
    if len(secrets) == 1:  # the budget of one round is spent: truncated, nothing found
        assert env.guesses == 2
    env.reset(3, {"index": 5})
    last = None
    for _ in range(2 * len(secrets)):
        last = env.step("0?")
    assert last[3] and not last[2] and last[1] == 0.0 and last[4]["solved"] == 0.0


@pytest.mark.parametrize("cls", BUILT_INS)
def test_episodes_are_pure_functions_of_seed_and_index(cls):
    a, b = cls(), cls()
    for index in (0, 5, 99):
        actions = a.ideal_actions(11, index)
        assert play(a, 11, index, actions) == play(b, 11, index, actions)
    prompts = lambda seed: [a.prompt(seed, i) for i in range(30)]  # noqa: E731
    assert prompts(11) == prompts(11) and prompts(11) != prompts(12)
    with pytest.raises(ValueError, match="integer 'index'"):
        a.reset(0, {"idx": 1})


@pytest.mark.parametrize("cls", BUILT_INS)
def test_turns_per_episode_are_long_tailed(cls):
    env = cls()
    turns = np.array([len(env.ideal_actions(0, i)) for i in range(400)])
    p50, p99 = np.percentile(turns, [50, 99])
    assert p99 / p50 >= 5, (p50, p99)
    flat = cls(**{"sigma": 0.0})  # no spread: the tail is gone
    flat_turns = np.array([len(flat.ideal_actions(0, i)) for i in range(400)])
    assert np.percentile(flat_turns, 99) / np.percentile(flat_turns, 50) < 3


def test_built_ins_load_by_name_with_keyword_arguments():
    env = load_environment("guess_numbers", {"high": 8, "median_rounds": 1})
    assert isinstance(env, GuessNumbers) and env.high == 8
    assert isinstance(load_environment("tool_arithmetic"), ToolArithmetic)
