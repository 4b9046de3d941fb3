"""Misuse, bad input and faults, as a hostile new user would try them (docs/reliability.md): each
case gets a message naming the file, line or field, or carries on correctly, and never leaves the
run directory unusable. The command runs in this process (``dora_jax.main.main``) unless a
signal or a process limit is part of the case."""

import errno
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from reliability_cases import CASES, expect  # tests/reliability_cases.py

from dora_jax import faults
from dora_jax.config import load_config
from dora_jax.main import main, parse_args
from dora_jax.run_dir import RunDirLock

ROOT = Path(__file__).resolve().parents[1]
# a 1-layer policy, TBS 2, RBS 4, G 2, no warm start, no evaluation, the logical clock
T = [
    "warm_start.steps=0",
    "orchestrator.train_batch_prompts=2",
    "orchestrator.rollout_batch_prompts=4",
    "train.group_size=2",
    "model.num_layers=1",
    "eval.num_prompts=0",
    "orchestrator.clock=logical",
    "logging.progress=false",
    "logging.tensorboard=false",
    "rollout.max_new_tokens=48",
]


def test_reliability_doc_names_a_test_for_every_case():
    """Every row of docs/reliability.md's table names a test that exists and checks that row."""
    assert len(CASES) >= 30
    for case in CASES.values():
        file, name = case.test.split("::")
        source = (ROOT / "tests" / file).read_text()
        assert f"def {name}(" in source, case
        start = source.index(f"def {name}(")
        end = source.find("\ndef ", start + 1)
        body = source[source.rfind("\n\n", 0, start) : end if end > 0 else None]  # decorators too
        assert f'"{case.case}"' in body, f"{case.test} does not check {case.case!r}"


def cli(capsys, *args: str) -> tuple[int, str]:
    faults.reset()
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out + out.err


def metric_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return path


# -- bad input: one line naming the file, line or field, exit 2, nothing written ----------------


def test_prompt_longer_than_the_context_is_refused_naming_the_line(tmp_path, capsys):
    data = jsonl(tmp_path / "long.jsonl", ["12-5="] * 8 + ["9" * 40 + "-5="] + ["7-2="])
    run_dir = tmp_path / "run"
    rc, out = cli(capsys, f"run_dir={run_dir}", *T, "data.task=jsonl", f"data.path={data}")
    expect("prompt-too-long", out, rc)
    assert f"{data}:9: the prompt has" in out and "Traceback" not in out
    assert not (run_dir / "checkpoints").exists()


def test_jsonl_that_is_not_utf8_names_the_line(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"prompt": "1-1=", "answer": "0"}\n{"prompt": "\xff-1=", "answer": "0"}\n')
    rc, out = cli(capsys, f"run_dir={tmp_path / 'run'}", *T, "data.task=jsonl", f"data.path={data}")
    expect("jsonl-not-utf8", out, rc)
    assert f"{data}:2: not UTF-8" in out


@pytest.mark.parametrize("prompt", ["Twelve-5=", "12-5=\U0001f600"])
def test_a_prompt_outside_the_alphabet_names_the_line(tmp_path, capsys, prompt):
    data = jsonl(tmp_path / "odd.jsonl", ["12-5=", "7-2=", prompt, "1-1="])
    rc, out = cli(capsys, f"run_dir={tmp_path / 'run'}", *T, "data.task=jsonl", f"data.path={data}")
    expect("prompt-outside-alphabet", out, rc)
    assert f"{data}:3: character {prompt[0] if prompt[0] == 'T' else prompt[-1]!r}" in out
    assert "Traceback" not in out and not (tmp_path / "run" / "checkpoints").exists()


def test_unsupported_hf_architecture(tmp_path, capsys):
    hf = tmp_path / "gpt2"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    run_dir = tmp_path / "run"
    rc, out = cli(capsys, f"run_dir={run_dir}", *T, f"model.hf_path={hf}")
    expect("unsupported-architecture", out, rc)
    assert f"{hf / 'config.json'}: architecture" in out
    assert not run_dir.exists()  # refused before anything was written


