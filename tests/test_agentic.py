"""Multi-turn environments in real runs (the engines, the control plane, the trainer): the
trainer's tokens and loss mask are the engine's conversation id for id; at staleness 0 the
trainer's logprobs of model tokens match the behavior logprobs; every conversation keeps one
version (``partial`` records its span); a raising, hanging or junk-returning environment is
counted once and the run goes on; a checkpoint taken while conversations wait on their
environment resumes exactly; an environment class in a file of the user's trains through the
public config and its info fields reach the metrics."""

import json
from pathlib import Path
from types import SimpleNamespace

import chex
import jax
import numpy as np
import pytest
from reliability_cases import expect  # tests/reliability_cases.py

from dora_jax.checkpoint import RunCheckpointer
from dora_jax.config import load_config
from dora_jax.main import main
from dora_jax.pipeline.experiment import build, run

ROOT = Path(__file__).resolve().parents[1]
ENVS = Path(__file__).with_name("agentic_envs.py")
TINY = [
    "warm_start.steps=0",
    "orchestrator.train_batch_prompts=2",
    "train.group_size=4",
    "orchestrator.rollout_batch_prompts=4",
    "rollout.max_new_tokens=48",
    "logging.progress=false",
    "checkpoint.async_save=false",
    "eval.num_prompts=0",
    "orchestrator.clock=logical",
    f"env.spec={ENVS}:Chatter",
    "env.workers=2",
    "env.timeout_s=20",
]


def make(tmp_path, name, *extra):
    cfg = load_config(ROOT / "configs" / "default.yaml", [*TINY, *extra])
    return build(cfg, tmp_path / name)


def watch(exp):
    """Every conversation that ends (``backend.on_finished``) and every batch the trainer packs,
    with the trajectories it was packed from."""
    ended, packed = [], []
    exp.backend.on_finished = lambda rid, comp: ended.append((rid, comp))
    pack = exp.trainer.pack

    def spy(trajectories, **kw):
        out = pack(trajectories, **kw)
        packed.append((list(trajectories), jax.device_get(out)))
        return out

    exp.trainer.pack = spy
    return ended, packed


def sample_view(batch, s):
    """Sample ``s`` of a packed batch: its tokens, and the loss mask and behavior logprobs at
    the positions that predict each of its tokens but the first."""
    where = np.asarray(batch.sample_index) == s
    tokens = np.asarray(batch.tokens)[where]
    return (
        tokens,
        np.asarray(batch.loss_mask)[where][:-1],
        np.asarray(batch.behavior_logprobs)[where][:-1],
    )


def test_the_trainer_sees_the_engines_conversation_id_for_id(tmp_path):
    exp = make(tmp_path, "run")
    ended, packed = watch(exp)
    try:
        run(exp, 3)
    finally:
        exp.close()
    comps = dict(ended)
    turns = [c.conversation["turns"] for c in comps.values()]
    assert max(turns) >= 3 and len(comps) >= 3 * 2 * 4
    tok = exp.tokenizer
    for trajectories, batch in packed:
        for s, t in enumerate(trajectories):
            tokens, mask, behavior = sample_view(batch, s)
            seq = np.concatenate([t.prompt_tokens, t.response_tokens])
            np.testing.assert_array_equal(tokens, seq)  # id for id
            P = len(t.prompt_tokens)
            np.testing.assert_array_equal(mask[: P - 1], False)
            own = np.asarray(t.loss_mask, bool)
            np.testing.assert_array_equal(mask[P - 1 :], own)
            np.testing.assert_array_equal(
                behavior[P - 1 :][mask[P - 1 :]], np.asarray(t.behavior_logprobs)[own]
            )
    for comp in comps.values():
        tokens, mask = np.asarray(comp.tokens), np.asarray(comp.loss_mask, bool)
        assert len(mask) == len(tokens) == len(comp.logprobs)
        assert all(lp == 0.0 for lp, m in zip(comp.logprobs, mask, strict=True) if not m)
        # the environment's turns are its answers "(1)", "(2)", ... as the tokenizer encodes
        # them; every model turn ends with a digit (the stop strings)
        env_text = tok.decode(tokens[~mask].tolist())
        k = comp.conversation["turns"] - 1
        assert env_text == "".join(f"({i})" for i in range(1, k + 1))
        cuts = np.flatnonzero(np.diff(mask.astype(int)) == -1)  # last token of each model turn
        assert all(tok.decode([int(tokens[c])]) in "0123456789" for c in cuts)


