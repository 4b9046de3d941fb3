"""benchmarks/bench_vs_trl.py's pure parts: a dora_jax recipe's settings as TRL's GRPOConfig
arguments, dora_jax's learning-rate schedule for TRL's trainer, how a TRL completion ended, the
reward function TRL calls, and a run directory's figures."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_vs_trl as bvt  # noqa: E402

from dora_jax.config import load_config  # noqa: E402

RECIPE = [
    "data.task=jsonl",
    "data.path=train.jsonl",
    "data.reward=final_number",
    "data.tokenizer=hf",
    "train.group_size=8",
    "orchestrator.train_batch_prompts=4",
    "rollout.max_new_tokens=64",
    "rollout.max_prompt_len=64",
    "train.lr=2e-5",
    "train.length_buckets=[128]",
]


def config(*extra):
    return load_config(None, [*RECIPE, *bvt.overrides(10), *extra])


def test_the_settings_are_the_recipes():
    s = bvt.trl_settings(config())
    assert s["num_generations"] == 8
    assert s["per_device_train_batch_size"] * s["gradient_accumulation_steps"] == 32
    assert s["steps_per_generation"] == s["gradient_accumulation_steps"]  # one step per batch
    assert s["num_iterations"] == 1 and s["max_steps"] == 10
    assert s["max_completion_length"] == 64 and s["temperature"] == 1.0
    assert s["learning_rate"] == 2e-5 and s["warmup_steps"] == 0
    assert (s["epsilon"], s["epsilon_high"], s["beta"]) == (0.2, 0.28, 0.0)
    assert s["loss_type"] == "dapo" and s["scale_rewards"] == "group"
    assert s["mask_truncated_completions"] is False and s["shuffle_dataset"] is False
    assert s["use_cpu"] and not s["bf16"] and not s["fp16"]
    assert (s["adam_beta1"], s["adam_beta2"], s["max_grad_norm"]) == (0.9, 0.999, 1.0)
    assert not s["activation_checkpointing"]

    other = bvt.trl_settings(
        config(
            "train.lr=3e-6",
            "train.warmup_steps=3",
            "train.group_size=4",
            "train.clip_eps_high=0.3",
            "train.normalize_std=false",
            "train.loss_agg=seq_mean_token_mean",
            "train.adam_b2=0.99",
            "rollout.max_new_tokens=32",
            "rollout.temperature=0.7",
            "model.remat=full",
        )
    )
    assert other["learning_rate"] == 3e-6 and other["warmup_steps"] == 3
    assert other["lr_scheduler_type"] == "constant_with_warmup"
    assert other["num_generations"] == 4 and other["epsilon_high"] == 0.3
    assert other["scale_rewards"] == "none" and other["loss_type"] == "grpo"
    assert other["adam_beta2"] == 0.99
    assert not other["activation_checkpointing"]  # TRL at its fastest, whatever model.remat
    assert (other["max_completion_length"], other["temperature"]) == (32, 0.7)


def test_micro_batches_follow_the_recipes_microbatches():
    assert bvt.micro_batch(config()) == 32  # one microbatch: one micro-batch
    assert bvt.micro_batch(config("train.microbatches=4")) == 8
    # a 512-token budget holds 4 rows of the 128-token bucket (64 + 64 tokens)
    assert bvt.micro_batch(config("train.microbatch_tokens=512")) == 4
    assert (
        bvt.micro_batch(config("train.microbatch_tokens=384")) == 2
    )  # 3 rows: not a divisor of 32
    s = bvt.trl_settings(config("train.microbatch_tokens=512"))
    assert (s["per_device_train_batch_size"], s["gradient_accumulation_steps"]) == (4, 8)


@pytest.mark.parametrize(
    "bad, why",
    [
        ("train.advantage=rloo", "train.advantage"),
        ("data.reward=exact", "data.reward"),
    ],
)
def test_a_recipe_trl_cannot_follow_is_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        bvt.trl_settings(config(bad))


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_the_lr_factor_is_dora_jax_schedule(schedule, warmup):
    from dora_jax.train.state import lr_schedule

    cfg = config(f"train.schedule={schedule}", f"train.warmup_steps={warmup}").train
    ours = lr_schedule(cfg)
    for n in range(cfg.total_steps + 2):
        want = float(ours(n)) / cfg.lr
        got = bvt.lr_factor(cfg.total_steps, warmup, schedule, n)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7), n
    assert bvt.lr_factor(10, 3, "constant", 0) == pytest.approx(1 / 3)  # not 0, as HF's


def test_finish_reason_from_completion_ids():
    eos = (2,)
    assert bvt.finish_reason([520, 314, 2], eos) == "eos"
    assert bvt.finish_reason([520] * 63 + [2], eos) == "eos"  # the EOS as the last allowed token
    assert bvt.finish_reason([520] * 64, eos) == "length"
    assert bvt.finish_reason([2, 520], eos) == "length"  # TRL cuts after the first EOS
    assert bvt.finish_reason([], eos) == "length"
    assert bvt.finish_reason([7, 0], (2, 0)) == "eos"


def test_the_reward_is_final_number_with_the_finish_reason():
    reward = bvt.FinalNumberReward([2])
    completions = [
        [{"role": "assistant", "content": "13 + 14 = 27"}],  # right, ended
        [{"role": "assistant", "content": "13 + 14 = 27"}],  # right, cut at the limit
        [{"role": "assistant", "content": "It is 26."}],  # wrong, ended
        "The answer is 27",  # a plain-text completion
    ]
    ids = [[9, 2], [9, 9], [9, 2], [9, 2]]
    assert reward(completions, ids, ["27", "27", "27", "27"], trainer_state=None) == [
        1.0,
        0.0,
        0.0,
        1.0,
    ]
    assert reward.calls == [{"score": 0.5, "correct": 0.75, "ended": 0.75}]
    assert reward.__name__ == "final_number"


def test_dora_jax_figures_leave_out_the_evaluations(tmp_path):
    lines = [
        {
            "step": 1,
            "elapsed_s": 30.0,
            "num_samples": 32,
            "train_step_s": 4.0,
            "reward": 0.25,
            "response_len_mean": 40.0,
            "staleness_mean": 0.0,
        },
        {
            "step": 2,
            "elapsed_s": 40.0,
            "num_samples": 32,
            "train_step_s": 3.0,
            "reward": 0.5,
            "response_len_mean": 30.0,
            "staleness_mean": 1.0,
        },
        {
            "step": 3,
            "elapsed_s": 62.0,
            "num_samples": 32,
            "train_step_s": 3.0,
            "reward": 0.75,
            "response_len_mean": 20.0,
            "staleness_mean": 1.0,
        },
    ]
    evals = [
        {"step": 0, "eval/solved": 0.25, "eval/response_len": 40.0, "eval/seconds": 10.0},
        {"step": 2, "eval/solved": 0.5, "eval/response_len": 30.0, "eval/seconds": 12.0},
        {"step": 3, "eval/solved": 0.75, "eval/response_len": 20.0, "eval/seconds": 9.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    f = bvt.dora_jax_figures(tmp_path, 4)
    assert f["step_seconds"] == [20.0, 10.0, 10.0]  # evaluations at steps 0 and 2 left out
    assert f["train_seconds"] == 40.0 and f["samples"] == 96
    assert f["samples_per_s"] == pytest.approx(96 / 40)
    assert f["seconds_per_step"]["median"] == 10.0
    assert f["profile"]["train_step_s"] == 10.0 and f["profile"]["rest_s"] == 30.0
    assert f["train_reward_mean"] == pytest.approx(0.5)
    assert f["held_out"]["solved"] == 0.75 and f["held_out"]["step"] == 3
    assert f["held_out"]["se"] == pytest.approx((0.75 * 0.25 / 4) ** 0.5)
    assert f["held_out_step0"]["solved"] == 0.25


def test_trl_takes_the_settings(tmp_path):
    trl = pytest.importorskip("trl", reason="trl is the optional 'bench' extra")
    args = trl.GRPOConfig(output_dir=str(tmp_path), **bvt.trl_settings(config()))
    assert args.generation_batch_size == 32 and args.steps_per_generation == 1
    assert args.loss_type == "dapo" and args.epsilon_high == 0.28
    assert not args.gradient_checkpointing  # not TRL's default (True): model.remat is none
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), **bvt.trl_settings(config("train.microbatch_tokens=512"))
    )
    assert args.generation_batch_size == 32 and args.steps_per_generation == 8


def test_overrides_and_ratios():
    assert bvt.overrides(3, ["eval.num_prompts=8"]) == [
        "eval.num_prompts=8",
        "train.total_steps=3",
        "eval.every_steps=3",
    ]
    systems = {"trl": {"samples_per_s": 0.5}, "sync": {"samples_per_s": 1.0}}
    assert bvt.ratios(systems) == {"samples_per_s dora_jax-sync / TRL": 2.0}
    systems["dora"] = {"samples_per_s": 1.5}
    assert bvt.ratios(systems)["samples_per_s dora_jax-dora / TRL"] == 3.0
    assert bvt.ratios({"sync": {"samples_per_s": 1.0}}) == {}
    systems["trl_bf16"] = {"samples_per_s": 0.75}  # the faster TRL run sets the fastest ratio
    r = bvt.ratios(systems)
    assert r["samples_per_s dora_jax-sync / TRL"] == 2.0
    assert r["samples_per_s dora_jax-dora / TRL bfloat16"] == 2.0
    assert r["samples_per_s dora_jax-sync / TRL fastest"] == pytest.approx(1.0 / 0.75)


def test_without_trl_the_benchmark_stops_with_one_line_naming_the_extra(monkeypatch, tmp_path):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "trl" else find(name, *a)
    )
    monkeypatch.chdir(tmp_path)  # main moves to the checkout; this puts the test's back after
    with pytest.raises(SystemExit) as stop:
        bvt.main(["--steps", "1", "--out", str(tmp_path / "out.json")])
    assert str(stop.value).startswith("error: TRL is not installed; pip install -e '.[bench]'")
    assert not (tmp_path / "out.json").exists()