@pytest.mark.parametrize(
    "case, override",
    [
        ("bucket-too-small", "train.length_buckets=[32]"),
        ("too-few-kv-pages", "rollout.num_pages=3"),
        ("one-step-without-staleness", "orchestrator.staleness_k=0"),
    ],
)
def test_sizes_that_cannot_work_are_refused_before_the_run(tmp_path, capsys, case, override):
    extra = ["--mode", "one_step"] if case == "one-step-without-staleness" else []
    rc, out = cli(capsys, f"run_dir={tmp_path / 'run'}", *T, override, *extra)
    expect(case, out, rc)
    assert "Traceback" not in out


def test_the_memory_plan_is_one_line_and_a_file(tmp_path, capsys):
    """The default run prints one line of the memory plan (it used to print a line per item of
    every device, 36 lines, before anything else) and writes the full plan to the run dir once
    the run is accepted; logging.memory_plan=true prints it in full; a refused run prints the
    whole plan when the plan refuses it, and writes no memory_plan.txt."""
    run_dir = tmp_path / "run"
    bad = tmp_path / "bad.jsonl"  # refused after the plan, before the warm start
    bad.write_bytes(b'{"prompt": "\xff-1=", "answer": "0"}\n')
    refused = [f"run_dir={run_dir}", *T, "data.task=jsonl", f"data.path={bad}"]
    rc, out = cli(capsys, *refused)
    assert rc == 2 and "memory plan: " in out and " on 8 CPU devices against " in out
    assert "device 0:" not in out
    assert not (run_dir / "memory_plan.txt").exists()
    rc, out = cli(capsys, *refused, "logging.memory_plan=true")
    assert rc == 2 and "memory plan (GiB per device" in out and "  device 7: " in out
    rc, out = cli(capsys, f"run_dir={run_dir}", *T, "mesh.device_memory_gib=0.0001")
    assert rc == 2 and "the memory plan does not fit" in out and "  device 0: " in out
    assert not (run_dir / "memory_plan.txt").exists()

    rc, out = cli(capsys, f"run_dir={run_dir}", *T, "train.total_steps=1")
    expect("memory-plan-one-line", out, rc)
    plan = [line for line in out.splitlines() if "memory plan" in line]
    assert len(plan) == 1 and plan[0].endswith("(in full: memory_plan.txt in the run dir)")
    text = (run_dir / "memory_plan.txt").read_text()
    assert text.startswith("memory plan (GiB per device") and "  device 7: " in text


def test_unwritable_run_dir(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")
    rc, out = cli(capsys, f"run_dir={tmp_path / 'file' / 'run'}", *T)
    expect("run-dir-under-a-file", out, rc)

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)  # as a read-only file system answers
    rc, out = cli(capsys, f"run_dir={tmp_path / 'ro' / 'run'}", *T)
    expect("run-dir-read-only", out, rc)


def test_eval_path_missing_names_eval_path(tmp_path, capsys):
    data = jsonl(tmp_path / "train.jsonl", ["12-5="] * 4)
    missing = tmp_path / "nope.jsonl"
    rc, out = cli(
        capsys,
        f"run_dir={tmp_path / 'run'}",
        *T,
        "data.task=jsonl",
        f"data.path={data}",
        "eval.num_prompts=2",
        f"eval.path={missing}",
    )
    expect("eval-path-missing", out, rc)
    assert "(data.path)" not in out


def test_override_errors_blame_the_command_line(tmp_path, capsys):
    rc, out = cli(capsys, f"run_dir={tmp_path / 'run'}", "train.lr=abc")
    expect("override-error", out, rc)
    assert "default.yaml" not in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: abc\n")
    rc, out = cli(capsys, "--config", str(bad), f"run_dir={tmp_path / 'run'}")
    assert rc == 2 and f"train.lr: expected a float, got 'abc' (in {bad})" in out


def test_a_seed_out_of_range_is_a_config_error(tmp_path, capsys):
    """numpy refuses a negative seed (after a long start-up, with a traceback) and jax keeps
    only its low 32 bits: the config refuses both at once."""
    for seed in ("-1", str(2**32)):
        rc, out = cli(capsys, f"run_dir={tmp_path / 'run'}", *T, f"seed={seed}")
        expect("seed-out-of-range", out, rc)
        assert f"got {seed} (from the command line: seed={seed})" in out
        assert "Traceback" not in out and not (tmp_path / "run").exists()


