"""Adapters to established environment libraries (the ``envs`` extra:
``pip install -e ".[envs]"``).

- ``reasoning_gym``: a `reasoning-gym` procedural dataset as single-turn episodes. The dataset
  ``create_dataset(dataset, seed=seed, size=size, **config)`` is the prompt source (task
  ``{"index": i}`` is its entry ``i mod size``) and its ``score_answer`` the reward of the one
  model turn (the text inside the last ``<answer>...</answer>`` when the tag is there, else the
  whole turn).
- ``gem``: any registered `GEM` environment (``gem.make(env_id, **kwargs)``), multi-turn. Episode
  ``(seed, index)`` resets the game with a seed drawn from both; info values that are not plain
  JSON are left out. GEM seeds the process's global random generators on reset, so an episode
  rebuilt after its worker was stopped is checked like any other (a game that draws from them
  while other episodes share its worker may fail that check and end ``crash``).

Each library is imported when its adapter is built, so this module imports without them.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from dora_jax.envs.protocol import task_index

_EXTRA = "pip install -e '.[envs]'"


def _require(module: str, package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"the {package} adapter needs {package} ({_EXTRA}): {e}") from None


def _plain(info: Any) -> dict[str, Any]:
    """The entries of ``info`` that JSON can carry."""
    out = {}
    for k, v in dict(info or {}).items():
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError):
            continue
        out[str(k)] = v
    return out


class ReasoningGymEnv:
    """One reasoning-gym question per episode, scored by the dataset's ``score_answer``."""

    def __init__(
        self, dataset: str, size: int = 10_000, answer_tag: str | None = "answer", **config: Any
    ):
        rg = _require("reasoning_gym", "reasoning-gym")
        if dataset not in rg.factory.DATASETS:
            raise ValueError(f"reasoning-gym has no dataset {dataset!r}")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._rg, self.dataset, self.size, self.config = rg, dataset, size, config
        self._tag = re.compile(rf"<{answer_tag}>(.*?)</{answer_tag}>", re.S) if answer_tag else None
        self._datasets: dict[int, Any] = {}
        self._data(0)  # a bad config fails here, when the environment is built
        self._entry: dict[str, Any] | None = None
        self._seed = 0

    def _data(self, seed: int) -> Any:
        if seed not in self._datasets:
            self._datasets[seed] = self._rg.create_dataset(
                self.dataset, seed=seed, size=self.size, **self.config
            )
        return self._datasets[seed]

    def prompt(self, seed: int, index: int) -> tuple[str, str]:
        """``(question, reference answer)`` of entry ``index``."""
        entry = self._data(seed)[index % self.size]
        return entry["question"], str(entry["answer"])

    def answer(self, action_text: str) -> str:
        if self._tag is not None:
            found = self._tag.findall(action_text)
            if found:
                return found[-1].strip()
        return action_text.strip()

    def reset(self, seed: int, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        index = task_index(task)
        self._seed, self._entry = seed, self._data(seed)[index % self.size]
        return self._entry["question"], {"entry": index % self.size}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._entry is None:
            raise RuntimeError("step() before reset()")
        score = float(self._data(self._seed).score_answer(self.answer(action_text), self._entry))
        return "", score, True, False, {"score": score}


class GemEnv:
    """A GEM environment through the protocol (text observations, multi-turn)."""

    def __init__(self, env_id: str, **kwargs: Any):
        gem = _require("gem", "gem-llm")
        self.env_id = env_id
        self._env = gem.make(env_id, **kwargs)

    @staticmethod
    def episode_seed(seed: int, index: int) -> int:
        return int(np.random.SeedSequence((seed, index)).generate_state(1)[0])

    def prompt(self, seed: int, index: int) -> tuple[str, str]:
        """``(first observation, "")``: a GEM game has no reference answer."""
        obs, _ = self._env.reset(seed=self.episode_seed(seed, index))
        return str(obs), ""

    def reset(self, seed: int, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        obs, info = self._env.reset(seed=self.episode_seed(seed, task_index(task)))
        return str(obs), _plain(info)

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self._env.step(action_text)
        return str(obs), float(reward), bool(terminated), bool(truncated), _plain(info)