def test_at_staleness_zero_the_trainers_logprobs_match_the_behavior_logprobs(tmp_path):
    exp = make(tmp_path, "run", "orchestrator.mode=sync")
    ended, _ = watch(exp)
    try:
        run(exp, 2)
    finally:
        exp.close()
    model_tokens = 0
    for log in exp.grpo.log:
        m = jax.device_get(log.metrics)
        assert float(m["mismatch_tokens"]) > 0
        assert abs(float(m["mismatch_kl"])) < 1e-6, float(m["mismatch_kl"])
        model_tokens += float(m["mismatch_tokens"])
    consumed = {c.request_id for c in exp.runtime.records.consumed}
    # the loss covered the model's tokens, and no environment token
    assert model_tokens == sum(sum(c.loss_mask) for rid, c in ended if rid in consumed)
    assert any(not all(c.loss_mask) for _, c in ended)


@pytest.mark.parametrize("mode", ["dora", "sync", "one_step", "oversample", "partial"])
def test_every_conversation_keeps_one_version_partial_records_its_span(tmp_path, mode):
    exp = make(tmp_path, "run", f"orchestrator.mode={mode}")
    try:
        result = run(exp, 3)
    finally:
        exp.close()
    consumed = exp.runtime.records.consumed
    ids = [c.request_id for c in consumed]
    # steps x TBS x G (a logical run may have started one more step), none twice
    assert len(ids) == len(set(ids)) and len(ids) in (3 * 2 * 4, 4 * 2 * 4)
    spans = [c.version_span for c in consumed]
    summary = result.summary if hasattr(result, "summary") else exp.runtime.records.summary()
    if mode == "partial":
        assert all(s >= 1 for s in spans)
        if max(spans) > 1:  # re-prefilled under the new version: counted
            assert summary.reprefill_tokens > 0
    else:
        assert spans == [1] * len(spans)
        assert summary.reprefill_tokens == 0


def test_a_raising_hanging_or_junk_environment_is_counted_once_and_the_run_goes_on(tmp_path):
    exp = make(tmp_path, "run", f"env.spec={ENVS}:Faulty", "env.timeout_s=1.5")
    ended, _ = watch(exp)
    try:
        run(exp, 3)
        figures = exp.env.figures()
    finally:
        exp.close()
    assert exp.runtime.steps_done == 3
    errors = [c.conversation["error"] for _, c in ended]
    for kind in ("exception", "timeout", "invalid"):
        n = errors.count(kind)
        assert n > 0, kind
        assert figures[f"env/failures/{kind}"] == n  # once per failed call: the conversation ends
    assert figures["env/failures/crash"] == 0
    for _, c in ended:
        if c.conversation["error"] is not None:
            assert c.env_reward == 0.0
    consumed = {c.request_id for c in exp.runtime.records.consumed}
    failed = {rid for rid, c in ended if c.conversation["error"] is not None}
    assert consumed & failed  # failed conversations were trained on, with reward 0


def test_a_checkpoint_while_conversations_wait_resumes_exactly(tmp_path):
    straight = make(tmp_path, "straight")
    try:
        run(straight, 4)
    finally:
        straight.close()

    first = make(tmp_path, "resumed")
    ck = RunCheckpointer(tmp_path / "resumed" / "ckpt", async_save=False)
    try:
        run(first, 2, checkpointer=ck)
        assert first.backend.waiting_requests() > 0  # conversations wait on their environment
        assert first.env.driver.pending() > 0  # with their calls running
    finally:
        first.close()

    again = make(tmp_path, "resumed")
    try:
        RunCheckpointer(tmp_path / "resumed" / "ckpt").restore_latest(again)
        assert again.runtime.steps_done == 2
        run(again, 2)
    finally:
        again.close()
    chex.assert_trees_all_equal(
        jax.device_get(straight.trainer.export_params()),
        jax.device_get(again.trainer.export_params()),
    )
    ids = [c.request_id for c in straight.runtime.records.consumed]
    assert ids == [c.request_id for c in again.runtime.records.consumed]
    assert len(ids) == len(set(ids)) == 4 * 2 * 4
    assert again.runtime.records.summary().reprefill_tokens == 0
    chex.assert_trees_all_equal(
        [jax.device_get(s.metrics) for s in straight.grpo.log],
        [jax.device_get(s.metrics) for s in again.grpo.log],
    )
    assert [s.rewards for s in straight.grpo.log] == [s.rewards for s in again.grpo.log]