def test_config_that_is_a_directory(tmp_path, capsys):
    rc, out = cli(capsys, "--config", str(tmp_path), f"run_dir={tmp_path / 'run'}")
    expect("config-is-a-directory", out, rc)
    assert "does not exist" not in out


@pytest.mark.parametrize("steps, says", [("-5", "must be at least 1, got -5"), ("x", "got 'x'")])
def test_bad_steps_are_named_as_given(capsys, steps, says):
    with pytest.raises(SystemExit) as stop:
        parse_args(["--steps", steps])
    err = capsys.readouterr().err
    expect("bad-steps-flag", err, stop.value.code)
    assert says in err and "train.total_steps" not in err


def test_config_from_dev_null_is_empty_and_a_pipe_is_refused(tmp_path):
    from dora_jax.config.loading import ConfigError, load_yaml

    assert load_yaml("/dev/null") == {}
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_yaml(fifo)  # refused before it is opened: no reader waits on a pipe forever


def test_hf_model_metadata_is_the_checkpoints(tmp_path, capsys):
    """The announced parameter count and the written config come from the HF config.json."""
    from dora_jax.config import ModelConfig
    from dora_jax.model import count_params

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "vocab_size": 64,
                "hidden_size": 32,
                "intermediate_size": 48,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "tie_word_embeddings": True,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
            }
        )
    )
    run_dir = tmp_path / "run"
    # rollout.num_pages=3 stops the run in the build, after the announcement
    rc, out = cli(capsys, f"run_dir={run_dir}", *T, f"model.hf_path={hf}", "rollout.num_pages=3")
    expect("hf-model-metadata", out, rc)
    n = count_params(
        ModelConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_layers=3,
            num_heads=4,
            num_kv_heads=2,
        )
    )
    assert f"({n:,} params)" in out
    assert not run_dir.exists()  # refused in the build: nothing written (config.yaml neither)
    # the config a run would write: the architecture of config.json
    from dora_jax.config import dump_yaml, load_config
    from dora_jax.pipeline.experiment import resolve_model

    cfg = resolve_model(load_config(ROOT / "configs" / "default.yaml", [f"model.hf_path={hf}"]))
    dump_yaml(cfg, tmp_path / "config.yaml")
    assert "hidden_size: 32" in (tmp_path / "config.yaml").read_text()
    assert "num_layers: 3" in (tmp_path / "config.yaml").read_text()


# -- the run directory: an owner, and refusals that change nothing ---------------------------


def test_a_second_run_on_a_locked_dir_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("the first run's\n")
    with RunDirLock(run_dir):
        rc, out = cli(capsys, f"run_dir={run_dir}", *T)
        expect("two-runs-one-dir", out, rc)
        assert f"pid {os.getpid()}" in out
    assert (run_dir / "config.yaml").read_text() == "the first run's\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]


def test_refused_runs_change_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "7").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("the first run's\n")
    rc, out = cli(capsys, f"run_dir={run_dir}", *T, "warm_start.steps=5")
    expect("fresh-run-into-checkpoints", out, rc)
    assert (run_dir / "config.yaml").read_text() == "the first run's\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.yaml"]

    missing = tmp_path / "missing"
    rc, out = cli(capsys, "--resume", f"run_dir={missing}")
    expect("resume-missing-dir", out, rc)
    assert not missing.exists()


def test_overrides_may_follow_resume():
    args = parse_args(["run_dir=x", "--resume", "train.lr=1e-3", "--mode", "sync", "seed=1"])
    assert args.resume and args.mode == "sync"
    assert args.overrides == ["run_dir=x", "train.lr=1e-3", "seed=1"]


