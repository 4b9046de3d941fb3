"""Sampled completions in the run's record (dora_jax/pipeline/samples.py): the trajectories a
train step keeps as text and their fields, ``samples.jsonl`` with TensorBoard text, a W&B table
and the terminal's sample, the held-out evaluation's ``eval_samples.jsonl``, and a crashed run
resumed with every step's samples once."""

import json
import struct
from pathlib import Path
from types import SimpleNamespace

from hf_tokenizer_files import write_word_tokenizer  # tests/hf_tokenizer_files.py

from dora_jax.data.scoring import Scorer
from dora_jax.execution.payloads import Completion, PromptPayload
from dora_jax.main import main
from dora_jax.metrics import MetricsWriter
from dora_jax.model.tokenizer import CharTokenizer, HFTokenizer, response_ids
from dora_jax.orchestrator.backend import FinishedRequest
from dora_jax.orchestrator.transfer_queue import ReadyGroup
from dora_jax.pipeline.grpo import GRPOTrainer
from dora_jax.pipeline.samples import (
    EVAL_SAMPLES_FILE,
    SAMPLES_FILE,
    TABLE_COLUMNS,
    SampleLog,
    chosen,
    clip,
    trajectory_sample,
)

ROOT = Path(__file__).resolve().parents[1]
TOK = CharTokenizer()
FIELDS = [
    "request_id",
    "prompt_group",
    "member",
    "version",
    "staleness",
    "prompt",
    "response",
    "reward",
    "reward_metrics",
    "reward_error",
    "response_len",
    "finish",
    "answer",
]


class StubTrainer:
    """Only what GRPOTrainer asks of a Trainer (no arrays, no jit), at version ``version``."""

    def __init__(self, version: int = 0):
        self.state = SimpleNamespace(version=version, skipped=0)

    def export_params(self, shardings=None):
        return {"v": self.state.version}

    def pack(self, trajectories, num_groups, **kw):
        return trajectories

    def step(self, packed):
        self.state.version += 1
        return {"loss": 0.0}


def finished(rid: int, pg: int, prompt: str, response: str, answer: str = "7", **kw):
    ids = (*TOK.encode(response), TOK.eos_id)
    payload = PromptPayload(pg, tuple(TOK.encode(prompt)), answer)
    comp = Completion(payload, ids, (0.0,) * len(ids), kw.pop("finish", "eos"), 5, 0, **kw)
    return FinishedRequest(rid, pg, len(payload.tokens), len(ids), (0,), comp)


def reward(response: str, answer: str):
    if response == "boom":
        raise RuntimeError("a verifier bug")
    return {"score": float(response == answer), "length": float(len(response))}


def test_a_step_keeps_its_first_trajectories_as_text():
    """Batch order, a group's members by request id; the texts are the tokenizer's decoding of
    the consumed ids (prompt with specials, response without EOS); reward parts and errors."""
    # group g's member j is request g * G + j (G = 2); a group's trajectories come in the order
    # they finished
    g0 = ReadyGroup(4, 3, (finished(9, 4, "9-2=", "7"), finished(8, 4, "9-2=", "boom")), 0)
    g1 = ReadyGroup(2, 5, (finished(5, 2, "8-1=", "x y"), finished(4, 2, "8-1=", "1")), 0)
    assert list(chosen([g0, g1], 3).items()) == [(8, 0), (9, 1), (4, 0)]  # rid -> member
    grpo = GRPOTrainer(StubTrainer(version=6), TOK, Scorer(reward), samples_per_step=3)
    grpo.step([g0, g1])
    rows = grpo.log[-1].samples
    assert [r["request_id"] for r in rows] == [8, 9, 4]
    assert all(list(r) == FIELDS for r in rows)
    boom, right, other = rows
    assert boom["reward"] == 0.0 and boom["reward_error"] == "exception"
    assert right["reward"] == 1.0 and right["reward_error"] is None
    assert right["reward_metrics"] == {"length": 1.0}
    assert (right["prompt"], right["response"], right["answer"]) == ("9-2=", "7", "7")
    assert (right["version"], right["staleness"], right["prompt_group"]) == (3, 3, 4)
    assert (other["version"], other["staleness"], other["member"]) == (5, 1, 0)
    assert right["response_len"] == 2 and right["finish"] == "eos"  # "7" and the EOS
    comp = g1.trajectories[1].payload
    assert other["response"] == TOK.decode(response_ids(TOK, comp.tokens)) == "1"

    quiet = GRPOTrainer(StubTrainer(), TOK, Scorer(reward))  # samples_per_step 0: none kept
    quiet.step([g0])
    assert quiet.log[-1].samples == []


