"""A multi-process run for tests (started by ``dora_jax.distributed.launcher.launch_local``, one
copy per process). Process 0 builds the experiment from ``configs/default.yaml`` and the
overrides, runs ``STEPS`` train steps, regenerates every migrated trajectory alone under the
params of its version on a device of its own, and writes what the tests check to
``run_dir/result.json`` and the final params to ``run_dir/params.npz``. The other processes host
their rollout groups.

    python tests/multiprocess_driver.py STEPS key=value ...
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora_jax.platform import fake_cpu_devices, limit_malloc_arenas  # noqa: E402

fake_cpu_devices(8)
limit_malloc_arenas()


def main(argv: list[str]) -> int:
    steps, overrides = int(argv[0]), argv[1:]
    from dora_jax.distributed.process import initialize, spec_from

    spec = spec_from()
    proc = initialize(spec) if spec is not None else None
    if proc is not None and not proc.is_main:
        from dora_jax.distributed.host import serve

        return serve(proc, log=lambda *a, **k: None)
    import jax
    import numpy as np

    from dora_jax.config import load_config
    from dora_jax.mesh import make_mesh
    from dora_jax.model.tokenizer import eos_ids
    from dora_jax.pipeline.experiment import build
    from dora_jax.rollout import Engine, Request, request_key

    cfg = load_config(ROOT / "configs" / "default.yaml", overrides)
    run_dir = Path(cfg.run_dir)
    exp = build(cfg, run_dir, process=proc)
    try:
        exp.grpo.forget = lambda keep: None  # keep every version: the check regenerates them
        consumed = []  # (request id, version, completion) of every consumed trajectory
        exp.grpo.on_consume.append(lambda *c: consumed.append(c))
        result = exp.runtime.run(steps, drain=True, stall_s=cfg.orchestrator.stall_s)
        rec, s = result.records, result.summary
        # regenerate migrated trajectories alone, never moved, under their version's params
        engine = Engine(
            exp.cfg.model,
            exp.cfg.rollout,
            make_mesh(jax.local_devices()[-1:], 1, 1),
            eos_ids(exp.tokenizer),
        )
        mismatches, checked = [], 0
        for rid, version, comp in [c for c in consumed if c[2].migrations > 0][:6]:
            engine.load_params(exp.grpo.params_for(version), version)
            if comp.loss_mask is not None:  # a conversation: its environment turns replayed
                again, fed = replay(engine, exp, cfg, rid, version, comp)
            else:
                engine.submit(
                    [
                        Request(
                            rid,
                            list(comp.prompt.tokens),
                            version,
                            request_key(cfg.seed, rid),
                            len(comp.tokens),
                        )
                    ]
                )
                again = next(f for _ in range(10_000) for f in engine.step().finished)
                fed = len(comp.prompt.tokens)
            checked += 1
            if again.tokens != comp.tokens or again.logprobs != comp.logprobs:
                mismatches.append(rid)
            if comp.prefill_tokens != fed:
                mismatches.append(f"{rid}: prefilled {comp.prefill_tokens} tokens, not {fed}")
        out = {
            "processes": 1 if proc is None else proc.count,
            "trainer_processes": len({d.process_index for d in exp.meshes.trainer.devices.flat}),
            "steps": s.steps,
            "consumed": [[c.request_id, c.trainer_version, c.staleness] for c in rec.consumed],
            "ledger": sorted(set(result.ledger.values())),
            "live_requests": exp.backend.live_requests(),
            "staleness_max": s.staleness_max,
            "migrated": s.migrated,
            "cross_host_weight_transfers": s.cross_host_weight_transfers,
            "cross_host_migrated": s.cross_host_migrated,
            "checked": checked,
            "mismatches": mismatches,
            "reprefill_tokens": s.reprefill_tokens,
        }
        (run_dir / "result.json").write_text(json.dumps(out))
        params = jax.device_get(exp.grpo.params_for(exp.grpo.version))
        flat = {
            jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)
        }
        np.savez(run_dir / "params.npz", **flat)
    finally:
        exp.close()
        if proc is not None:
            proc.finish()
    return 0


def replay(engine, exp, cfg, rid, version, comp):
    """Generate a consumed conversation again alone, never moved: the engine samples its model
    turns, each environment turn is the one the run recorded. Returns its last turn's record
    and the tokens a run that never re-prefilled feeds (the prompt, then each environment turn
    with the model token before it)."""
    from dora_jax.rollout import Request, request_key

    turns = _env_turns(comp.loss_mask, comp.tokens)
    fed = len(comp.prompt.tokens) + sum(1 + len(t) for t in turns)
    budget = comp.prompt.max_new_tokens or cfg.rollout.max_new_tokens
    engine.submit(
        [
            Request(
                rid,
                list(comp.prompt.tokens),
                version,
                request_key(cfg.seed, rid),
                budget,
                multi_turn=True,
                stop_seqs=exp.env.driver.stop_sequences,
            )
        ]
    )
    for _ in range(10_000):
        for rec in engine.step().turn_ends:
            if turns:
                engine.extend(rid, turns.pop(0))
            else:
                engine.end([rid])
                return rec, fed
    raise AssertionError(f"conversation {rid} did not end")


def _env_turns(mask, tokens) -> list[list[int]]:
    """The environment's turns of a conversation: the runs of tokens outside its loss mask."""
    out: list[list[int]] = []
    for i, m in enumerate(mask):
        if not m:
            if i == 0 or mask[i - 1]:
                out.append([])
            out[-1].append(tokens[i])
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
