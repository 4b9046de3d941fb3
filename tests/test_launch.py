"""`python launch/train.py` end to end on a tiny config: files written, no traceback, clear
errors for bad input."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "warm_start.steps=10",
    "warm_start.batch_size=8",
    "train.total_steps=3",
    "orchestrator.train_batch_prompts=2",
    "orchestrator.rollout_batch_prompts=4",
    "train.group_size=4",
    "rollout.max_new_tokens=48",
    "logging.progress=false",
    "eval.num_prompts=8",
    "eval.every_steps=2",
]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "launch" / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_train_command_writes_the_run_directory(tmp_path):
    out = run(f"run_dir={tmp_path / 'run'}", *TINY, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert "mean reward: first" in out.stdout
    run_dir = tmp_path / "run"
    for name in ("config.yaml", "metrics.jsonl", "timeline.png", "summary.json", "summary.md"):
        assert (run_dir / name).is_file(), name
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mode"] == "dora" and summary["steps"] == 3
    assert (run_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "warm_start" / "config.json").is_file()  # the cached warm start
    # held-out evaluation before the first step, every 2 steps and after the last
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert all(0.0 <= e["eval/solved"] <= e["eval/reward"] + 1e-9 <= 1.0 + 1e-9 for e in evals)
    assert [e["step"] for e in summary["held_out_eval"]] == [0, 2, 3]
    assert "held-out eval (8 problems" in out.stdout


def test_bad_input_is_a_clear_error(tmp_path):
    out = run("train.lrr=3", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "config error: train.lrr: unknown key; did you mean 'lr'?" in out.stderr
    out = run("--mode", "sync", "mesh.trainer.devices=0:9", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "mesh.trainer.devices: device slice '0:9' is out of range for 8" in out.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    out = run(
        "data.task=jsonl", f"data.path={bad}", f"run_dir={tmp_path / 'r'}", *TINY, cwd=tmp_path
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "bad.jsonl:2: missing field 'answer'" in out.stderr


def test_unsupported_architecture_is_one_error_line(tmp_path):
    """A Gemma 2 checkpoint directory (its config.json as transformers writes it): exit status 2
    and one ``error:`` line naming the architecture and the supported ones, no traceback."""
    import transformers

    ckpt = tmp_path / "gemma2"
    transformers.Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        architectures=["Gemma2ForCausalLM"],
    ).save_pretrained(ckpt)
    out = run(f"model.hf_path={ckpt}", f"run_dir={tmp_path / 'r'}", *TINY, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "architecture Gemma2ForCausalLM is not supported" in lines[0]
    for arch in ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert arch in lines[0]


def test_local_launcher_keeps_gloo_and_runtime_notes_out_of_the_terminal():
    from dora_jax.distributed.launcher import terminal_line

    note = (
        "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    )
    assert terminal_line(note + "\n") == ""
    assert terminal_line(note + note + "\n") == ""  # two notes run together
    assert terminal_line(note + "step 1: reward 0.5\n") == "step 1: reward 0.5\n"
    assert terminal_line("step 2: loss -0.1 [Gloo]\n") == "step 2: loss -0.1 [Gloo]\n"
    # the runtime's info and warning lines stay in the log files; its errors reach the terminal
    glog = "1207 10:34:46.908995   23619 coordination_service.cc:185] Using experimental\n"
    assert terminal_line("W" + glog) == terminal_line("I" + glog) == ""
    assert terminal_line("E" + glog) == "E" + glog and terminal_line("F" + glog) == "F" + glog
    assert terminal_line("Warm start W1207\n") == "Warm start W1207\n"
