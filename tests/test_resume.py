"""``--resume``: the checkpoint's config, changed only where the command line says so, and only
where the change can be carried out (docs/reliability.md, "Resume"). The rules table is checked
against ``dora_jax.resume`` field by field; every field is changed on a saved config and applied
or refused as the table says; real checkpoints are resumed with changed settings."""

import dataclasses
import json
import re
import shutil
import typing
from pathlib import Path

import pytest
from reliability_cases import DOC, expect  # tests/reliability_cases.py

from dora_jax import faults
from dora_jax.config import ConfigError, ExperimentConfig, from_dict, to_dict
from dora_jax.config.loading import _coerce
from dora_jax.main import main
from dora_jax.resume import APPLY, REFUSE, changes, leaf_fields, rule

ROOT = Path(__file__).resolve().parents[1]
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


def doc_rules() -> dict[str, str]:
    """field -> apply/refuse, from the table of docs/reliability.md."""
    out: dict[str, str] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in (APPLY, REFUSE):
            for field in re.findall(r"`([a-z_.0-9]+)`", cells[0]):
                assert field not in out, f"{field} is in two rows"
                out[field] = cells[1]
    return out


def test_the_documented_table_is_the_code():
    documented = doc_rules()
    assert set(documented) == set(leaf_fields())  # every field, once
    for field, action in documented.items():
        assert rule(field)[0] == action, field


# A valid other value for fields where a generic change would not validate or would mean the same.
OTHER = {
    "model.head_dim": 32,
    "model.rope_scaling": {"factor": 8.0},
    "model.hf_path": "some/dir",
    "model.num_heads": 8,
    "model.num_kv_heads": 4,
    "mesh.trainer.devices": "0:2",
    "mesh.rollout.devices": "4:6",
    "mesh.rollout.tp": 2,
    "run_dir": "runs/elsewhere",
    "model.hidden_size": 128,
    "model.attention_bias": True,
    "data.task": "jsonl",
    "data.path": "y.jsonl",
    "data.prompt_field": "question",
    "data.answer_field": "solution",
    "data.reward": "partial_credit",
    "eval.path": "x.jsonl",
    "train.tis_cap": 2.0,
    "train.loss_norm_len": 64,
    "train.length_buckets": [64, 128, 256, 512, 1024],
    "orchestrator.rollout_batch_prompts": 9,
    "train.kl_beta": 0.2,  # with a saved 0.1: the penalty stays on
    "data.split": "test",
    "data.system_prompt": "Think step by step.",
    "data.prompt_template": "Solve: {prompt}",
    "logging.wandb_project": "elsewhere",
    "logging.wandb_name": "run-2",
    "logging.wandb_tags": ["a"],
    "mesh.device_memory_gib": 40.0,
    "model.attention": "dense",
    "model.attention_block": 256,
    "model.seq_chunk": 512,
    "model.sliding_window": 8,
    "model.full_attention_layers": 1,
    "rollout.extra_eos_ids": [3],
    "train.adam_moment_dtype": "bfloat16",
    "rollout.num_pages": 300,
    "model.norm_topk_prob": True,
    "model.mlp_only_layers": [1],
    "env.spec": "tool_arithmetic",
    "env.kwargs": {"median_steps": 4},
    "env.max_tokens": 256,
    "orchestrator.staleness_k": "auto",
    "train.lr_boost": [10, 5, 2.0],
}


def _other_value(path: str, value, tp):
    if path in OTHER:
        return OTHER[path]
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return next(a for a in typing.get_args(tp) if a != value)
    if tp is bool:
        return not value
    if tp is int:
        return value + 1
    if tp is float:
        return value * 0.5 if value else 0.5
    raise AssertionError(f"no other value for {path} ({tp})")


def _changed(saved: ExperimentConfig, path: str) -> ExperimentConfig:
    data = to_dict(saved)
    node, cls = data, ExperimentConfig
    *parents, leaf = path.split(".")
    for part in parents:
        node, cls = node[part], typing.get_type_hints(cls)[part]
    tp = typing.get_type_hints(cls)[leaf]
    node[leaf] = _other_value(path, node[leaf], tp)
    _coerce(node[leaf], tp, path)
    return from_dict(ExperimentConfig, data)