def test_an_environment_in_a_users_file_trains_through_the_public_config(tmp_path, capsys):
    """The train command (``launch/train.py``'s ``main``) with ``env.spec=file.py:Class``: two
    steps, and the class's info field reaches metrics.jsonl (``env/info/digits``) beside the
    turn figures."""
    rc = main([f"run_dir={tmp_path / 'run'}", *TINY, "train.total_steps=2", "env.kwargs.turns=3"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["env/info/digits"] > 0 and m["env/turns_mean"] >= 3
        assert m["env/failures/exception"] == 0


@pytest.mark.slow  # three steps of a run: about 50 s on 2 cores (the driver's own test is fast)
def test_an_observation_the_tokenizer_cannot_encode_is_a_failed_episode(tmp_path, capsys):
    """An environment answering in capitals, which the character tokenizer cannot encode: each
    such episode ends as an ``invalid`` environment failure with reward 0, the first is printed
    once, and the run trains on to its last step."""
    run_dir = tmp_path / "run"
    rc = main([f"run_dir={run_dir}", *TINY, "train.total_steps=3", f"env.spec={ENVS}:Shouting"])
    out = capsys.readouterr()
    expect("env-observation-not-encodable", out.out + out.err, rc)
    assert out.out.count("its observation cannot be encoded") == 1
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert lines[-1]["env/failures/invalid"] >= 1 and lines[-1]["env/end/env_error"] >= 1
    assert sum(m["failed_samples"] for m in lines) >= 1


def test_a_broken_environment_spec_is_one_line_before_anything_runs(tmp_path, capsys):
    rc = main([f"run_dir={tmp_path / 'run'}", *TINY, f"env.spec={ENVS}:Chatterr"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert "has no class 'Chatterr'" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_turn_ends_cross_processes_in_group_events():
    """A group on another process reports its conversations' turn ends in its events: they
    survive the message codec and the shift onto process 0's clock."""
    from dora_jax.distributed import codec
    from dora_jax.distributed.remote import shift
    from dora_jax.execution.commands import GroupEvent
    from dora_jax.orchestrator.backend import GroupTick
    from dora_jax.rollout import EngineFinished

    rec = EngineFinished(
        7,
        (5, 6),
        (9, 10, 11, 12, 9),
        (-0.5, 0.0, 0.0, -0.25, -1.0),
        3,
        "stop",
        2,
        1,
        0.5,
        turn_start=4,
        env_spans=((1, 3),),
    )
    span = GroupTick(1, 3, "decode", 4, 2, 0, 0, 0.01, 100.0, 100.01)
    sent = GroupEvent(1, span, turn_ends=(rec,))
    got = shift(codec.decode(codec.encode(sent)), 99.0, host=1)
    assert got.turn_ends == (rec,) and got.span.t0 == 1.0


def test_the_shutdown_of_other_processes_travels_alone():
    """Calls still queued for another process when a run closes (an environment turn for one of
    its conversations) go out first; the shutdown is a message of its own, which the host's
    serve loop reads (inside a batch it would be an unknown call, and the host would never
    stop)."""
    from dora_jax.distributed.cluster import Cluster
    from dora_jax.distributed.remote import HostLink

    sent = []

    class FakeChannel:
        def listen(self, host, fn):
            pass

        def send(self, host, msg):
            sent.append((host, msg))

        def close(self):
            sent.append("closed")

    cluster = Cluster.__new__(Cluster)
    cluster.index, cluster.count, cluster.channel = 0, 2, FakeChannel()
    cluster.proc = SimpleNamespace(present=lambda: [0, 1])  # (whom the last barrier waits for)
    cluster.link = HostLink(cluster.channel, None, [1], lambda e: None, lambda: 0.0, lambda: None)
    cluster.link.request(1, {"op": "extend", "g": 0, "items": [[5, [1, 2]]]}, wait=False)
    cluster.link.request(1, {"op": "end", "g": 0, "ids": [6]}, wait=False)
    cluster.stop_hosts()
    assert sent[-2] == (1, {"op": "shutdown", "among": [0, 1]}) and sent[-1] == "closed"
    assert [m["op"] for _, m in sent[:-2]] == ["batch"]