def test_a_second_signal_names_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    """The second Ctrl-C stops at once (KeyboardInterrupt out of the run loop): the message
    names the newest finished checkpoint and the command that resumes, or says there is none."""
    from dora_jax import main as main_mod
    from dora_jax.config import load_config

    def second_signal(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(main_mod, "_train", second_signal)
    run_dir = tmp_path / "my run"
    for step in ("2", "5", "7.orbax-checkpoint-tmp-1"):  # the last one never finished
        (run_dir / "checkpoints" / step).mkdir(parents=True)

    def train(run_dir, resume=False) -> int:
        try:
            return main_mod.train(load_config(None, [f"run_dir={run_dir}", *T]), resume=resume)
        except KeyboardInterrupt:  # (main's own catch: a signal before the handlers)
            return -1

    rc = train(run_dir, resume=True)
    out = capsys.readouterr().err
    assert f"the last checkpoint is {run_dir / 'checkpoints' / '5'}; continue with: " in out
    assert f"--resume run_dir='{run_dir}'" in out  # quoted: the path has a space

    fresh = tmp_path / "fresh"
    rc_fresh = train(fresh)
    out_fresh = capsys.readouterr().err
    assert rc_fresh == 130 and "stopped at once; there is no checkpoint yet" in out_fresh
    expect("second-signal", out + out_fresh, rc)


def test_the_resume_hint_of_a_local_multi_process_run(tmp_path, monkeypatch):
    """The hint printed when a peer is lost gives the launcher's flags and a quoted run dir."""
    from dora_jax.distributed.launcher import ENV_LAUNCH
    from dora_jax.main import _resume_hint

    run_dir = tmp_path / "my run"
    (run_dir / "checkpoints" / "4").mkdir(parents=True)
    monkeypatch.setenv(ENV_LAUNCH, "--local-processes 2")
    hint = _resume_hint(run_dir, None)
    expect("resume-hint-local-processes", hint)
    assert hint.endswith(f"python launch/train.py --local-processes 2 --resume run_dir='{run_dir}'")
    monkeypatch.delenv(ENV_LAUNCH)
    hint = _resume_hint(run_dir, None)
    assert "the same processes and: python launch/train.py --resume run_dir='" in hint


# -- steps ---------------------------------------------------------------------------------------


def test_total_steps_is_the_number_of_updates(tmp_path):
    """A logical run whose batch for step N+1 is ready when step N is published still stops at
    N = train.total_steps updates (with RBS 8 it used to start a third step here)."""
    from dora_jax.config import load_config
    from dora_jax.pipeline.experiment import build, run

    cfg = load_config(
        ROOT / "configs" / "default.yaml",
        [*T, "orchestrator.rollout_batch_prompts=8", "train.total_steps=2"],
    )
    exp = build(cfg, tmp_path / "run")
    result = run(exp, 2)
    expect("total-steps", "")  # no message: the row promises the counts checked here
    assert exp.trainer.version == 2 and len(exp.grpo.log) == 2
    assert result.summary.steps == 2 and exp.runtime.steps_done == 2
    assert len(exp.runtime.records.consumed) == 2 * 2 * 2


@pytest.mark.slow  # one training run
def test_a_failed_rollout_engine_costs_its_work_not_the_run(tmp_path, capsys, monkeypatch):
    """The train command with an engine step that raises: the group is rebuilt, its requests go
    on elsewhere, the run finishes with every prompt group consumed once."""
    monkeypatch.setenv(faults.ENV, "engine_step@30:raise")
    run_dir = tmp_path / "run"
    rc, out = cli(
        capsys, f"run_dir={run_dir}", *T, "train.total_steps=3", "rollout.backup_every_steps=2"
    )
    expect("engine-failure", out, rc)
    summary = json.loads((run_dir / "summary.json").read_text())["summary"]
    assert summary["group_failures"] == 1
    assert sum(summary["recovered"].values()) > 0 and set(summary["recovered"]) <= {
        "kv",
        "tokens",
        "prompt",
    }
    rows = (run_dir / "consumed.jsonl").read_text().splitlines()
    ids = [json.loads(line)["request_id"] for line in rows]
    assert ids and len(ids) == len(set(ids))  # nothing consumed twice
    assert all(json.loads(line)["version_span"] == 1 for line in rows)


@pytest.mark.slow  # a run to its stop: 13 s (the default suite stays under 15 minutes)
def test_nonfinite_steps_are_skipped_logged_and_stop_the_run(tmp_path, capsys):
    """lr=1e30 after a short warm start: the update blows the params up, the next steps are
    skipped (logged, counted, the run goes on) until max_consecutive_skips in a row stop it with
    a checkpoint."""
    run_dir = tmp_path / "run"
    rc, out = cli(
        capsys,
        f"run_dir={run_dir}",
        *T,
        "warm_start.steps=20",
        "warm_start.batch_size=8",
        "data.reward=partial_credit",
        "train.lr=1e30",
        "train.total_steps=12",
        "train.max_consecutive_skips=3",
    )
    expect("nonfinite-step", out, rc)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = [x["step"] for x in lines if x["skipped"]]
    assert len(skipped) >= 3 and skipped[-3:] == [lines[-1]["step"] - 2 + i for i in range(3)]
    assert [x["step"] for x in lines] == list(range(1, len(lines) + 1))  # every step logged
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["extra"]["skipped_steps"] == skipped and summary["extra"]["stopped_early"]
    assert any(p.name.isdigit() for p in (run_dir / "checkpoints").iterdir())


class _SkippingTrainer:
    """A fake trainer whose every step is skipped (not finite), with the step logs RunHealth
    reads."""

    def __init__(self):
        from dora_jax.orchestrator.fake_trainer import FakeTrainer

        self.inner, self.log = FakeTrainer(step_ticks=20), []

    def step(self, batch) -> int:
        version = self.inner.step(batch)
        m = {"skipped": 1, "loss": float("nan"), "grad_norm": float("nan")}
        self.log.append(SimpleNamespace(version=version, metrics=m))
        return version

    def duration_ticks(self, batch) -> int:
        return self.inner.duration_ticks(batch)

    def step_logs(self, start: int) -> list:
        return self.log[start:]


@pytest.mark.parametrize("clock", ["logical", "wall"])
def test_max_consecutive_skips_is_the_number_of_skipped_steps(clock):
    """With train.max_consecutive_skips=3 the run stops after exactly 3 skipped steps, though
    the next batch is ready in the round that publishes the 3rd (that round used to start a 4th
    step, which a wall-clock run then published and logged: "4 in a row")."""
    from dora_jax.config import load_config
    from dora_jax.execution.trainer import ThreadedTrainer
    from dora_jax.orchestrator.clock import Bus, LogicalClock, WallClock
    from dora_jax.orchestrator.fake_backend import FakeBackend, FakeBackendConfig
    from dora_jax.orchestrator.rollout_manager import SyntheticPrompts
    from dora_jax.orchestrator.runtime import Runtime
    from dora_jax.pipeline.health import RunHealth

    cfg = load_config(
        None,
        [
            "train.max_consecutive_skips=3",
            "orchestrator.train_batch_prompts=2",
            "orchestrator.rollout_batch_prompts=8",
            "train.group_size=2",
        ],
    )
    trainer = _SkippingTrainer()
    clock, bus = (WallClock(), Bus()) if clock == "wall" else (LogicalClock(), None)
    runner = ThreadedTrainer(trainer, clock.now, bus.post) if bus is not None else trainer

    class Backend(FakeBackend):  # the wall clock holds the groups between runs
        def pause(self):
            pass

        def resume(self):
            pass

    backend = Backend(FakeBackendConfig(length_median=8, length_p99_ratio=1.0))
    rt = Runtime(cfg.orchestrator, 2, backend, runner, SyntheticPrompts(0, 8, 16), clock=clock)
    exp = SimpleNamespace(cfg=cfg, runtime=rt, grpo=trainer)
    messages: list[str] = []
    health = RunHealth(exp, echo=messages.append)
    rt.observers = [health]
    try:
        rt.run(10, max_ticks=100_000, should_stop=lambda: health.tripped is not None)
    finally:
        if bus is not None:
            runner.close()
    expect("skips-in-a-row-exactly", health.tripped)
    assert rt.stopped and rt.steps_done == 3 and trainer.inner.version == 3  # no 4th step
    assert health.skipped_steps == [1, 2, 3] and "(3 in a row, 3 in all)" in messages[-1]


@pytest.mark.slow  # a run to its stop: about 40 s on 2 cores
def test_a_reward_that_always_fails_stops_the_run_with_a_checkpoint(tmp_path, capsys):
    reward = tmp_path / "broken_reward.py"
    reward.write_text("def score(response, answer):\n    return 1 / 0\n")
    run_dir = tmp_path / "run"
    rc, out = cli(
        capsys, f"run_dir={run_dir}", *T, f"data.reward={reward}:score", "train.total_steps=8"
    )
    expect("failing-reward-stops", out, rc)
    assert f"the reward function {reward}:score (exception: ZeroDivisionError" in out
    assert out.count("reward function failed") == 1 and "WARNING:" not in out
    assert "check train.lr" not in out  # the learning rate is not blamed
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]  # stopped at the budget, not at step 8
    assert (run_dir / "checkpoints" / "3").is_dir()


