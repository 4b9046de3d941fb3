"""Prompt sources (the built-in long-tailed task, dataset files), reward functions and scoring."""

from dora_jax.data.arithmetic import ArithmeticTask
from dora_jax.data.examples import Example, chat_messages, to_examples
from dora_jax.data.files import read_rows
from dora_jax.data.jsonl import DataError, load_jsonl_prompts
from dora_jax.data.math_answers import boxed_math_reward
from dora_jax.data.prompts import Prompt, PromptSource
from dora_jax.data.reward_pool import Outcome, RewardPool
from dora_jax.data.rewards import RewardFn, exact_reward
from dora_jax.data.scoring import Scorer

__all__ = [
    "ArithmeticTask",
    "DataError",
    "Example",
    "Outcome",
    "Prompt",
    "PromptSource",
    "RewardFn",
    "RewardPool",
    "Scorer",
    "boxed_math_reward",
    "chat_messages",
    "exact_reward",
    "load_jsonl_prompts",
    "read_rows",
    "to_examples",
]
