"""Rollout engine: cached paged decode == full forward, engine invariants, KV migration between
submeshes and park-to-host with bit-identical continuation and zero re-prefill."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.config import ModelConfig, RolloutConfig
from dora_jax.execution.group import GroupWorker, Place
from dora_jax.mesh import make_mesh
from dora_jax.model import forward, init_params
from dora_jax.rollout import Engine, EngineError, PageAllocator, Request, request_key

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2
)
RCFG = RolloutConfig(
    page_size=8,
    num_pages=40,
    max_slots=4,
    max_prompt_len=24,
    max_new_tokens=72,
    prefill_chunk=8,
    temperature=1.0,
)
EOS = 2
# a mixture of experts (Qwen3-MoE: q/k norms, 8 experts, top-2) for the cached-decode parity
MOE_CFG = dataclasses.replace(
    CFG, family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16
)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


def mesh_on(*ids: int):
    return make_mesh([jax.devices()[i] for i in ids], 1, len(ids))


def make_requests(n, seed=0, version=0, max_new=(1, 72), prompt=(1, 24)):
    rng = np.random.default_rng(seed)
    return [
        Request(
            id=f"r{seed}-{i}",
            prompt=[int(t) for t in rng.integers(3, CFG.vocab_size, rng.integers(*prompt) + 1)],
            version=version,
            key=request_key(seed, i),
            max_new_tokens=int(rng.integers(max_new[0], max_new[1] + 1)),
        )
        for i in range(n)
    ]


def run_to_end(engine, limit=2000):
    finished = []
    for _ in range(limit):
        if not engine.num_requests:
            return finished
        finished += engine.step().finished
    raise AssertionError("engine did not drain")


def full_logits(params, seq, width=128, cfg=CFG):
    """Last-position logits of the full forward pass (padded to one width: one compile)."""
    T = len(seq)
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :T] = seq
    seg = (np.arange(width) < T).astype(np.int32)[None]
    out = forward(params, jnp.asarray(tokens), jnp.arange(width)[None], jnp.asarray(seg), cfg)
    return np.asarray(out[0, T - 1])


def decode_error(engine, params, cfg, joins, steps, width=128):
    """Step ``engine`` ``steps`` times, submitting ``joins[step]`` at its step, and compare every
    decode step's logits with the full forward pass: ``(max abs difference, comparisons)``."""
    reqs = list(joins.values())
    worst, checked = 0.0, 0
    for step in range(steps):
        if step in joins:
            engine.submit([joins[step]])
        engine.step()
        for r in reqs:
            if r.id in engine.last_logits and len(r.tokens) >= 2:
                # The step decoded tokens[-2] and produced the logits that chose tokens[-1].
                ref = full_logits(params, r.prompt + r.tokens[:-1], width=width, cfg=cfg)
                worst = max(worst, float(np.abs(engine.last_logits[r.id] - ref).max()))
                checked += 1
        engine.last_logits = {}
    return worst, checked


@pytest.mark.parametrize(
    "impl, model", [("reference", "dense"), ("pallas", "dense"), ("reference", "moe")]
)
def test_cached_decode_matches_full_forward(params, impl, model):
    """64 decode steps; sequences join at different steps and cross page boundaries (pages of 8
    tokens); every step's logits within 1e-4. Pallas runs in interpret mode on the CPU (its
    compile is most of this test's time, so it runs the full length too). The mixture of
    experts (dropless routing) must match as well."""
    cfg = MOE_CFG if model == "moe" else CFG
    if model == "moe":
        params = init_params(cfg, jax.random.key(0))
    rcfg = dataclasses.replace(RCFG, temperature=0.0, attention_impl=impl, max_new_tokens=80)
    interpret = True if impl == "pallas" else None  # Pallas on a CPU: interpret, explicitly
    engine = Engine(cfg, rcfg, mesh_on(4), eos_id=-1, return_logits=True, interpret=interpret)
    assert engine.impl == impl
    engine.load_params(params, 0)
    reqs = make_requests(3, seed=1, max_new=(80, 80))
    worst, checked = decode_error(engine, params, cfg, {0: reqs[0], 5: reqs[1], 11: reqs[2]}, 75)
    assert checked >= 3 * 60  # every request was compared over >= 60 of its decode steps
    assert worst <= 1e-4