def health_over(metrics: list[dict], *overrides: str, history: list[dict] = ()):
    """RunHealth over a fake run whose train steps log ``metrics`` (one dict a step, published
    in turn); returns it and what it printed."""
    from dora_jax.config import load_config
    from dora_jax.pipeline.health import RunHealth

    cfg = load_config(
        None, ["orchestrator.train_batch_prompts=2", "train.group_size=2", *overrides]
    )
    logs = []
    reward = SimpleNamespace(errors=5, last_error="exception: ValueError: no verifier")
    exp = SimpleNamespace(
        cfg=cfg,
        runtime=SimpleNamespace(steps_done=len(history)),
        grpo=SimpleNamespace(step_logs=lambda start: logs[start - len(history) :]),
        reward=reward,
        env=None,
    )
    printed: list[str] = []
    health = RunHealth(exp, echo=printed.append, history=list(history))
    runtime = SimpleNamespace(stopping=False, stopped=False)
    for step, m in enumerate(metrics, len(history) + 1):
        logs.append(SimpleNamespace(version=step, metrics=m))
        health.on_publish(runtime, step)
        if health.tripped:
            assert runtime.stopped
            break
    return health, printed


def step_metrics(failed: int, entropy: float = 1.0, step: int = 0) -> dict:
    return {
        "step": step,
        "skipped": 0,
        "loss": 0.0,
        "grad_norm": 0.5,
        "entropy": entropy,
        "advantage_abs_mean": 0.5,
        "failed_samples": failed,
    }


