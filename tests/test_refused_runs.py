"""A refused run leaves its run directory as it was, and two runs of one config in two processes
on the logical clock agree bit for bit.

The refused runs go through ``dora_jax.main.main`` in this process; the reproducibility check
starts two ``launch/train.py`` subprocesses (slow)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from reliability_cases import expect  # tests/reliability_cases.py
from test_reliability import T, cli  # the 1-layer policy and the in-process command

ROOT = Path(__file__).resolve().parents[1]


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` with its bytes (None for a directory)."""
    return {
        str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(directory.rglob("*"))
    }


def killed_run(run_dir: Path) -> None:
    """What a run killed before its first checkpoint leaves behind."""
    (run_dir / "tb").mkdir(parents=True)
    (run_dir / "tb" / "events.out").write_bytes(b"\x00tb")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (run_dir / "summary.json").write_text("{}\n")
    (run_dir / "records.jsonl").write_text("{}\n")
    (run_dir / "config.yaml").write_text("seed: 7\n")


@pytest.mark.parametrize("bad", ["data", "eval"])
def test_a_refused_run_changes_nothing_in_its_run_dir(tmp_path, capsys, bad):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1-1=", "answer": "0"}\n{"prompt": \n')
    run_dir = tmp_path / "run"
    killed_run(run_dir)
    before = snapshot(run_dir)
    if bad == "data":
        args = ["data.task=jsonl", f"data.path={data}"]
    else:
        good = tmp_path / "good.jsonl"
        good.write_text('{"prompt": "1-1=", "answer": "0"}\n' * 4)
        args = ["data.task=jsonl", f"data.path={good}", "eval.num_prompts=2", f"eval.path={data}"]
    rc, out = cli(capsys, f"run_dir={run_dir}", *T, *args)
    expect("refused-run-changes-nothing", out, rc)
    assert f"{data}:2" in out
    assert snapshot(run_dir) == before  # metrics, summary, tb/, config.yaml: all as they were
    # a run dir that does not exist is not created by a refused run
    rc, out = cli(capsys, f"run_dir={tmp_path / 'new' / 'run'}", *T, *args)
    assert rc == 2 and not (tmp_path / "new").exists()


def tiny_hf_checkpoint(path: Path) -> Path:
    """The default config's 1-layer policy saved as a Hugging Face checkpoint."""
    import jax

    from dora_jax.config import load_config
    from dora_jax.model import init_params
    from dora_jax.model.hf_checkpoint import save_hf_checkpoint

    cfg = load_config(ROOT / "configs" / "default.yaml", T).model
    return save_hf_checkpoint(init_params(cfg, jax.random.key(0)), cfg, path)


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "wider"])
def test_damaged_model_files_are_refused_before_the_run_dir_is_touched(tmp_path, capsys, damage):
    hf = tiny_hf_checkpoint(tmp_path / "hf")
    weights = hf / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":  # a download cut short
        weights.write_bytes(data[: len(data) - 100])
    elif damage == "zeroed":  # a file allocated but never written
        weights.write_bytes(bytes(len(data)))
    else:  # config.json describes another model than the tensors
        config = json.loads((hf / "config.json").read_text())
        config["intermediate_size"] += 8
        (hf / "config.json").write_text(json.dumps(config))
    run_dir = tmp_path / "run"
    killed_run(run_dir)
    before = snapshot(run_dir)
    rc, out = cli(capsys, f"run_dir={run_dir}", *T, f"model.hf_path={hf}")
    expect("damaged-model-files", out, rc)
    assert str(hf) in out and "Traceback" not in out
    if damage == "wider":
        assert "has shape [128, 64], expected [136, 64] from config.json" in out
    else:
        assert f"{weights}: not a readable safetensors file" in out
    assert snapshot(run_dir) == before  # the killed run's logs are still there, unchanged


@pytest.mark.slow  # a whole run: 18 s (the default suite stays under 15 minutes)
def test_an_accepted_run_clears_the_killed_runs_logs(tmp_path, capsys):
    run_dir = tmp_path / "run"
    killed_run(run_dir)
    rc, out = cli(capsys, f"run_dir={run_dir}", *T, "train.total_steps=1")
    assert rc == 0, out
    assert "note: removed metrics.jsonl, records.jsonl, summary.json, tb/" in out
    assert "seed: 0" in (run_dir / "config.yaml").read_text()
    assert [
        json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
    ] == [1]


def final_train_state(run_dir: Path) -> dict:
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    path = (run_dir / "checkpoints" / str(steps[-1]) / "train_state").absolute()
    return ocp.StandardCheckpointer().restore(path)


WALL_TIME = ("elapsed_s", "train_step_s", "real_tokens_per_s")  # metrics.jsonl's timings


@pytest.mark.slow  # two training subprocesses, about a minute each on 2 cores
def test_two_processes_of_one_config_agree_bit_for_bit(tmp_path):
    """The logical clock is reproducible across processes: metrics (wall-time fields aside) and
    final params identical bit for bit."""
    lines, states = [], []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        args = [
            sys.executable,
            str(ROOT / "launch" / "train.py"),
            f"run_dir={run_dir}",
            "warm_start.steps=50",
            "orchestrator.train_batch_prompts=4",
            "train.group_size=4",
            "eval.num_prompts=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            "train.total_steps=4",
        ]
        done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        lines.append([{k: v for k, v in r.items() if k not in WALL_TIME} for r in rows])
        states.append(final_train_state(run_dir))
    assert len(lines[0]) == 4 and lines[0] == lines[1]
    flat_a, flat_b = (dict(_leaves(s)) for s in states)
    assert sorted(flat_a) == sorted(flat_b) and flat_a
    for k, a in flat_a.items():
        assert np.array_equal(np.asarray(a), np.asarray(flat_b[k])), k


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}/{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}/{i}")
    else:
        yield prefix, tree
