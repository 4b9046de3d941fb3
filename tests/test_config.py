"""Config system: presets, dotted overrides, and errors that name the full field path."""

from pathlib import Path

import pytest

from dora_jax.config import ConfigError, ExperimentConfig, dump_yaml, load_config, to_dict

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_and_overrides():
    cfg = load_config(
        None, ["train.lr=1e-6", "orchestrator.mode=sync", "model.rope_scaling.factor=4"]
    )
    assert cfg.train.lr == 1e-6
    assert cfg.orchestrator.mode == "sync"
    assert cfg.model.rope_scaling is not None and cfg.model.rope_scaling.factor == 4.0
    assert cfg.model.rope_scaling.low_freq_factor == 1.0  # untouched fields keep defaults
    assert load_config().model == ExperimentConfig().model


def test_string_fields_keep_raw_override_text(tmp_path):
    cfg = load_config(None, ["mesh.rollout.devices=4:8", "model.hf_path=null"])
    assert cfg.mesh.rollout.devices == "4:8" and cfg.model.hf_path is None
    p = tmp_path / "c.yaml"
    p.write_text("mesh:\n  rollout:\n    devices: 4:8\n")
    with pytest.raises(
        ConfigError,
        match=r"^mesh\.rollout\.devices: expected a string, got 248 "
        r"\(quote it",
    ):
        load_config(p)


def test_tuple_of_str_override_is_parsed_as_a_list():
    from dora_jax.config.loading import _is_str_field

    assert _is_str_field(str) and _is_str_field(str | None)
    assert not _is_str_field(tuple[str, ...]) and not _is_str_field(int | None)


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, ["train.length_buckets=[32, 64]", "model.family=llama"])
    dump_yaml(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again == cfg
    assert to_dict(again)["train"]["length_buckets"] == [32, 64]


@pytest.mark.parametrize("preset", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_loads(preset):
    cfg = load_config(preset)
    assert isinstance(cfg, ExperimentConfig)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lrr=1", r"^train\.lrr: unknown key; did you mean 'lr'\?"),
        ("trian.lr=1", r"^trian: unknown key; did you mean 'train'\?"),
        ("train.lr=abc", r"^train\.lr: expected a float, got 'abc'"),
        ("train.microbatches=1.5", r"^train\.microbatches: expected an integer, got 1\.5"),
        ("logging.progress=yes please", r"^logging\.progress: expected a boolean"),
        ("logging.samples_per_step=-1", r"^logging\.samples_per_step: must be >= 0, got -1"),
        ("logging.samples_every=-2", r"^logging\.samples_every: must be >= 0, got -2"),
        ("logging.samples_every=2.5", r"^logging\.samples_every: expected an integer, got 2\.5"),
        (
            "model.family=gpt2",
            r"^model\.family: expected one of 'qwen2', 'llama', 'qwen3', 'mistral', 'qwen3_moe', "
            r"'qwen2_moe', got 'gpt2'",
        ),
        ("model.sliding_window=0", r"^model\.sliding_window: must be > 0 or null \(no window\)"),
        (
            "model.full_attention_layers=3",
            r"^model\.full_attention_layers: must be in \[0, num_layers=2\], got 3",
        ),
        ("model.num_kv_heads=3", r"^model\.num_kv_heads: must divide num_heads \(4\), got 3"),
        ("train.lr=-1", r"^train\.lr: must be > 0, got -1\.0"),
        ("data.median_steps=0", r"^data\.median_steps: must be in \[1, 40\], got 0"),
        ("orchestrator.clock=fast", r"^orchestrator\.clock: expected one of 'logical', 'wall'"),
        ("orchestrator.stall_s=0", r"^orchestrator\.stall_s: must be > 0"),
        ("rollout.top_p=0", r"^rollout\.top_p: must be in \(0, 1\]"),
        ("model.rope_scaling.factor=0.5", r"^model\.rope_scaling\.factor: must be >= 1"),
        ("train.length_buckets=[64, 32]", r"^train\.length_buckets: must be positive and strictly"),
        ("train.length_buckets=[64, x]", r"^train\.length_buckets\[1\]: expected an integer"),
        ("mesh.rollout.tp=4", r"^mesh\.rollout\.tp: must divide model\.num_kv_heads \(2\)"),
        ("train.lr.x=1", r"^train\.lr: is not a section"),
        ("train.lr", r"must look like key\.path=value"),
        (
            "orchestrator.rollout_batch_prompts=1",
            r"^orchestrator\.rollout_batch_prompts: must be >= train_batch_prompts",
        ),
        ("data.task=jsonl", r"^data\.path: must be set when task is 'jsonl'"),
        ("env.workers=0", r"^env\.workers: must be > 0, got 0 \(from"),
        ("env.max_workers=-1", r"^env\.max_workers: must be a whole number >= 0, got -1 \(from"),
        ("env.timeout_s=0", r"^env\.timeout_s: must be > 0, got 0\.0 \(from"),
        ("env.max_turns=0", r"^env\.max_turns: must be > 0, got 0 \(from"),
        ("env.max_tokens=1", r"^env\.max_tokens: must be >= 2, or 0 \(rollout\.max_prompt_len"),
        ("env.reward=mean", r"^env\.reward: expected one of 'sum', 'last', 'function'"),
        ("env.kwargs=[1, 2]", r"^env\.kwargs: expected a mapping, got \[1, 2\]"),
        ("env.kwargs={1: 2}", r"^env\.kwargs: must be a mapping of argument names to values"),
        ("env.spec=", r"^env\.spec: must be a built-in name"),
        ("env.workers.x=1", r"^env\.workers: is not a section"),
        ("env.max_tokens=64", r"^env\.max_tokens: must be > rollout\.max_prompt_len \(64\)"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.family=llama", "model.sliding_window=8"],
            r"^model\.sliding_window: is not part of the llama architecture",
        ),
        (
            ["model.sliding_window=8", "model.attention=cudnn", "model.compute_dtype=bfloat16"],
            r"^model\.attention: cudnn does not support sliding_window",
        ),
        (
            ["model.family=mistral", "model.sliding_window=8", "model.full_attention_layers=1"],
            r"^model\.full_attention_layers: must be 0 for family mistral",
        ),
    ],
)
def test_sliding_window_rules_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_qwen3_and_mistral_configs_load():
    cfg = load_config(None, ["model.family=qwen3", "model.head_dim=32"]).model
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.layer_windows() == (0, 0)
    cfg = load_config(
        None, ["model.family=qwen2", "model.sliding_window=8", "model.full_attention_layers=1"]
    ).model
    assert cfg.layer_windows() == (0, 8) and not cfg.qk_norm