def test_the_failure_budget_counts_steps_in_a_row_over_its_share():
    # 4 samples a step: every one failed, then 3 (not all: the streak restarts), then 4 x 3
    health, _ = health_over([step_metrics(n) for n in (4, 4, 3, 4, 4, 4, 4)])
    assert health.tripped.startswith("3 train steps in a row (steps 4-6) had every sample fail")
    assert "the reward function exact (exception: ValueError: no verifier)" in health.tripped
    # a share: 2 of 4 is enough at max_failed_share 0.5
    health, _ = health_over([step_metrics(2)] * 3, "data.max_failed_share=0.5")
    assert "(steps 1-3) had 2 of 4 samples fail" in health.tripped
    health, _ = health_over([step_metrics(4)] * 9, "data.max_failed_steps=0")
    assert health.tripped is None  # 0: never
    # a resumed run replays its history quietly and stops only at a failing step of its own
    history = [step_metrics(4, step=s) for s in (1, 2, 3)]
    health, _ = health_over([], history=history)
    assert health.tripped is None
    health, _ = health_over([step_metrics(4)], history=history)
    assert "4 train steps in a row (steps 1-4)" in health.tripped
    health, _ = health_over([step_metrics(0), step_metrics(4)], history=history)
    assert health.tripped is None


def test_the_dead_policy_warning_names_failed_calls_before_the_learning_rate():
    uniform = math.log(load_config(None, []).model.vocab_size)
    _, printed = health_over([step_metrics(1, uniform)] * 3)
    (text,) = printed
    assert "1 of the step's 4 samples failed their reward or environment call" in text
    assert "train.lr" not in text
    _, printed = health_over([step_metrics(0, uniform)] * 3)
    assert "check train.lr" in printed[0]


@pytest.mark.slow  # one training run, about 25 s on 2 cores
def test_a_dead_policy_is_reported(tmp_path, capsys):
    rc, out = cli(
        capsys,
        f"run_dir={tmp_path / 'run'}",
        *T,
        "warm_start.steps=20",
        "warm_start.batch_size=8",
        "data.reward=partial_credit",
        "train.lr=1e6",
        "train.total_steps=7",
    )
    expect("dead-policy", out, rc)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(summary["extra"]["policy_warnings"]) == 1


# -- runs that need training steps ------------------------------------------------------------


