"""The control plane on the real backend: JAX engines on four group submeshes and the GRPO
trainer on a 2x2 trainer submesh, 8 fake CPU devices, the tiny model, a long-tailed workload."""

import jax
import numpy as np
import pytest

from dora_jax.config import load_config
from dora_jax.mesh import build_meshes, make_mesh
from dora_jax.model import init_params
from dora_jax.orchestrator.engine_backend import EngineBackend, PromptPayload
from dora_jax.orchestrator.rollout_manager import PromptSpec
from dora_jax.orchestrator.runtime import Runtime
from dora_jax.pipeline.grpo import GRPOTrainer
from dora_jax.rollout import Engine, Request, request_key
from dora_jax.train import Trainer

NO_EOS = -1  # responses run to their drawn length: a long tail by construction
OVERRIDES = [
    "model.vocab_size=32", "model.hidden_size=32", "model.intermediate_size=48",
    "model.num_heads=4", "model.num_kv_heads=2",
    "rollout.max_slots=4", "rollout.page_size=8", "rollout.num_pages=64",
    "rollout.max_prompt_len=16", "rollout.max_new_tokens=96", "rollout.prefill_chunk=16",
    "train.group_size=4", "train.length_buckets=[128]", "train.lr=1e-3",
    "orchestrator.train_batch_prompts=2", "orchestrator.rollout_batch_prompts=4",
    "orchestrator.staleness_k=2", "orchestrator.plan_period_ticks=8",
]  # fmt: skip


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


def run(mode: str, steps: int = 4):
    cfg = load_config(None, [*OVERRIDES, f"orchestrator.mode={mode}"])
    meshes = build_meshes(cfg.mesh)
    params = init_params(cfg.model, jax.random.key(0))
    trainer = Trainer(cfg.model, cfg.train, mesh=meshes.trainer, params=params)
    grpo = GRPOTrainer(trainer, _FixedTok(), lambda response, answer: float(len(response) % 3),
                       train_ticks=3)  # fmt: skip
    backend = EngineBackend(cfg.model, cfg.rollout, meshes.groups, NO_EOS, params,
                            grpo.params_for, seed=cfg.seed)  # fmt: skip
    runtime = Runtime(cfg.orchestrator, cfg.train.group_size, backend, grpo, LongTailPrompts(0))
    result = runtime.run(steps)
    return cfg, result, backend, grpo


class _FixedTok:
    eos_id = NO_EOS
    vocab_size = 32

    def decode(self, ids, skip_special=True):
        return "x" * len(ids)


@pytest.fixture(scope="module")
def dora_run():
    return run("dora")


def test_dora_on_real_engines(dora_run):
    cfg, result, backend, grpo = dora_run
    s = result.summary
    assert s.steps >= 4 and grpo.trainer.version >= 4
    assert s.max_live_versions >= 2  # several policy versions generated at the same time
    assert s.staleness_max <= cfg.orchestrator.staleness_k
    assert s.max_version_span == 1 and s.reprefill_tokens == 0
    assert backend.overheads.migrated_requests >= 1
    consumed = [rec for rec in result.records.consumed]
    assert len({c.request_id for c in consumed}) == len(consumed)  # nothing consumed twice
    for log in grpo.log:  # every train step saw finite metrics
        assert np.isfinite(float(log.metrics["loss"]))


def test_migrated_requests_continue_bit_identically(dora_run):
    """Regenerate each migrated trajectory alone, never moved, under the params of its version:
    the same tokens and the same logprobs, bit for bit; and it was prefilled exactly once."""
    cfg, result, backend, grpo = dora_run
    migrated = [(rid, v, c) for rid, v, c in grpo.consumed if c.migrations > 0]
    assert migrated, "the run migrated no consumed request"
    for rid, version, comp in migrated[:3]:
        assert comp.prefill_tokens == len(comp.prompt.tokens)
        engine = Engine(cfg.model, cfg.rollout, make_mesh(jax.devices()[7:8], 1, 1), NO_EOS)
        engine.load_params(grpo.params_for(version), version)
        engine.submit([Request(rid, list(comp.prompt.tokens), version,
                               request_key(cfg.seed, rid), len(comp.tokens))])  # fmt: skip
        (again,) = [f for _ in range(200) for f in engine.step().finished][:1]
        assert again.tokens == comp.tokens
        assert again.logprobs == comp.logprobs


def test_partial_reprefills_and_sync_bubbles_more(dora_run):
    _, dora, _, _ = dora_run
    _, partial, _, _ = run("partial")
    assert partial.summary.reprefill_tokens > 0
    _, sync, _, _ = run("sync")
    assert sync.summary.bubble > dora.summary.bubble


def test_engine_backend_contract_errors(dora_run):
    from dora_jax.orchestrator.backend import BackendError

    _, _, backend, _ = dora_run
    with pytest.raises(BackendError, match="published version 7 after"):
        backend.publish(7)
    with pytest.raises(BackendError, match="is not in flight"):
        backend.interrupt([10**9])
