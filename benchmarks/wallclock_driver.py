"""One process of a wall-clock benchmark run (started by ``launch_local``, one copy per process).

    python benchmarks/wallclock_driver.py throughput OUT.json WARMUP STEPS key=value ...
    python benchmarks/wallclock_driver.py migration OUT.json CONTEXTS key=value ...

Process 0 runs the control plane and the trainer; the other processes host rollout groups.

``throughput``: ``WARMUP`` train steps (everything compiles), then ``STEPS`` measured ones; writes
the window's trajectories per second, the share of the trainer's busy time with some group
decoding, each group's idle share, the control round's own time on process 0, and a timeline
picture of the window (``run_dir/timeline_window.png``). An override ``config=PATH`` reads
that preset instead of ``configs/default.yaml``. In a multi-turn run (``env.spec``) it also
writes the model tokens per second of the window's consumed conversations and, per consumed
conversation (or single-turn response: one turn), its figures to
``run_dir/conversations.jsonl``.

``migration``: a request with ``C`` tokens of context (for each C of ``CONTEXTS``, comma
separated) on a group of process 0 moves with its KV to a group of process 1; the time is set
against prefilling those C tokens on that group.
"""

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora_jax.platform import fake_cpu_devices, limit_malloc_arenas  # noqa: E402

fake_cpu_devices(8)
limit_malloc_arenas()


def main(argv: list[str]) -> int:
    what, out = argv[0], Path(argv[1])
    from dora_jax.distributed.process import initialize, spec_from

    spec = spec_from()
    proc = initialize(spec) if spec is not None else None
    if proc is not None and not proc.is_main:
        from dora_jax.distributed.host import serve

        return serve(proc, log=lambda *a, **k: None)
    try:
        figures = throughput(proc, argv[2:]) if what == "throughput" else migration(proc, argv[2:])
        out.write_text(json.dumps(figures, indent=1))
    finally:
        if proc is not None:
            proc.finish()
    return 0