@pytest.mark.slow  # one training run
def test_long_prompts_can_be_skipped(tmp_path, capsys):
    data = jsonl(tmp_path / "long.jsonl", ["12-5="] * 8 + ["9" * 40 + "-5="] + ["7-2="])
    run_dir = tmp_path / "run"
    rc, out = cli(
        capsys,
        f"run_dir={run_dir}",
        *T,
        "data.task=jsonl",
        f"data.path={data}",
        "data.long_prompts=skip",
        "train.total_steps=1",
    )
    expect("prompt-too-long-skip", out, rc)
    assert f"{data} lines 9)" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["extra"]["long_prompts_skipped"] == 1
    assert summary["extra"]["long_prompt_lines"] == [9]


@pytest.mark.slow  # three processes start and meet (about 11 s on 2 cores)
def test_a_config_error_under_local_processes_exits_2(tmp_path):
    """3 processes x 2 fake devices cannot hold the default 8-device mesh: process 0's config
    error is the launcher's exit status (the others' "process 0 is gone", 3, came first)."""
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--local-processes", "3"]
    cmd += [f"run_dir={tmp_path / 'run'}", *T]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    expect("local-processes-config-error", out.stdout + out.stderr, out.returncode)


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(proc.stdout)


@pytest.mark.slow  # one training run
def test_stale_lock_and_old_logs_of_a_killed_run(tmp_path, capsys):
    """A run killed before its first checkpoint left its lock and a metrics.jsonl behind: the
    next fresh run takes the lock over and starts the logs afresh (it used to append)."""
    import socket

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").write_text(
        json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "started": "earlier"})
    )
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9}\n{"step": 2, "lo')
    rc, out = cli(capsys, f"run_dir={run_dir}", *T, "train.total_steps=1")
    expect("stale-lock", out, rc)
    expect("fresh-after-killed", out, rc)
    assert metric_steps(run_dir / "metrics.jsonl") == [1]
    assert json.loads((run_dir / "metrics.jsonl").read_text())["loss"] != 9
    assert not (run_dir / ".lock").exists()  # released at the end


def test_a_hosts_command_started_after_its_run_ended_says_so_at_once(tmp_path, capsys, monkeypatch):
    """``process_1.cmd`` of a local launch whose process 0 has ended: one line at once naming
    the resume command, instead of waiting minutes for a coordinator that is gone. While
    process 0 runs (its pid alive), the command joins as before."""
    from dora_jax.distributed import launcher, process

    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "process_0.pid").write_text(str(_dead_pid()))
    monkeypatch.setenv(launcher.ENV_LAUNCH, "--local-processes 2")
    monkeypatch.setenv(process.ENV_COORDINATOR, "127.0.0.1:9")
    monkeypatch.setenv(process.ENV_NUM, "2")
    monkeypatch.setenv(process.ENV_ID, "1")
    joined = []

    def initialize(spec):
        joined.append(spec.process_id)
        raise process.ProcessError("(joined)")

    monkeypatch.setattr(process, "initialize", initialize)
    rc, out = cli(capsys, f"run_dir={run_dir}", *T)
    expect("host-after-the-end", out, rc)
    assert joined == [] and "--local-processes 2 --resume run_dir=" in out
    (run_dir / "logs" / "process_0.pid").write_text(str(os.getpid()))  # a live process 0
    rc, out = cli(capsys, f"run_dir={run_dir}", *T)
    assert joined == [1] and rc == 2 and "(joined)" in out


def _resume_to_the_end(capsys, run_dir: Path, done: int, total: int) -> None:
    """``--resume`` continues from ``done`` steps to ``total``: each step logged once, every
    prompt group (2 a step, 2 samples each) consumed once."""
    rc, out = cli(capsys, "--resume", f"run_dir={run_dir}")
    assert rc == 0, out[-3000:]
    assert "resumed from" in out and f"{done} steps done" in out
    assert metric_steps(run_dir / "metrics.jsonl") == list(range(1, total + 1))
    ids = json.loads((run_dir / "summary.json").read_text())["extra"]["consumed_request_ids"]
    assert len(ids) == len(set(ids)) == total * 2 * 2