def test_a_conversation_is_kept_turn_by_turn():
    """Model and environment turns marked apart (loss mask), the environment's reward, the
    conversation's figures and its end reason."""
    model1, env, model2 = TOK.encode("3+4"), TOK.encode("\n=7\n"), (*TOK.encode("7"), TOK.eos_id)
    tokens = (*model1, *env, *model2)
    mask = (True,) * len(model1) + (False,) * len(env) + (True,) * len(model2)
    payload = PromptPayload(0, tuple(TOK.encode("add:")), "")
    figures = {"turns": 2, "end_reason": "terminated", "error": None}
    comp = Completion(
        payload,
        tokens,
        (0.0,) * len(tokens),
        "terminated",
        4,
        0,
        loss_mask=mask,
        env_reward=1.0,
        conversation=figures,
    )
    t = FinishedRequest(3, 0, 4, len(tokens), (0,), comp)
    row = trajectory_sample(TOK, t, ReadyGroup(0, 0, (t,), 0), 3, 1.0, None)
    assert row["turns"] == [
        {"role": "model", "text": "3+4"},
        {"role": "environment", "text": "\n=7\n"},
        {"role": "model", "text": "7"},
    ]
    assert row["response"] == "[model] 3+4\n[environment] \n=7\n\n[model] 7"
    assert row["reward"] == 1.0 and row["reward_error"] is None and row["answer"] is None
    assert row["finish"] == "terminated" and row["conversation"] == figures


def test_a_hf_tokenizer_prompt_keeps_its_template(tmp_path):
    tok = HFTokenizer(write_word_tokenizer(tmp_path, ["what", "is", "two", "four"]))
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "what is two"}]))
    response = (*tok.encode("four"), *tok.eos_ids)
    comp = Completion(PromptPayload(0, tuple(prompt), "four"), response, (0.0,) * 2, "eos", 1, 0)
    t = FinishedRequest(0, 0, len(prompt), 2, (0,), comp)
    row = trajectory_sample(tok, t, ReadyGroup(0, 0, (t,), 0), 0, 1.0, None)
    assert "<|im_start|>" in row["prompt"] and "what is two" in row["prompt"]
    assert row["response"] == "four"  # no <|im_end|>


def _row(rid: int, reward: float = 0.5) -> dict:
    return dict(
        request_id=rid,
        prompt_group=rid // 4,
        member=rid % 4,
        version=0,
        staleness=1,
        prompt="12-3=",
        response="12,9,6,3#3\n" * 3,
        reward=reward,
        reward_metrics={},
        reward_error=None,
        response_len=31,
        finish="eos",
        answer="12,9,6,3,0#0",
    )


