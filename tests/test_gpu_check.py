"""The GPU check (launch/gpu_check.py) on the CPU: the shared-memory budget of every kernel it
launches, and its CPU smoke mode (Pallas interpret mode, tiny shapes) on a few cases.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
H200_LIMIT = 232_448  # 227 KiB per thread block


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "launch" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


gpu_check = _load_script()
import gpu_check_grpo  # noqa: E402  (launch/ is on sys.path once gpu_check is loaded)

# ---------------------------------------------------------------------------------------------
# Shared-memory budget of every kernel variant the script launches
# ---------------------------------------------------------------------------------------------


def test_every_kernel_variant_of_the_check_fits_after_the_fit():
    variants = gpu_check.kernel_variants(gpu_check.gpu_plan())
    kernels = {v["kernel"] for v in variants}
    assert kernels == {"attention", "append", "page_copy"}
    over_before = []
    for v in variants:
        requested, requested_bytes, used, used_bytes = gpu_check.fitted(v, H200_LIMIT)
        assert used_bytes <= H200_LIMIT, v["name"]
        if requested_bytes > H200_LIMIT:
            over_before.append(v["name"])
        else:
            assert used == requested, v["name"]  # a tuning that fits is left alone
    # Without the fit, the requested tunings overflow at the two float32 shapes: our kernel's
    # default tuning at both, and JAX's kernel (the same tiles) with 2 splits at the second,
    # where each split still holds a whole 8-page compute block.
    prefix = "kernels/check/paged_decode_attention/"
    assert sorted(over_before) == [
        prefix + "jax_gpu/float32/B4 N32 K4 H128 Z16 S256/ppcb8/bh16/ks2/st2",
        prefix + "pallas/float32/B3 N14 K2 H64 Z32 S256/ppcb8/bh16/ks1/st2",
        prefix + "pallas/float32/B4 N32 K4 H128 Z16 S256/ppcb8/bh16/ks1/st2",
    ]


# ---------------------------------------------------------------------------------------------
# The script
# ---------------------------------------------------------------------------------------------


def test_a_failing_case_loses_no_other_figure(tmp_path):
    """CPU smoke run of a few cases with two forced to raise: exit 1 (documented: some case
    failed), the failures recorded with their error text, every other figure written."""
    out = tmp_path / "gc"
    argv = ["--cpu-smoke", "--out", str(out), "--sections", "kernels,engine"]
    argv += ["--only", "kernels/check/paged_decode_attention/pallas/float32"]
    argv += ["--only", "kernels/time/copy/B2", "--only", "kernels/time/paged_decode_attention/ref"]
    argv += ["--only", "engine/decode/pallas"]
    argv += ["--fail-case", "ppcb4/bh16/ks4", "--fail-case", "engine/decode/pallas"]
    assert gpu_check.main(argv) == gpu_check.EXIT_FAILED
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["finished"] and result["interpret"] and result["jax_version"]
    rows = {r["case"]: r for s in result["sections"].values() for r in s["cases"]}
    assert len(rows) == 5
    failed = [name for name, r in rows.items() if r["status"] != "ok"]
    assert sorted(failed) == [
        "engine/decode/pallas",
        "kernels/check/paged_decode_attention/pallas/float32/B2 N4 K2 H16 Z8 S32/"
        "ppcb4/bh16/ks4/st2",
    ]
    for name in failed:
        assert rows[name]["status"] == "error"
        assert "RuntimeError: forced failure of" in rows[name]["error"]
        assert "Traceback" in rows[name]["traceback"]
    ok = [r for r in rows.values() if r["status"] == "ok"]
    check = next(r for r in ok if r["table"] == "correctness")
    assert check["max_abs_err"] <= check["tol"] and check["smem_bytes"] > 0
    timing = [r for r in ok if r["table"] == "timing"]
    assert len(timing) == 2 and all(r["time_us"] > 0 and r["bandwidth_gbs"] > 0 for r in timing)
    assert result["summary"] == dict(
        cases=5, ok=3, failed=0, error=2, skipped=0, section_errors=[], all_ok=False
    )
    md = (out / "gpu_check.md").read_text()
    assert "forced failure" in md and "| paged_decode_attention |" in md
    assert "[error] engine/decode/pallas" in (out / "gpu_check.log").read_text()


def test_time_budget_skips_the_remaining_cases(tmp_path):
    argv = ["--cpu-smoke", "--out", str(tmp_path), "--sections", "kernels"]
    argv += ["--only", "kernels/time/copy", "--max-seconds", "0"]
    assert gpu_check.main(argv) == gpu_check.EXIT_FAILED
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["kernels"]["cases"]
    assert rows and all(r["status"] == "skipped" for r in rows)
    assert all(
        r["reason"] == "time budget (--max-seconds) spent" and "error" not in r for r in rows
    )
    md = (tmp_path / "gpu_check.md").read_text()
    assert "### skipped" in md and "### errors" not in md


def test_warnings_are_shown_once_and_counted():
    lines = []
    log = gpu_check.WarningLog(lines.append)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = log
        for i in range(5):  # one place, a varying detail (e.g. a kernel name)
            warnings.warn(f"the Triton backend is deprecated ({i})", DeprecationWarning, 1)
        warnings.warn("something else", UserWarning, 1)
    assert (
        len(lines) == 2 and "DeprecationWarning: the Triton backend is deprecated (0)" in lines[0]
    )
    assert [(r["category"], r["count"]) for r in log.rows()] == [
        ("DeprecationWarning", 5),
        ("UserWarning", 1),
    ]


def _run(code_or_args: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *code_or_args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_no_gpu_is_one_clear_line_and_nothing_runs(tmp_path):
    out = tmp_path / "gc"
    proc = _run(["launch/gpu_check.py", "--out", str(out)])
    assert proc.returncode == gpu_check.EXIT_NO_GPU
    assert proc.stdout.startswith("gpu_check: python ") and "jax " in proc.stdout
    err = [line for line in proc.stderr.splitlines() if line.startswith("gpu_check:")]
    assert len(err) == 1 and "not a GPU" in err[0] and "--cpu-smoke" in err[0]
    assert not out.exists()


def test_the_script_and_its_sections_import_no_plotting_or_tensorboard():
    """Import trace: the script, the kernels and everything the engine and grpo sections import
    (the grpo run reads its tokenizer with the tokenizers package, its GGUF with gguf)."""
    code = (
        "import sys\n"
        "sys.path.insert(0, 'launch')\n"
        "import gpu_check\n"
        "import dora_jax.kernels, dora_jax.config, dora_jax.mesh\n"
        "import dora_jax.model, dora_jax.rollout\n"
        "import dora_jax.pipeline.experiment, dora_jax.pipeline.observers, dora_jax.metrics\n"
        "import dora_jax.pipeline.evaluation, dora_jax.model.gguf_import\n"
        "bad = {'matplotlib', 'tensorboardX', 'torch', 'transformers'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in bad))\n"
    )
    proc = _run(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# The train section
# ---------------------------------------------------------------------------------------------


def test_train_flops_per_token_at_the_0_5b_shape():
    """The matmul parameters of Qwen2.5-0.5B: its published 494,032,768 parameters less the q/k/v
    biases (24 x (896 + 128 + 128)) and the RMSNorm scales (24 x 2 x 896 + 896); the tied
    embedding counts once, as the output projection. Attention adds 6 x 2 x L x N x H x T / 2."""
    from dora_jax.config import ModelConfig

    cfg = ModelConfig(**gpu_check.gpu_plan().train_model)
    matmul = 494_032_768 - 24 * (896 + 128 + 128) - (24 * 2 * 896 + 896)
    assert gpu_check.train_flops_per_token(cfg, 0) == 6 * matmul
    assert gpu_check.train_flops_per_token(cfg, 4096) - 6 * matmul == 6 * 24 * 14 * 64 * 4096
    assert gpu_check.peak_flops("NVIDIA H200") == 989e12 and gpu_check.peak_flops("cpu") is None


@pytest.mark.slow
def test_train_section_smoke(tmp_path):
    """The train section on the CPU at tiny shapes: two step lengths, finite losses, tokens/s;
    the long-tailed mix padded and packed (blockwise attention: cuDNN is a GPU case)."""
    out = tmp_path / "gc"
    rc = gpu_check.main(["--cpu-smoke", "--out", str(out), "--sections", "train"])
    result = json.loads((out / "gpu_check.json").read_text())
    cases = result["sections"]["train"]["cases"]
    rows = [r for r in cases if r["case"].startswith("train/step/")]
    assert rc == 0 and [r["seq_len"] for r in rows] == [32, 64]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and r["mfu"] is None for r in rows)
    mix = {r["case"]: r for r in cases if r["case"].startswith("train/mix/")}
    assert set(mix) == {"train/mix/rows/blockwise", "train/mix/tokens/blockwise"}
    padded, packed = mix["train/mix/rows/blockwise"], mix["train/mix/tokens/blockwise"]
    assert all(r["status"] == "ok" and r["real_tokens_per_s"] > 0 for r in mix.values())
    assert packed["real_token_share"] > padded["real_token_share"]


# ---------------------------------------------------------------------------------------------
# The grpo section: the real SmolLM2-135M-Instruct, end to end
# ---------------------------------------------------------------------------------------------


def test_the_grpo_case_is_planned_for_one_gpu(tmp_path):
    """Both plans run the case; on the GPU its settings make a valid one-device config of the
    recipe: trainer and two rollout groups on device 0, bf16 with float32 master weights, the
    Pallas decode kernels, the wall clock, the recipe's task, reward and 200 held-out problems."""
    from dora_jax.config import load_config

    assert gpu_check.SECTIONS["grpo"] is gpu_check_grpo.grpo_section
    gpu, smoke = gpu_check.gpu_plan(), gpu_check.smoke_plan()
    assert 3 <= gpu.grpo["steps"] <= 5 and smoke.grpo["steps"] == 1
    assert gpu.grpo_model_dir == smoke.grpo_model_dir == "models/smollm2-135m-instruct"
    cfg = load_config(
        gpu_check_grpo.RECIPE, gpu_check_grpo.overrides(gpu, tmp_path / "m", tmp_path / "run")
    )
    assert cfg.mesh.trainer.devices == cfg.mesh.rollout.devices == "0:1"
    assert cfg.mesh.rollout.groups == 2 and cfg.orchestrator.clock == "wall"
    assert cfg.model.param_dtype == cfg.model.compute_dtype == "bfloat16"
    assert cfg.train.fp32_master_weights and cfg.rollout.attention_impl == "pallas"
    assert cfg.orchestrator.mode == "dora" and cfg.data.reward == "final_number"
    assert cfg.train.total_steps == gpu.grpo["steps"] and cfg.eval.num_prompts == 200
    assert cfg.eval.every_steps > cfg.train.total_steps  # before the first step and after the last
    assert cfg.orchestrator.train_batch_prompts * cfg.train.group_size == 128
    # every request of the rollout batch has a slot, and every slot its pages
    slots = cfg.mesh.rollout.groups * cfg.rollout.max_slots
    assert slots >= cfg.orchestrator.rollout_batch_prompts * cfg.train.group_size
    per_seq = -(-(cfg.rollout.max_prompt_len + cfg.rollout.max_new_tokens) // 16)
    assert cfg.rollout.num_pages > cfg.rollout.max_slots * per_seq
    small = load_config(
        gpu_check_grpo.RECIPE, gpu_check_grpo.overrides(smoke, tmp_path / "m", tmp_path / "run")
    )
    assert small.model.param_dtype == "float32" and not small.train.fp32_master_weights
    assert small.rollout.attention_impl == "reference" and small.eval.num_prompts == 2


def test_the_grpo_case_knows_the_gguf_it_converts():
    from dora_jax.model.gguf_models import KNOWN_MODELS

    known = KNOWN_MODELS[gpu_check_grpo.MODEL]
    assert gpu_check_grpo.GGUF_SHA256 == known.gguf_sha256
    assert gpu_check.gpu_plan().grpo_gguf.endswith(known.member.rsplit("/", 1)[1])


def _grpo_row(tmp_path, model_dir, gguf) -> tuple[int, dict, dict]:
    out = tmp_path / "gc"
    argv = ["--cpu-smoke", "--out", str(out), "--sections", "grpo"]
    argv += ["--grpo-model-dir", str(model_dir), "--grpo-gguf", str(gguf)]
    rc = gpu_check.main(argv)
    result = json.loads((out / "gpu_check.json").read_text())
    (row,) = result["sections"]["grpo"]["cases"]
    return rc, row, result


def test_the_grpo_case_without_the_model_is_skipped_saying_why(tmp_path):
    """No prepared directory and no GGUF: the case is recorded as skipped (exit 1, like any
    case that did not run) with a reason naming both paths and the page that says what to do."""
    rc, row, result = _grpo_row(tmp_path, tmp_path / "absent", tmp_path / "absent.gguf")
    assert rc == gpu_check.EXIT_FAILED
    assert row["case"] == "grpo/smollm2-135m-instruct/float32/reference"
    assert row["status"] == "skipped" and "error" not in row
    assert str(tmp_path / "absent") in row["reason"] and "absent.gguf" in row["reason"]
    assert "docs/gpu_checks.md" in row["reason"]
    assert result["summary"]["skipped"] == 1 and result["finished"]
    assert result["plan"]["grpo_model_dir"] == str(tmp_path / "absent")
    md = (tmp_path / "gc" / "gpu_check.md").read_text()
    assert "### skipped" in md and "docs/gpu_checks.md" in md
    assert "[skipped] grpo/" in (tmp_path / "gc" / "gpu_check.log").read_text()


def test_the_grpo_case_skips_a_directory_without_weights_and_a_wrong_gguf(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")  # no model.safetensors
    gguf = tmp_path / "half.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))  # e.g. one half of the relay only
    rc, row, _ = _grpo_row(tmp_path, model, gguf)
    assert rc == gpu_check.EXIT_FAILED and row["status"] == "skipped"
    assert "is not the smollm2-135m-instruct GGUF" in row["reason"]
    assert "1004 bytes" in row["reason"] and gpu_check_grpo.GGUF_SHA256 in row["reason"]


def test_rollout_tokens_per_s_counts_colocated_groups_once():
    """Two groups decoding at the same time share the device: their seconds are the union; the
    warm figure leaves out each group's first prefill and first decode call."""
    from types import SimpleNamespace

    from dora_jax.orchestrator.backend import GroupTick

    def span(group, activity, tokens, t0, t1):
        return GroupTick(group, 0, activity, 1, tokens, 0, 0, t1 - t0, t0, t1)

    spans = [
        span(0, "prefill", 0, 0.0, 10.0),  # compiles
        span(1, "prefill", 0, 0.0, 10.0),
        span(0, "decode", 8, 10.0, 20.0),  # compiles
        span(1, "decode", 8, 10.0, 20.0),
        span(0, "decode", 8, 20.0, 21.0),
        span(1, "decode", 8, 20.5, 21.5),
        span(0, "transfer", 0, 21.5, 30.0),  # not rollout
        span(0, "prefill", 0, 30.0, 30.5),
    ]
    f = gpu_check_grpo.rollout_figures(SimpleNamespace(spans=spans))
    assert f["rollout_tokens"] == 32 and f["rollout_busy_s"] == 22.0
    assert f["rollout_tokens_per_s"] == 32 / 22.0
    assert f["rollout_busy_s_warm"] == 2.0 and f["rollout_tokens_per_s_warm"] == 16 / 2.0


@pytest.mark.slow
@pytest.mark.skipif(
    not (ROOT / "models" / "smollm2-135m-instruct" / "model.safetensors").is_file(),
    reason="needs python launch/prepare_model.py smollm2-135m-instruct",
)
def test_grpo_section_smoke_with_the_real_model(tmp_path):
    """The case at the smoke plan's tiniest settings (one step of 1 prompt x 2 samples of 8
    tokens, 2 held-out problems; about two minutes of a loaded 2-core CPU)."""
    rc, row, _ = _grpo_row(tmp_path, "models/smollm2-135m-instruct", tmp_path / "unused.gguf")
    assert rc == 0 and row["status"] == "ok", row.get("error") or row.get("reason")
    assert row["weights"].startswith("prepared directory") and row["steps"] == 1
    assert row["rollout_tokens"] > 0 and row["rollout_tokens_per_s"] > 0
    assert row["train_real_tokens_per_s"] > 0 and row["held_out_problems"] == 2
    assert (tmp_path / "gc" / "gpu_check_grpo_metrics.jsonl").is_file()


@pytest.mark.slow
def test_the_train_probe_times_a_variant_and_records_a_bad_one(tmp_path):
    """launch/gpu_train_probe.py at the smoke plan's shapes: the check's own step is timed and
    written; a variant the CPU cannot run (cuDNN attention) is recorded as an error, not raised."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(ROOT / "launch" / "gpu_train_probe.py"), "--cpu-smoke"]
    cmd += ["--out", str(tmp_path), "--repeats", "1", "--only", "as_check", "--only", "cudnn"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "gpu_train_probe.json").read_text())["variants"]
    assert set(rows) == {"as_check", "cudnn"}
    assert rows["as_check"]["status"] == "ok"
    assert rows["as_check"]["step_s"] > 0 and rows["as_check"]["tokens_per_s"] > 0
    assert (
        rows["cudnn"]["status"].startswith("error: ValueError")
        and "cudnn" in rows["cudnn"]["status"]
    )