@pytest.mark.slow  # three commands, two of them train
def test_a_crash_leaves_a_usable_run_dir(tmp_path, capsys, monkeypatch):
    """An exception in step 3 while a save may be in progress: the save is finished, the run dir
    stays usable (a fresh run is refused, --resume continues), each step is logged once."""
    run_dir = tmp_path / "run"
    args = [f"run_dir={run_dir}", *T, "train.total_steps=4", "checkpoint.every_steps=1"]
    monkeypatch.setenv(faults.ENV, "train_step@3:raise")
    rc, out = cli(capsys, *args)
    expect("crash-mid-run", out, rc)
    assert not [p for p in (run_dir / "checkpoints").iterdir() if ".orbax-checkpoint-tmp" in p.name]
    monkeypatch.delenv(faults.ENV)
    rc, out = cli(capsys, *args)
    expect("fresh-run-into-checkpoints", out, rc)
    _resume_to_the_end(capsys, run_dir, done=2, total=4)


@pytest.mark.slow  # two training runs
@pytest.mark.parametrize("clock", ["logical", "wall"])
def test_an_error_after_a_published_step_saves_that_step_first(
    tmp_path, capsys, monkeypatch, clock
):
    """The held-out evaluation of step 2 raises (checkpoints every 3 steps): the state is step
    2's end, so the run saves it before the error ends the run; --resume goes on from step 2,
    each step logged once, nothing consumed twice. An error inside a train step saves nothing
    (test_a_crash_leaves_a_usable_run_dir: only the earlier checkpoints are there)."""
    run_dir = tmp_path / "run"
    args = [
        f"run_dir={run_dir}",
        *T,
        "eval.num_prompts=2",
        "eval.every_steps=2",
        "train.total_steps=4",
        "checkpoint.every_steps=3",
        f"orchestrator.clock={clock}",
    ]
    monkeypatch.setenv(faults.ENV, "eval@2:raise")  # visit 1 is step 0's evaluation
    rc, out = cli(capsys, *args)
    expect("crash-after-a-step", out, rc)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2"]
    assert metric_steps(run_dir / "metrics.jsonl") == [1, 2]
    monkeypatch.delenv(faults.ENV)
    _resume_to_the_end(capsys, run_dir, done=2, total=4)


@pytest.mark.slow  # one training run
def test_a_save_that_does_not_fit_is_refused(tmp_path, capsys, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=50_000))
    run_dir = tmp_path / "run"
    rc, out = cli(
        capsys, f"run_dir={run_dir}", *T, "train.total_steps=3", "checkpoint.every_steps=1"
    )
    expect("disk-nearly-full", out, rc)
    assert metric_steps(run_dir / "metrics.jsonl") == [1]  # stopped at the first save
    assert not any((run_dir / "checkpoints").iterdir())


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG


@pytest.mark.slow  # a training subprocess
def test_a_failed_save_stops_the_run_with_one_line(tmp_path):
    """The checkpoint files cannot be written (a file size limit: every write past 100 kB fails
    as on a full disk): the run stops at the next step with one line, no orbax traceback."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "train.py"),
            f"run_dir={run_dir}",
            *T,
            "train.total_steps=6",
            "checkpoint.every_steps=1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_limit_file_size,
    )
    expect("disk-full", out.stdout + out.stderr, out.returncode)
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip().splitlines()[-1]]  # one line
    assert len(metric_steps(run_dir / "metrics.jsonl")) < 6
    assert not list((run_dir / "checkpoints").iterdir())  # the unfinished save was discarded


@pytest.mark.slow  # two subprocesses that build and start a warm start
@pytest.mark.parametrize(
    "sig, case", [(signal.SIGTERM, "sigterm-warm-start"), (signal.SIGINT, "sigint-warm-start")]
)
def test_a_signal_in_the_warm_start_saves_nothing(tmp_path, sig, case):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "launch" / "train.py"),
            f"run_dir={run_dir}",
            *T,
            "warm_start.steps=100000",
            "warm_start.batch_size=8",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    first = proc.stdout.readline()
    assert first.startswith("dora_jax:"), first + proc.stderr.read()[-2000:]
    time.sleep(4)  # into the warm start (or still building the engines before it)
    assert proc.poll() is None
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    expect(case, first + out + err, proc.returncode)
    assert "Traceback" not in err
    assert not (run_dir / "warm_start").exists() and not (run_dir / "checkpoints").exists()
    assert not (run_dir / ".lock").exists()