FAMILY_CFGS = {
    # per-head q/k norms, head_dim 16 != 32 / 4
    "qwen3": dataclasses.replace(CFG, family="qwen3", head_dim=16, tie_word_embeddings=False),
    # a window of 5 (shorter than prompts and responses, pages of 8); blockwise prefill chunks
    # with blocks of 4, so whole key blocks fall outside the window
    "mistral-window5": dataclasses.replace(
        CFG, family="mistral", sliding_window=5, attention_block=4
    ),
    # layer 0 full, layer 1 windowed (Qwen2's max_window_layers); dense prefill chunks
    "qwen2-window11-after-1": dataclasses.replace(
        CFG, sliding_window=11, full_attention_layers=1, attention="dense"
    ),
}


def randomised_params(cfg, seed=0):
    """Every leaf random, norms (q_norm and k_norm included) around 1."""
    params = init_params(cfg, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = []
    for (path, w), k in zip(leaves, keys, strict=True):
        noise = jax.random.normal(k, w.shape, w.dtype)
        out.append(1.0 + 0.3 * noise if "norm" in jax.tree_util.keystr(path) else w + 0.02 * noise)
    return jax.tree.unflatten(treedef, out)


@pytest.mark.parametrize(
    "family, impl",
    [(f, "reference") for f in sorted(FAMILY_CFGS)]
    # the windowed Pallas decode in the default run; the other families' Pallas runs are slow
    + [
        (f, "pallas")
        if f == "mistral-window5"
        else pytest.param(f, "pallas", marks=pytest.mark.slow)
        for f in sorted(FAMILY_CFGS)
    ],
)
def test_cached_decode_matches_full_forward_per_family(family, impl):
    """As above for Qwen3 and for sliding windows: 36 decode steps after prompts of up to 24
    tokens (prefilled in chunks of 8), so the window slides over page boundaries in both the
    prefill chunks and the decode kernel."""
    cfg = FAMILY_CFGS[family]
    params = randomised_params(cfg)
    rcfg = dataclasses.replace(RCFG, temperature=0.0, attention_impl=impl, max_new_tokens=40)
    interpret = True if impl == "pallas" else None
    engine = Engine(cfg, rcfg, mesh_on(4), eos_id=-1, return_logits=True, interpret=interpret)
    assert engine.impl == impl
    engine.load_params(params, 0)
    reqs = make_requests(3, seed=2, max_new=(40, 40), prompt=(9, 24))
    joins = {0: reqs[0], 3: reqs[1], 7: reqs[2]}
    worst, checked = decode_error(engine, params, cfg, joins, 36, width=72)
    assert checked >= 3 * 25
    assert worst <= 1e-4


def test_engine_invariants_many_random_requests(params):
    """Tight pages force parking to host; everything finishes once, pages all come back."""
    rcfg = dataclasses.replace(RCFG, num_pages=16, max_slots=4)  # 15 pages < 4 x 12 needed
    engine = Engine(CFG, rcfg, mesh_on(5), eos_id=EOS)
    engine.load_params(params, 3)
    reqs = make_requests(24, seed=2, version=3)
    engine.submit(reqs)
    parked_seen, slots_used = 0, set()
    finished = []
    for _ in range(3000):
        if not engine.num_requests:
            break
        report = engine.step()
        finished += report.finished
        parked_seen = max(parked_seen, engine.load().parked)
        slots_used |= {i for i, r in enumerate(engine.slots) if r is not None}
        engine.alloc.check()
        assert engine.alloc.pages_used <= engine.alloc.pages_total
    ids = [f.id for f in finished]
    assert sorted(ids) == sorted(r.id for r in reqs) and len(set(ids)) == len(ids)
    assert all(f.version == 3 for f in finished)
    assert engine.alloc.pages_used == 0 and engine.load().free_slots == rcfg.max_slots
    assert parked_seen > 0  # the pressure path ran
    assert slots_used == set(range(rcfg.max_slots))
    by_id = {r.id: r for r in reqs}
    for f in finished:
        assert len(f.tokens) == len(f.logprobs) <= by_id[f.id].max_new_tokens
        assert f.finish_reason == ("eos" if f.tokens[-1] == EOS else "length")
        assert EOS not in f.tokens[:-1]
        assert f.prefill_tokens == len(f.prompt)  # parking never re-prefills
        assert all(lp <= 0 for lp in f.logprobs)


def test_admission_errors_are_clear(params):
    engine = Engine(CFG, RCFG, mesh_on(6), eos_id=EOS)
    (r,) = make_requests(1)
    with pytest.raises(EngineError, match="load_params must be called"):
        engine.submit([r])
    engine.load_params(params, 1)
    with pytest.raises(EngineError, match="is of version 0, this engine serves version 1"):
        engine.submit([r])
    long = dataclasses.replace(r, prompt=[5] * 25, version=1)
    with pytest.raises(
        EngineError,
        match=r"prompt of 25 tokens is longer than "
        r"rollout.max_prompt_len=24",
    ):
        engine.submit([long])
    with pytest.raises(EngineError, match="cannot hold one request"):
        Engine(CFG, dataclasses.replace(RCFG, num_pages=4), mesh_on(6), eos_id=EOS)
    engine.submit([dataclasses.replace(r, version=1)])
    engine.step()
    with pytest.raises(EngineError, match="cannot load version 2: the engine holds 1 request"):
        engine.load_params(params, 2)


@pytest.mark.parametrize(
    "where,temperature,impl",
    # greedy (temperature 0) is slow (6-9 s each): sampling at temperature 1 also carries the
    # sampling keys across, the stricter case
    [
        pytest.param(w, 0.0, "reference", marks=pytest.mark.slow)
        for w in ("other_submesh", "host_park", "tp2_submesh")
    ]
    + [(w, 1.0, "reference") for w in ("other_submesh", "host_park", "tp2_submesh")]
    + [("tp2_submesh", 1.0, "pallas")],  # Pallas (interpret) inside the 2-device shard_map
)
def test_migration_continues_bit_identically(params, temperature, where, impl):
    rcfg = dataclasses.replace(
        RCFG, temperature=temperature, top_k=20 if temperature else 0, attention_impl=impl
    )
    src_devs, dst_devs = {
        "other_submesh": ((0,), (1,)),
        "host_park": ((2,), (2,)),
        "tp2_submesh": ((4, 5), (6, 7)),
    }[where]
    reqs = make_requests(3, seed=4, max_new=(60, 60), prompt=(10, 20))
    interpret = True if impl == "pallas" else None  # Pallas on a CPU: interpret, explicitly

    # Reference: the same requests, never moved.
    ref_engine = Engine(CFG, rcfg, mesh_on(*src_devs), eos_id=-1, interpret=interpret)  # same TP
    assert ref_engine.impl == impl
    ref_engine.load_params(params, 0)
    ref_engine.submit([dataclasses.replace(r, tokens=[], logprobs=[]) for r in reqs])
    ref = {f.id: f for f in run_to_end(ref_engine)}

    src = Engine(CFG, rcfg, mesh_on(*src_devs), eos_id=-1, interpret=interpret)
    dst = Engine(CFG, rcfg, mesh_on(*dst_devs), eos_id=-1, interpret=interpret)
    src.load_params(params, 0)
    dst.load_params(params, 0)
    src.submit(reqs)
    for _ in range(25):  # mid-generation: 24 decode steps in, KV spans several pages
        src.step()
    moved = [reqs[0].id, reqs[2].id]
    if where == "host_park":
        exported = src.park(moved)
        assert isinstance(exported.kv, np.ndarray)
    else:
        exported = src.export_requests(moved)
    dst.import_requests(exported)
    src.alloc.check()
    dst_prefill = 0
    finished = []
    while src.num_requests or dst.num_requests:
        for e in (src, dst):
            rep = e.step()
            finished += rep.finished
            if e is dst:
                dst_prefill += rep.prefill_tokens
    assert dst_prefill == 0  # zero prefill on the destination
    got = {f.id: f for f in finished}
    assert set(got) == set(ref)
    for rid, f in got.items():
        assert f.tokens == ref[rid].tokens
        assert f.logprobs == ref[rid].logprobs  # bit-identical, not approximately
        assert f.prefill_tokens == len(f.prompt)
        assert f.migrations == (1 if rid in moved else 0)
    assert src.alloc.pages_used == 0 and dst.alloc.pages_used == 0


_COMPILES: list[str] = []


def _count_compile(name: str, *_, **__) -> None:
    if name == "/jax/core/compile/backend_compile_duration":
        _COMPILES.append(name)


def test_moves_compiled_ahead_compile_nothing_and_change_no_continuation(params):
    # a config of its own (other page shapes than the other tests'), so the first move of each
    # pair below meets no program another test compiled
    rcfg = dataclasses.replace(RCFG, page_size=4, num_pages=31)
    jax.monitoring.register_event_duration_secs_listener(_count_compile)
    reqs = make_requests(3, seed=5, max_new=(40, 40), prompt=(10, 20))
    ref_engine = Engine(CFG, rcfg, mesh_on(0), eos_id=-1)
    ref_engine.load_params(params, 0)
    ref_engine.submit([dataclasses.replace(r, tokens=[], logprobs=[]) for r in reqs])
    ref = {f.id: f for f in run_to_end(ref_engine)}

    def move(src_dev: int, dst_dev: int, ahead: str) -> tuple[int, dict]:
        src = Engine(CFG, rcfg, mesh_on(src_dev), eos_id=-1)
        dst = Engine(CFG, rcfg, mesh_on(dst_dev), eos_id=-1)
        for e in (src, dst):
            e.load_params(params, 0)
            if ahead == "engine":
                assert e.compile_moves() == [1, 2, 4, 8, 16, 32]  # 30 usable pages
            elif ahead == "idle worker":  # a wall-clock group compiles one size per idle turn
                w = GroupWorker(0, e, time.monotonic, Place())
                for _ in range(7):
                    w.idle()
        src.submit([dataclasses.replace(r, tokens=[], logprobs=[]) for r in reqs])
        for _ in range(12):
            src.step()
        _COMPILES.clear()
        dst.import_requests(src.export_requests([reqs[0].id, reqs[2].id]))
        compiles = len(_COMPILES)
        finished = run_to_end(src) + run_to_end(dst)
        return compiles, {f.id: f for f in finished}

    compiles, _ = move(2, 3, ahead="no")
    assert compiles >= 2  # the pack on the source, the unpack on the destination
    for devices, ahead in (((0, 1), "engine"), ((4, 5), "idle worker")):
        compiles, got = move(*devices, ahead=ahead)
        assert compiles == 0, ahead
        for rid, f in got.items():  # packing the padding page into itself changed nothing
            assert f.tokens == ref[rid].tokens and f.logprobs == ref[rid].logprobs


def test_import_refuses_another_version(params):
    a = Engine(CFG, RCFG, mesh_on(0), eos_id=EOS)
    b = Engine(CFG, RCFG, mesh_on(1), eos_id=EOS)
    a.load_params(params, 0)
    b.load_params(params, 1)
    a.submit(make_requests(1, max_new=(30, 30)))
    a.step()
    exported = a.export_requests([a.request_ids()[0]])
    with pytest.raises(EngineError, match="requests never move across versions"):
        b.import_requests(exported)


def test_page_allocator():
    alloc = PageAllocator(num_pages=6, page_size=4)
    assert alloc.pages_total == 5
    assert alloc.ensure("a", 9) == [1, 2, 3]
    assert alloc.ensure("a", 12) == [1, 2, 3]
    with pytest.raises(Exception, match="needs 3 more page"):
        alloc.ensure("b", 12)
    assert "b" not in alloc.owners()  # all or nothing
    alloc.ensure("b", 8)
    assert alloc.pages_free == 0
    assert alloc.free("a") == 3
    with pytest.raises(KeyError, match="double free"):
        alloc.free("a")
    alloc.check()
    assert 0 not in alloc.ensure("c", 12)


@pytest.mark.slow  # long: the default run stays under its time limit
def test_multi_step_decode_matches_single_step(params):
    """decode_steps=4 (one device call per 4 tokens) produces what single steps produce; EOS and
    max-new-token stops inside a call are honoured and pages still all come back."""
    outs = {}
    for k in (1, 4):
        rcfg = dataclasses.replace(RCFG, temperature=1.0, decode_steps=k, batch_invariant=False)
        engine = Engine(CFG, rcfg, mesh_on(k), eos_id=EOS)
        engine.load_params(params, 0)
        engine.submit(make_requests(10, seed=6))
        outs[k] = {f.id: f for f in run_to_end(engine)}
        assert engine.alloc.pages_used == 0
    assert outs[1].keys() == outs[4].keys()
    stops = {f.finish_reason for f in outs[4].values()}
    assert stops == {"eos", "length"}  # both stop paths ran inside multi-step calls
    for rid, f in outs[1].items():
        assert outs[4][rid].tokens == f.tokens
        np.testing.assert_allclose(outs[4][rid].logprobs, f.logprobs, atol=1e-5)


def test_any_of_several_eos_ids_ends_a_response(params):
    """EOS ids from the tokenizer (two here, as Qwen2.5-Instruct's <|im_end|> and
    <|endoftext|>) plus rollout.extra_eos_ids: a response ends at the first of any of them, on
    the host and inside multi-step device calls; the tokens before it are unchanged."""
    stops = {EOS, 7, 9}
    runs = {}
    for name, eos in (("none", -1), ("several", [EOS, 7])):
        rcfg = dataclasses.replace(RCFG, decode_steps=4, extra_eos_ids=(9,) if eos != -1 else ())
        engine = Engine(CFG, rcfg, mesh_on(6), eos_id=eos)
        assert engine.eos_ids == ((-1,) if eos == -1 else (EOS, 7, 9))
        engine.load_params(params, 0)
        engine.submit(make_requests(12, seed=7, max_new=(40, 72)))
        runs[name] = {f.id: f for f in run_to_end(engine)}
    ended = 0
    for rid, free in runs["none"].items():
        got = runs["several"][rid]
        cut = next((i for i, t in enumerate(free.tokens) if t in stops), None)
        if cut is None:
            assert got.tokens == free.tokens and got.finish_reason == "length"
        else:
            ended += 1
            assert got.tokens == free.tokens[: cut + 1] and got.finish_reason == "eos"
    assert ended >= 3  # several requests did stop on one of the ids


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="the guard acts only on CPU devices; Pallas compiles on GPUs",
)
def test_pallas_on_cpu_warns_and_runs_the_reference_unless_interpret_is_asked():
    rcfg = dataclasses.replace(RCFG, attention_impl="pallas")
    with pytest.warns(UserWarning, match="interpret mode"):
        engine = Engine(CFG, rcfg, mesh_on(7), eos_id=EOS)
    assert (engine.impl, engine.interpret) == ("reference", False)
    explicit = Engine(CFG, rcfg, mesh_on(7), eos_id=EOS, interpret=True)
    assert (explicit.impl, explicit.interpret) == ("pallas", True)