def test_bad_yaml_file_names_the_file_and_field(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  lr: 1e-5\n  warmup: 3\n")
    with pytest.raises(
        ConfigError,
        match=r"^train\.warmup: unknown key; did you mean "
        r"'warmup_steps'\? \(in .*bad\.yaml\)",
    ):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    p.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping at the top level"):
        load_config(p)
    p.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(p)


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(AttributeError):
        cfg.train.lr = 3.0  # type: ignore[misc]


def test_the_largest_seed_works_where_the_seed_is_used():
    """Every use of ``seed`` takes [0, 2**32 - 1], the derived seeds (seed + offset) too;
    outside it the config refuses."""
    import jax
    import numpy as np

    from dora_jax.config.schema import SEED_MAX
    from dora_jax.data import ArithmeticTask
    from dora_jax.data.prompts import shuffled_epochs
    from dora_jax.rollout.requests import request_key

    assert load_config(None, [f"seed={SEED_MAX}"]).seed == SEED_MAX
    for seed in (0, SEED_MAX):
        for offset in (0, 1_000_003, 2_000_003):  # the RL, warm-start and held-out problems
            ArithmeticTask(seed + offset).problem(7)
        shuffled_epochs(list(range(5)), seed)(6)
        request_key(seed, 3, 4)
    keys = {tuple(np.asarray(jax.random.key_data(jax.random.key(s))).tolist()) for s in (0, 1)}
    keys.add(tuple(np.asarray(jax.random.key_data(jax.random.key(SEED_MAX))).tolist()))
    assert len(keys) == 3
    for bad in ("-1", str(SEED_MAX + 1), "true"):
        with pytest.raises(ConfigError, match="^seed: "):
            load_config(None, [f"seed={bad}"])


def test_env_section_loads_kwargs_and_keeps_the_config_hashable(tmp_path):
    from dora_jax.config import EnvConfig

    assert load_config().env == EnvConfig() and EnvConfig().spec is None  # single-turn
    p = tmp_path / "env.yaml"
    p.write_text("env:\n  spec: tool_arithmetic\n  kwargs: {median_steps: 2, sigma: 0.5}\n")
    cfg = load_config(p, ["env.kwargs.max_steps=9", "env.reward=last"])
    assert cfg.env.spec == "tool_arithmetic" and cfg.env.reward == "last"
    assert cfg.env.kwargs == {"median_steps": 2, "sigma": 0.5, "max_steps": 9}
    assert load_config(None, ["env.kwargs={start: 5}"]).env.kwargs == {"start": 5}
    assert load_config(None, ["env.kwargs.game.level=2"]).env.kwargs == {"game": {"level": 2}}
    # the config is hashed (sections as jit static arguments, cache keys): kwargs are left out
    # of the hash, equality still sees them
    other = load_config(p, ["env.reward=last"])
    assert (
        hash(cfg) == hash(other)
        and cfg != other
        and cfg == load_config(p, ["env.kwargs.max_steps=9", "env.reward=last"])
    )
    dump_yaml(cfg, tmp_path / "again.yaml")
    assert load_config(tmp_path / "again.yaml") == cfg
    assert cfg.env.resolved_max_tokens(64, 128) == 192
    assert load_config(None, ["env.max_tokens=100"]).env.resolved_max_tokens(64, 128) == 100
    with pytest.raises(ConfigError, match=r"^kwargs: must be plain JSON data"):
        EnvConfig(kwargs={"x": float("nan")})


def test_a_swapped_environment_does_not_inherit_the_recipes_arguments():
    """The tool recipe's env.kwargs are its environment's: an env.spec given on the command line
    for another class starts from no arguments (its own from the command line), while the
    recipe's own class keeps them."""
    recipe = ROOT / "configs" / "recipes" / "tool-arithmetic-cpu.yaml"
    mine = "env.spec=tests/agentic_envs.py:Chatter"
    assert load_config(recipe, []).env.kwargs  # (the recipe has some)
    assert load_config(recipe, [mine]).env.kwargs == {}
    assert load_config(recipe, ["env.kwargs.turns=3", mine]).env.kwargs == {"turns": 3}
    same = load_config(recipe, ["env.spec=tool_arithmetic", "env.kwargs.max_steps=3"])
    assert same.env.kwargs == {**load_config(recipe, []).env.kwargs, "max_steps": 3}