def throughput(proc, argv: list[str]) -> dict:
    from dora_jax.config import load_config
    from dora_jax.orchestrator.records import intersection_length, merge_intervals
    from dora_jax.pipeline.experiment import build
    from dora_jax.report import plot_timeline, window

    warmup, steps, overrides = int(argv[0]), int(argv[1]), argv[2:]
    preset = ROOT / "configs" / "default.yaml"
    for o in [o for o in overrides if o.startswith("config=")]:
        preset = Path(o.removeprefix("config="))
        overrides = [x for x in overrides if x != o]
    cfg = load_config(preset, overrides)
    run_dir = Path(cfg.run_dir)  # runs beside each other share one cached warm start
    exp = build(cfg, run_dir, process=proc, warm_start_dir=run_dir.parent / "warm_start")
    rt = exp.runtime
    conversations: dict[int, dict] = {}  # request id -> its figures (multi-turn runs)
    responses: dict[int, dict] = {}  # the same figures of a single-turn response

    def on_consume(rid, version, comp):
        if comp.conversation is not None:
            c = comp.conversation
            turns = _model_turns(comp.loss_mask)
            conversations[rid] = {
                "turns": c["turns"],
                "model_tokens": sum(turns),
                "env_tokens": c["env_tokens"],
                "env_seconds": c["env_seconds"],
                "prompt_tokens": len(comp.prompt.tokens),
                "model_turn_tokens": turns,
                "reward": comp.env_reward,
            }
        elif comp.tokens:
            responses[rid] = {
                "turns": 1,
                "model_tokens": len(comp.tokens),
                "env_tokens": 0,
                "env_seconds": 0.0,
                "prompt_tokens": len(comp.prompt.tokens),
                "model_turn_tokens": [len(comp.tokens)],
                "reward": None,
            }

    exp.grpo.on_consume.append(on_consume)
    rounds: list[float] = []
    tick = rt.tick

    def timed_tick():  # the round's own time on process 0, without the wait for reports
        t0 = time.perf_counter()
        waited = [0.0]
        step = rt.backend.step

        def timed_step():
            w0 = time.perf_counter()
            try:
                return step()
            finally:
                waited[0] += time.perf_counter() - w0

        rt.backend.step = timed_step
        try:
            tick()
        finally:
            rt.backend.step = step
        rounds.append(time.perf_counter() - t0 - waited[0])

    try:
        rt.run(warmup)
        rt.tick = timed_tick
        t_a = rt.clock.now()
        first = rt.steps_done
        rt.run(steps)
    finally:
        exp.close()
    rec = rt.records
    t_b = rec.steps[first + steps - 1].end
    span = t_b - t_a
    win = [s for s in rec.steps[first : first + steps]]
    taken = [c for c in rec.consumed if first <= c.trainer_version < first + steps]
    consumed = len(taken)
    tokens = sum(c.response_len for c in taken)
    model_tokens = sum(
        conversations[c.request_id]["model_tokens"] for c in taken if c.request_id in conversations
    )
    rows = conversations or responses  # the window's consumed ones, for the simulator
    with open(Path(cfg.run_dir) / "conversations.jsonl", "w") as f:
        for c in taken:
            if c.request_id in rows:
                f.write(json.dumps(rows[c.request_id]) + "\n")
    spans = [g for g in rec.spans if g.t1 > t_a and g.t0 < t_b]
    rolling = [
        (max(g.t0, t_a), min(g.t1, t_b)) for g in spans if g.activity in ("prefill", "decode")
    ]
    train = merge_intervals([(max(s.start, t_a), min(s.end, t_b)) for s in win])
    busy_train = sum(b - a for a, b in train)
    idle = []
    for g in range(rec.num_groups):
        busy = sum(
            min(x.t1, t_b) - max(x.t0, t_a) for x in spans if x.group == g and x.activity != "idle"
        )
        idle.append(max(0.0, 1.0 - busy / span))
    view = window(rec, t_a, min(t_b, t_a + 12.0))
    title = f"{cfg.orchestrator.mode}, wall clock: 12 s of the measured window"
    plot_timeline(view, Path(cfg.run_dir) / "timeline_window.png", title=title)
    rounds.sort()
    # the train steps' own seconds in the window: a step much slower than the median compiled
    # the step for a batch shape met for the first time
    step_s = sorted(
        s.timing["train_step_s"]
        for s in exp.grpo.log[first : first + steps]
        if "train_step_s" in s.timing
    )
    median = step_s[len(step_s) // 2] if step_s else 0.0
    slow = [t for t in step_s if t > 3 * median]
    # weight loads in the window, wall seconds each on the group's own thread (across processes:
    # the pull of the staged params included): on sync's critical path once per step
    loads = sorted(x.t1 - x.t0 for x in spans if x.activity == "transfer")
    gaps = _between_steps(win, spans)
    return {
        "mode": cfg.orchestrator.mode,
        "steps": steps,
        "seconds": span,
        "trajectories": consumed,
        "trajectories_per_s": consumed / span,
        # dora's window favours prompt groups without a long tail (those finish first; the rest
        # are still in flight at the window's end): response tokens per second count the work
        "response_tokens_per_s": tokens / span,
        # multi-turn: the model's tokens of the consumed conversations (their environment turns
        # left out)
        "model_tokens_per_s": model_tokens / span,
        "conversations": len(conversations),
        "train_busy_share": busy_train / span,
        "overlap": intersection_length(train, rolling) / busy_train if busy_train else 0.0,
        "group_idle": idle,
        "round_ms_mean": 1e3 * sum(rounds) / len(rounds),
        "round_ms_p99": 1e3 * rounds[int(0.99 * (len(rounds) - 1))],
        "rounds": len(rounds),
        "migrated": sum(n for t, n in rec.migrations if t_a <= t < t_b),
        "staleness_max": max((c.staleness for c in rec.consumed), default=0),
        "train_step_s_median": median,
        "compiling_steps": len(slow),
        "compiling_steps_s": sum(slow),
        # steps run in a bigger compiled shape while their own compiled on a worker thread
        # (train.compile_shapes), and the shapes compiled there over the whole run
        "fallback_steps": int(
            sum(s.timing.get("fallback_shape", 0.0) for s in exp.grpo.log[first : first + steps])
        ),
        "compiled_ahead": len(exp.trainer.compiled_ahead),
        "weight_loads": len(loads),
        "weight_load_s_median": loads[len(loads) // 2] if loads else 0.0,
        # between one train step's end and the next one's start (sync: the rollout-only phase),
        # mean seconds per gap: all of it, the part some group loaded weights, the part some
        # group prefilled or decoded (and none loaded), the rest (control rounds, hand-overs)
        "between_steps_s": gaps,
    }


def _between_steps(win, spans) -> dict:
    """Where the time between consecutive train steps of the window went (means per gap)."""
    from dora_jax.orchestrator.records import intersection_length, merge_intervals

    pairs = [(a.end, b.start) for a, b in zip(win, win[1:], strict=False) if b.start > a.end]
    if not pairs:
        return {"gaps": 0}

    def clipped(kinds, a, b):
        return merge_intervals(
            [
                (max(x.t0, a), min(x.t1, b))
                for x in spans
                if x.activity in kinds and x.t1 > a and x.t0 < b
            ]
        )

    total = load = roll = lead = tail = 0.0
    calls = {"prefill": 0, "decode": 0}
    for a, b in pairs:
        for x in spans:
            if x.activity in calls and a <= x.t0 < b:
                calls[x.activity] += 1
        loading = clipped(("transfer",), a, b)
        rolling = clipped(("prefill", "decode", "migrate"), a, b)
        total += b - a
        load += sum(y - x for x, y in loading)
        roll += sum(y - x for x, y in rolling) - intersection_length(rolling, loading)
        work = merge_intervals(loading + rolling)
        lead += work[0][0] - a if work else b - a
        tail += b - work[-1][1] if work else 0.0
    n = len(pairs)
    return {
        "gaps": n,
        "total": total / n,
        "weight_load": load / n,
        "rollout": roll / n,
        "other": (total - load - roll) / n,
        "before_first_work": lead / n,
        "after_last_work": tail / n,
        "prefill_steps": calls["prefill"] / n,
        "decode_steps": calls["decode"] / n,
    }


def _model_turns(mask) -> list[int]:
    """The lengths of the runs of true in a conversation's loss mask: its model turns."""
    out, n = [], 0
    for m in mask:
        if m:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out + ([n] if n else [])


def migration(proc, argv: list[str]) -> dict:
    """Cross-process KV migration against re-prefill, at each context length."""
    import jax
    import numpy as np

    from dora_jax.config import load_config, to_dict
    from dora_jax.distributed.cluster import Cluster
    from dora_jax.execution import commands as cmds
    from dora_jax.execution.group import GroupWorker, Place
    from dora_jax.execution.transport import Inline
    from dora_jax.mesh import build_meshes, make_mesh
    from dora_jax.model import abstract_params, init_params, param_axes
    from dora_jax.orchestrator.clock import Bus, LogicalClock
    from dora_jax.rollout import Engine, Request, request_key
    from dora_jax.sharding import rollout_rules, tree_shardings

    contexts = [int(c) for c in argv[0].split(",")]
    cfg = load_config(ROOT / "configs" / "default.yaml", argv[1:])
    meshes = build_meshes(cfg.mesh)
    params = init_params(cfg.model, jax.random.key(0))
    clock, bus = LogicalClock(), Bus()
    cluster = Cluster(proc)
    stage = tree_shardings(
        param_axes(cfg.model),
        abstract_params(cfg.model),
        rollout_rules(),
        make_mesh(jax.local_devices()[:1], 1, 1),
    )
    cluster.connect(bus.post, clock.now, lambda: stage)
    cluster.start_hosts(to_dict(cfg), [-1], cfg.seed, False)
    src_g = next(g for g, m in enumerate(meshes.groups) if cluster.owner(m, "g") == 0)
    dst_g = next(g for g, m in enumerate(meshes.groups) if cluster.owner(m, "g") == 1)
    engine = Engine(cfg.model, cfg.rollout, meshes.groups[src_g], -1)
    engine.load_params(params, 0)
    src = Inline(GroupWorker(src_g, engine, clock.now, Place(cluster.transfers)))
    dst = cluster.remote(dst_g, 1, True, cfg.rollout.num_pages - 1)
    dst.send(cmds.Load(dst_g, 0, ticket=cluster.link.stage_trainer(params, 0)))
    rows = []
    rng = np.random.default_rng(0)
    for c in contexts:
        times = {"migrate": [], "prefill": []}
        for rep in range(4):  # the first of each is a warm-up (compiles)
            rid = 1000 * c + rep
            prompt = [int(t) for t in rng.integers(3, 60, c)]
            # on the destination: prefill the whole context (what a re-prefill costs)
            req = Request(rid, prompt, 0, request_key(cfg.seed, rid), 2)
            t0 = time.perf_counter()
            dst.send(cmds.Submit(dst_g, (req,)))
            dst.send(cmds.Step(dst_g))
            t_prefill = time.perf_counter() - t0
            # on the source: the same context, then its KV moves to the destination
            req2 = Request(rid + 500, prompt, 0, request_key(cfg.seed, rid + 500), 4)
            src.send(cmds.Submit(src_g, (req2,)))
            src.send(cmds.Step(src_g))
            t0 = time.perf_counter()
            ticket = cluster.transfers.new_id()  # (the KV crosses to the other process)
            src.send(cmds.SendRequests(src_g, (req2.id,), ticket, remote=True))
            dst.send(cmds.ReceiveRequests(dst_g, ticket, remote=True))
            t_migrate = time.perf_counter() - t0
            dst.send(cmds.Step(dst_g))
            if rep:
                times["prefill"].append(t_prefill)
                times["migrate"].append(t_migrate)
        m, p = float(np.median(times["migrate"])), float(np.median(times["prefill"]))
        rows.append({"context": c, "migrate_s": m, "prefill_s": p, "ratio": m / p})
    cluster.stop_hosts()
    return {"rows": rows}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