@pytest.mark.parametrize("path", leaf_fields())
def test_every_field_is_applied_or_refused_as_the_table_says(path):
    base = ExperimentConfig()
    saved = dataclasses.replace(  # kl_beta > 0, and a data path a jsonl task may use
        base,
        train=dataclasses.replace(base.train, kl_beta=0.1),
        data=dataclasses.replace(base.data, path="x.jsonl"),
    )
    new = _changed(saved, path)
    assert to_dict(new) != to_dict(saved)
    if doc_rules()[path] == REFUSE:
        with pytest.raises(ConfigError) as e:
            changes(saved, new)
        assert e.value.path == path and "cannot change on resume" in str(e.value)
    elif path == "run_dir":
        assert changes(saved, new) == []  # the directory itself: nothing to report
    else:
        (change,) = changes(saved, new)
        assert change.path == path and change.new != change.old


def test_turning_the_kl_penalty_on_or_off_is_refused():
    saved = ExperimentConfig()
    new = dataclasses.replace(saved, train=dataclasses.replace(saved.train, kl_beta=0.1))
    with pytest.raises(ConfigError, match="^train.kl_beta: .* changes the saved train state"):
        changes(saved, new)


def cli(capsys, *args: str) -> tuple[int, str]:
    faults.reset()
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out + out.err


def steps_of(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.mark.slow  # a 4-step run and seven resumes of it (four refused before training)
def test_resume_applies_or_refuses_changed_settings(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc, out = cli(
        capsys, f"run_dir={run_dir}", *T, "train.total_steps=4", "checkpoint.every_steps=2"
    )
    assert rc == 0, out[-3000:]
    config_yaml = (run_dir / "config.yaml").read_text()

    rc, out = cli(capsys, "--resume", f"run_dir={run_dir}", "train.group_size=4")
    expect("resume-refused", out, rc)
    rc, out = cli(capsys, "--resume", f"run_dir={run_dir}", "train.total_steps=1")
    expect("resume-total-steps-below", out, rc)
    rc, out = cli(capsys, "--resume", f"run_dir={run_dir}", "orchestrator.staleness_k=0")
    expect("resume-k-too-small", out, rc)
    assert (run_dir / "config.yaml").read_text() == config_yaml  # refused: nothing changed
    assert steps_of(run_dir / "metrics.jsonl") == [1, 2, 3, 4]

    old = tmp_path / "old"  # a checkpoint of format 1 has no meta item
    shutil.copytree(run_dir, old)
    for meta in (old / "checkpoints").glob("*/meta"):
        shutil.rmtree(meta)
    rc, out = cli(capsys, "--resume", f"run_dir={old}")
    expect("old-format", out, rc)

    corrupt = tmp_path / "corrupt"  # the newest checkpoint's host item truncated
    shutil.copytree(run_dir, corrupt)
    latest = max(int(p.name) for p in (corrupt / "checkpoints").iterdir())
    for f in (corrupt / "checkpoints" / str(latest) / "host").rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[:7])
    rc, out = cli(capsys, "--resume", f"run_dir={corrupt}")
    expect("corrupt-checkpoint", out, rc)
    (moved,) = (corrupt / "unusable_checkpoints").iterdir()
    assert moved.name.startswith(f"{latest}-")  # out of the way of the resumed run's saves
    # checkpoints are keyed by train step: the resumed run, back at step `latest`, saved a
    # fresh checkpoint there (its host item whole, not the truncated one)
    fresh = corrupt / "checkpoints" / str(latest) / "host"
    assert any(f.is_file() and f.stat().st_size > 7 for f in fresh.rglob("*"))
    assert steps_of(corrupt / "metrics.jsonl") == [1, 2, 3, 4]

    rc, out = cli(capsys, "--resume", f"run_dir={run_dir}")  # the saved config, nothing else
    expect("resume-alone", out, rc)
    assert "4 steps done" in out and "resume: " not in out

    rc, out = cli(
        capsys,
        f"run_dir={run_dir}",
        "--resume",
        "orchestrator.staleness_k=3",
        "train.lr=1e-3",
        "orchestrator.mode=partial",
        "train.total_steps=6",
    )
    expect("resume-applied", out, rc)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    assert [round(x["lr"], 6) for x in lines] == [3e-4] * 4 + [1e-3] * 2
    assert max(x["staleness_mean"] for x in lines[4:]) <= 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mode"] == "partial" and summary["steps"] == 6
    saved = (run_dir / "config.yaml").read_text()
    assert "mode: partial" in saved and "staleness_k: 3" in saved and "num_layers: 1" in saved