def _tb_texts(run_dir: Path) -> dict[tuple[int, str], str]:
    from tensorboardX.proto import event_pb2

    out = {}
    for f in (run_dir / "tb").rglob("events.out.tfevents*"):
        data, i = f.read_bytes(), 0
        while i < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                if v.tensor.string_val:
                    out[(event.step, v.tag)] = v.tensor.string_val[0].decode()
    return out


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_sample_log_writes_tensorboard_wandb_and_the_terminal(tmp_path, capsys):
    tables = []
    mirror = SimpleNamespace(log_table=lambda *a: tables.append(a))
    writer = MetricsWriter(tmp_path, tensorboard=True)
    log = SampleLog(tmp_path, 2, 2, resume=False, done=0, writer=writer, mirror=mirror)
    for step in (1, 2, 3):
        log.write(step, [_row(4 * step), _row(4 * step + 1), _row(4 * step + 2)])
    writer.close()
    rows = read(tmp_path / SAMPLES_FILE)
    assert [(r["step"], r["request_id"]) for r in rows] == [
        (1, 4),
        (1, 5),
        (2, 8),
        (2, 9),
        (3, 12),
        (3, 13),
    ]
    texts = _tb_texts(tmp_path)
    assert set(texts) == {(s, "samples/text_summary") for s in (1, 2, 3)}
    assert (
        "12,9,6,3#3" in texts[(2, "samples/text_summary")]
        and "reward 0.500" in texts[(2, "samples/text_summary")]
    )
    assert [(t[0], t[1], t[2]) for t in tables] == [
        (s, "samples", TABLE_COLUMNS) for s in (1, 2, 3)
    ]
    assert tables[0][3][1][:3] == [1, 5, 1]  # step, request id, prompt group
    out = capsys.readouterr().out
    assert out.count("sample at step") == 1 and "sample at step 2 (prompt group 2, member 0" in out
    assert "  response | 12,9,6,3#3" in out and "  answer | 12,9,6,3,0#0" in out.replace("  ", " ")

    # a resume from step 2 keeps the rows of steps 1 and 2; a fresh run starts over
    SampleLog(tmp_path, 2, 2, resume=True, done=2)
    assert [r["step"] for r in read(tmp_path / SAMPLES_FILE)] == [1, 1, 2, 2]
    SampleLog(tmp_path, 0, 0, resume=False, done=0).write(1, [_row(0)])
    assert not (tmp_path / SAMPLES_FILE).exists()  # samples_per_step 0: no file


def test_clip_keeps_the_start_and_the_end():
    assert clip("a\nb") == ["a", "b"]
    text = "\n".join(f"line {i}" for i in range(10)) + "\n" + "x" * 400
    assert clip(text, lines=4, width=160) == [
        "line 0",
        "... (10 more lines) ...",
        "x" * 160,
        "x" * 80,
    ]


TINY = [
    "warm_start.steps=0",
    "mesh.trainer.devices=0:1",
    "mesh.trainer.data=1",
    "mesh.trainer.model=1",
    "mesh.rollout.devices=1:2",
    "mesh.rollout.groups=1",
    "train.group_size=4",
    "orchestrator.train_batch_prompts=2",
    "orchestrator.rollout_batch_prompts=4",
    "rollout.max_new_tokens=16",
    "train.length_buckets=[48]",
    "logging.progress=false",
    "eval.num_prompts=3",
]


