"""Prompt sources (built-in long-tailed arithmetic, JSONL files) and reward functions."""

from dora_jax.data.arithmetic import ArithmeticTask
from dora_jax.data.jsonl import DataError, load_jsonl_prompts
from dora_jax.data.prompts import Prompt, PromptSource
from dora_jax.data.rewards import RewardFn, boxed_math_reward, exact_reward, safe_reward

__all__ = [
    "ArithmeticTask",
    "DataError",
    "Prompt",
    "PromptSource",
    "RewardFn",
    "boxed_math_reward",
    "exact_reward",
    "load_jsonl_prompts",
    "safe_reward",
]
