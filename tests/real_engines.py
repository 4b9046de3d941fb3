"""A tiny real-engine setup shared by the tests that run the JAX engines under the control plane:
its config overrides, a long-tailed prompt stream and a tokenizer that never ends a response."""

import numpy as np

from dora_jax.config.schema import OrchestratorConfig
from dora_jax.execution import PromptPayload
from dora_jax.orchestrator.rollout_manager import PromptSpec

NO_EOS = -1  # responses run to their drawn length (a long tail by construction)
REAL = [
    "model.vocab_size=32",
    "model.hidden_size=32",
    "model.intermediate_size=48",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "rollout.max_slots=4",
    "rollout.page_size=8",
    "rollout.num_pages=64",
    "rollout.max_prompt_len=16",
    "rollout.max_new_tokens=96",
    "rollout.prefill_chunk=16",
    "train.group_size=4",
    "train.length_buckets=[128]",
    "train.lr=1e-3",
]


class LongTailPrompts:
    """Random prompts; response lengths lognormal (median 8, p99/median ~ 12), capped at 96."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.index = 0

    def next_prompt(self) -> PromptSpec:
        n = int(self.rng.integers(4, 17))
        tokens = tuple(int(t) for t in self.rng.integers(3, 32, n))
        length = int(np.clip(round(8 * np.exp(1.07 * self.rng.standard_normal())), 1, 96))
        self.index += 1
        return PromptSpec(n, PromptPayload(self.index, tokens, "", max_new_tokens=length))


class FixedTok:
    """Decodes every id (the model's vocabulary), never an EOS."""

    eos_id = NO_EOS
    vocab_size = 32

    def decode(self, ids, skip_special=True):
        return "x" * len(ids)


def small_orchestrator(mode: str) -> OrchestratorConfig:
    """The control plane of these tests: K=2, TBS 2, RBS 4, plans every 8 ticks."""
    return OrchestratorConfig(
        mode=mode,
        staleness_k=2,
        train_batch_prompts=2,
        rollout_batch_prompts=4,
        plan_period_ticks=8,
        stall_s=120,
        kv_pressure_threshold=0.3,
    )
