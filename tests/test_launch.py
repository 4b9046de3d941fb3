"""The main command runs without a traceback and rejects bad config keys with a clear error."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "launch" / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_default_command_runs_cleanly(tmp_path):
    out = run(f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert "rollout group 3: tp=1 on devices [7]" in out.stdout
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_bad_key_is_a_clear_error(tmp_path):
    out = run("train.lrr=3", cwd=tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "config error: train.lrr: unknown key; did you mean 'lr'?" in out.stderr
    out = run("--mode", "sync", "mesh.trainer.devices=0:9", cwd=tmp_path)
    assert out.returncode == 2
    assert "mesh.trainer.devices: device slice '0:9' is out of range for 8" in out.stderr