def test_a_crashed_run_resumed_has_each_steps_samples_once(tmp_path, capsys, monkeypatch):
    """A logical-clock run checkpointed at step 2 crashes in step 4's train step, with step 3's
    samples and evaluation written past the checkpoint; the resumed run cuts them and writes
    them again: every step's samples once, the same texts as before the crash, decoded from the
    consumed token ids; one eval row per held-out problem at every evaluation; TensorBoard text
    per step; the terminal's sample every 2 steps."""
    consumed = {}
    init = GRPOTrainer.__init__

    def recording(self, *a, **kw):
        init(self, *a, **kw)
        self.on_consume.append(lambda rid, version, comp: consumed.setdefault(rid, comp))

    monkeypatch.setattr(GRPOTrainer, "__init__", recording)
    run_dir = tmp_path / "run"
    args = [
        f"run_dir={run_dir}",
        *TINY,
        "orchestrator.clock=logical",
        "train.total_steps=4",
        "checkpoint.every_steps=2",
        "checkpoint.async_save=false",
        "eval.every_steps=3",
        "logging.samples_per_step=3",
        "logging.samples_every=2",
    ]
    monkeypatch.setenv("DORA_FAULT", "train_step@4:raise")
    from dora_jax import faults

    faults.reset()
    assert main(args) == 1
    first = read(run_dir / SAMPLES_FILE)
    assert [r["step"] for r in first] == [1] * 3 + [2] * 3 + [3] * 3  # step 3: past the checkpoint
    assert [r["step"] for r in read(run_dir / EVAL_SAMPLES_FILE)] == [0] * 3 + [3] * 3
    monkeypatch.delenv("DORA_FAULT")
    capsys.readouterr()
    assert main(["--resume", f"run_dir={run_dir}"]) == 0
    out = capsys.readouterr().out

    rows = read(run_dir / SAMPLES_FILE)
    assert [r["step"] for r in rows] == [s for s in (1, 2, 3, 4) for _ in range(3)]
    assert rows[:9] == first  # exact resume: the same trajectories, the same texts
    for r in rows:
        assert list(r) == ["step", *FIELDS]
        comp = consumed[r["request_id"]]
        assert r["response"] == TOK.decode(response_ids(TOK, comp.tokens))
        assert r["prompt"] == TOK.decode(comp.prompt.tokens, skip_special=False)
        assert r["response_len"] == len(comp.tokens) and r["finish"] in ("eos", "length")
        assert r["staleness"] == r["step"] - 1 - r["version"]
    # the step's first trajectories: its first prompt group's first members
    step1 = [c for c in read(run_dir / "consumed.jsonl") if c["trainer_version"] == 0]
    group = sorted(c["request_id"] for c in step1 if c["prompt_group"] == step1[0]["prompt_group"])
    assert [r["request_id"] for r in rows[:3]] == group[:3]

    evals = read(run_dir / EVAL_SAMPLES_FILE)
    assert [(r["step"], r["problem"]) for r in evals] == [
        (s, i) for s in (0, 3, 4) for i in range(3)
    ]
    solved = {e["step"]: e["eval/solved"] for e in read(run_dir / "eval.jsonl")}
    for s in (0, 3, 4):
        mine = [r for r in evals if r["step"] == s]
        assert sum(r["correct"] for r in mine) / 3 == solved[s]
        assert all(r["correct"] == (r["reward"] >= 1.0) and r["answer"] for r in mine)
    held = json.loads((run_dir / "summary.json").read_text())["held_out_eval"]
    assert [e["step"] for e in held] == [0, 3, 4] and "samples" not in held[0]  # texts: the file

    assert "sample at step 4 (prompt group" in out and "sample at step 3" not in out
    texts = _tb_texts(run_dir)
    assert {s for s, tag in texts if tag == "samples/text_summary"} == {1, 2, 3, 4}


def test_a_wall_clock_multi_turn_run_keeps_conversations_turn_by_turn(tmp_path, capsys):
    """An environment run (tests/agentic_envs.py's Chatter) on the wall clock: the training
    samples and the held-out episodes' rows hold each conversation's turns, model and
    environment apart, and the environment's reward; the terminal's sample shows the turns."""
    envs = ROOT / "tests" / "agentic_envs.py"
    rc = main(
        [
            f"run_dir={tmp_path / 'run'}",
            *TINY,
            "orchestrator.clock=wall",
            "train.total_steps=2",
            "eval.num_prompts=2",
            "eval.every_steps=2",
            "logging.tensorboard=false",
            "logging.samples_every=1",
            f"env.spec={envs}:Chatter",
            "env.workers=1",
            "env.kwargs.turns=2",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    rows = read(tmp_path / "run" / SAMPLES_FILE)
    evals = read(tmp_path / "run" / EVAL_SAMPLES_FILE)
    assert [r["step"] for r in rows] == [1, 1, 2, 2]
    assert [(r["step"], r["problem"]) for r in evals] == [(s, i) for s in (0, 2) for i in range(2)]
    for r in rows + evals:
        roles = [t["role"] for t in r["turns"]]
        assert roles[0] == "model" and all(a != b for a, b in zip(roles, roles[1:], strict=False))
        assert r["prompt"].startswith("go:") and r["reward_error"] is None
        assert r["response"] == "\n".join(f"[{t['role']}] {t['text']}" for t in r["turns"])
        assert r["finish"] in ("terminated", "max_tokens", "max_turns")
    assert any("environment" in [t["role"] for t in r["turns"]] for r in rows)
    for r in rows:
        assert r["conversation"]["turns"] == [t["role"] for t in r["turns"]].count("model")
        assert r["staleness"] == r["step"] - 1 - r["version"] >= 0
    assert "sample at step 1" in out.out and "sample at step 2" in out.out
