"""Requests admitted together with one prompt (a GRPO group) are prefilled once
(``rollout.share_prefill``): the others copy its KV pages and sample their first token from its
logits with their own keys. What each samples must be what its own prefill gives."""

import dataclasses

import jax
import numpy as np
import pytest

from dora_jax.config import ConfigError, ModelConfig, RolloutConfig
from dora_jax.mesh import make_mesh
from dora_jax.model import init_params
from dora_jax.rollout import Engine, Request, request_key

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2
)
RCFG = RolloutConfig(
    page_size=8,
    num_pages=120,
    max_slots=16,
    max_prompt_len=32,
    max_new_tokens=40,
    prefill_chunk=8,
    temperature=1.0,
    decode_steps=4,
)
EOS = 2


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


def grouped_requests(groups=3, size=4, seed=0):
    """``groups`` prompts (lengths 5 to 20: one to three chunks) with ``size`` samples each,
    plus one request whose prompt nobody shares; every request has its own key."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups + 1):
        prompt = [int(t) for t in rng.integers(3, CFG.vocab_size, 5 + 7 * g)]
        for k in range(size if g < groups else 1):
            out.append(Request(f"g{g}-{k}", prompt, 0, request_key(seed, g, k), 40))
    return out


def run(params, rcfg, reqs):
    engine = Engine(CFG, rcfg, make_mesh(jax.devices()[:1], 1, 1), eos_id=EOS)
    engine.load_params(params, 0)
    engine.submit(reqs)
    finished, reports = {}, []
    while engine.num_requests:
        rep = engine.step()
        reports.append(rep)
        finished.update((f.id, f) for f in rep.finished)
    assert engine.alloc.pages_used == 0
    return finished, reports


@pytest.mark.parametrize(
    "change",
    [
        {},  # one fixed prefill shape of max_slots rows
        {"prefill_rows": 2},  # 4 distinct prompts: two prefill calls of 2 rows
        {"batch_invariant": False, "prefill_rows": 4},  # bucketed shapes
    ],
    ids=["invariant", "two-rows", "bucketed"],
)
def test_shared_prompts_sample_what_their_own_prefill_gives(params, change):
    reqs = grouped_requests()
    base, base_reps = run(params, dataclasses.replace(RCFG, share_prefill=False), reqs)
    shared_cfg = dataclasses.replace(RCFG, share_prefill=True, **change)
    shared, reps = run(params, shared_cfg, grouped_requests())
    assert base.keys() == shared.keys() == {r.id for r in reqs}
    for rid, f in base.items():
        g = shared[rid]
        assert g.tokens == f.tokens, rid
        np.testing.assert_allclose(g.logprobs, f.logprobs, atol=1e-5, rtol=0)
        assert g.finish_reason == f.finish_reason
    # the members after the first of each group took their prompt's K/V instead of computing it
    sharers = [r for r in reqs if r.id.split("-")[1] != "0"]
    shared_tokens = sum(len(r.prompt) for r in sharers)
    assert sum(r.shared_prefill_tokens for r in reps) == shared_tokens > 0
    assert sum(r.prefill_tokens for r in reps) == sum(len(r.prompt) for r in reqs) - shared_tokens
    assert sum(r.prefill_tokens for r in base_reps) == sum(len(r.prompt) for r in reqs)
    # per request its prompt's K/V were made once, computed or copied
    assert all(shared[r.id].prefill_tokens == len(r.prompt) for r in reqs)
    # different keys: the members of a group did not all sample the same response
    assert len({shared[f"g2-{k}"].tokens for k in range(4)}) > 1


def test_prefill_rows_is_checked():
    """At most max_slots (a recipe's rows stay valid when max_slots is overridden lower)."""
    with pytest.raises(ConfigError, match="prefill_rows"):
        RolloutConfig(max_slots=8, prefill_rows=-1)
    assert RolloutConfig(max_slots=8).resolved_prefill_rows == 8
    assert RolloutConfig(max_slots=8, prefill_rows=2).resolved_prefill_rows == 2
    assert RolloutConfig(max_slots=2, prefill_rows=4).resolved_prefill_rows == 2
