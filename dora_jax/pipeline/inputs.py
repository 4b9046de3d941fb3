"""A run's inputs, read and checked before anything runs: the prompt source and the reward of
``data`` (the built-in task or a dataset file, prompts too long for the engine refused or
skipped), the scorers, the environment side of a multi-turn run (``env``), and the held-out
evaluation (problems of the task, rows of ``eval.path``, or held-out episodes of the
environment). Every refusal is an :class:`ExperimentError` or a :class:`DataError` naming the
field, file and row."""

from __future__ import annotations

from collections.abc import Callable

from dora_jax.config import ExperimentConfig
from dora_jax.data import ArithmeticTask, Example, Scorer, read_rows, to_examples
from dora_jax.data.files import DataError
from dora_jax.data.math_answers import FALLBACK_NOTE, MATH_VERIFY
from dora_jax.data.prompts import PromptSource, shuffled_epochs
from dora_jax.data.reward_functions import RewardSpecError, load_reward_function, resolve_spec
from dora_jax.data.reward_pool import RewardPool
from dora_jax.data.rewards import exact_reward, final_number_reward
from dora_jax.envs import EnvPoolError, EnvSpecError
from dora_jax.mesh import Meshes
from dora_jax.model.tokenizer import TokenizerError
from dora_jax.pipeline.conversations import EnvRun, build_env, held_out_episodes
from dora_jax.pipeline.evaluation import Evaluator


class ExperimentError(ValueError):
    """The config and the files it names do not fit together (message names the field)."""


def fitting(
    examples: list[Example],
    encode: Callable[[object], list[int]],
    cfg: ExperimentConfig,
    path: str,
    setting: str,
) -> tuple[list[Example], list[int]]:
    """The examples whose prompt fits ``rollout.max_prompt_len`` once tokenised as the run
    tokenises it (``data.system_prompt``, ``data.prompt_template``, the chat template), and the
    rows (JSONL lines) of those that do not. With ``data.long_prompts=error`` the first that does
    not fit is a :class:`DataError` naming its file and row; so is a prompt the tokenizer cannot
    encode (a character outside the character tokenizer's alphabet)."""
    d, limit, kept, skipped = cfg.data, cfg.rollout.max_prompt_len, [], []
    for ex in examples:
        try:
            n = len(encode(ex.prompt))
        except TokenizerError as e:  # a character the tokenizer cannot encode
            raise DataError(f"{path}:{ex.row}: {e} (data.tokenizer={d.tokenizer})") from None
        if 0 < n <= limit:
            kept.append(ex)
            continue
        if d.long_prompts == "error":
            extra = [
                f
                for f, v in (
                    ("data.system_prompt", d.system_prompt),
                    ("data.prompt_template", d.prompt_template != "{prompt}"),
                )
                if v
            ]
            with_ = f" with {' and '.join(extra)}" if extra else ""
            raise DataError(
                f"{path}:{ex.row}: the prompt has {n} tokens{with_}; rollout.max_prompt_len is "
                f"{limit} ({setting}: raise rollout.max_prompt_len, filter the file, or set "
                "data.long_prompts=skip)"
            )
        skipped.append(ex.row)
    if not kept:
        raise DataError(f"{path}: no prompt fits rollout.max_prompt_len={limit} ({setting})")
    return kept, skipped


def task_parts(cfg: ExperimentConfig, encode: Callable[[object], list[int]] | None = None):
    """(prompt source, inline reward fn or None, worked-example fn or None, rows skipped as too
    long) for ``data.task``; the reward is None when it runs in worker processes
    (:func:`scorers`). With ``encode`` (a prompt's token ids) a dataset's prompts longer than
    ``rollout.max_prompt_len`` are refused or skipped (``data.long_prompts``)."""
    d = cfg.data
    if d.task == "arithmetic":
        task = ArithmeticTask(cfg.seed, median_steps=d.median_steps)
        # warm-start problems differ from RL prompts
        sft = ArithmeticTask(cfg.seed + 1_000_003, median_steps=d.median_steps)
        example = lambda i: sft.demonstration(i, cfg.warm_start.direct_frac)  # noqa: E731
        reward = {"exact": task.answer_reward, "partial_credit": task.reward}.get(d.reward)
        return task.source(), reward, example, []
    items, skipped = load_examples(cfg, d.path), []
    if encode is not None:
        items, skipped = fitting(items, encode, cfg, d.path, "data.path")
    source = PromptSource(shuffled_epochs(items, cfg.seed, d.shuffle), f"{d.task}:{d.path}")
    inline = {"exact": exact_reward, "final_number": final_number_reward}  # cheap: no workers
    return source, inline.get(d.reward), None, skipped


def load_examples(cfg: ExperimentConfig, path: str, setting: str = "data.path") -> list[Example]:
    """The rows of ``path`` read as ``data.task``, with ``data``'s field paths (``setting`` names
    the config field that points at ``path``, for a missing file)."""
    d = cfg.data
    rows = read_rows(d.task, path, d.split, setting=setting)
    return to_examples(rows, d.prompt_field, d.answer_field, path)


def scorers(cfg: ExperimentConfig, inline, now) -> tuple[Scorer, Scorer]:
    """The run's scorer and the evaluation's (its own error counts; one worker pool)."""
    if inline is not None:
        return Scorer(inline), Scorer(inline)
    spec = cfg.data.reward
    try:
        load_reward_function(spec)  # fail now, naming data.reward, not in every worker
    except RewardSpecError as e:
        raise ExperimentError(str(e)) from None
    if spec == "boxed_math" and not MATH_VERIFY:
        print(f"note: {FALLBACK_NOTE}", flush=True)
    d = cfg.data
    pool = RewardPool(resolve_spec(spec), d.reward_workers, d.reward_timeout_s, now=now)
    return Scorer(pool=pool), Scorer(pool=pool)


def eval_problems(
    cfg: ExperimentConfig, encode: Callable[[object], list[int]] | None = None
) -> list[tuple[str, str]] | list[Example]:
    """Held-out problems: the built-in task's come from a seed no training or warm-start
    problem uses; a dataset run's from ``eval.path`` (none without it), read like ``data``
    (with ``encode``, prompts longer than ``rollout.max_prompt_len`` are refused or skipped like
    the training data's)."""
    e, d = cfg.eval, cfg.data
    if e.num_prompts == 0:
        return []
    if d.task == "arithmetic":
        held_out = ArithmeticTask(cfg.seed + 2_000_003, median_steps=d.median_steps)
        return [held_out.problem(i) for i in range(e.num_prompts)]
    if e.path is None:
        return []
    examples = load_examples(cfg, e.path, "eval.path")
    if encode is not None:
        examples = fitting(examples, encode, cfg, e.path, "eval.path")[0]
    return examples[: e.num_prompts]


def env_run(cfg: ExperimentConfig, tokenizer, now) -> EnvRun | None:
    """The environment side of a multi-turn run (None without ``env.spec``); a spec or class
    that cannot load is one ``env:`` line."""
    try:
        return build_env(cfg, tokenizer, now=now)
    except (EnvSpecError, EnvPoolError) as e:
        raise ExperimentError(str(e)) from None


def evaluator(cfg: ExperimentConfig, meshes: Meshes, tokenizer, scorer, encode, env=None):
    """The held-out evaluation on the trainer's first device (None without problems): a
    multi-turn run's on held-out episodes of its environment."""
    conversations = None
    if env is not None and cfg.eval.num_prompts:
        conversations = held_out_episodes(env, cfg, tokenizer, cfg.seed + 2_000_003)
        problems = []
    else:
        problems = eval_problems(cfg, encode)
    if not problems and conversations is None:
        return None
    try:
        return Evaluator(
            cfg.model,
            cfg.rollout,
            meshes.trainer.devices.flat[0],
            tokenizer,
            problems,
            scorer,  # its own error count: eval errors are not the run's
            cfg.seed,
            encode=encode,
            samples_per_prompt=cfg.eval.samples_per_prompt,
            conversations=conversations,
        )
    except ValueError as e:
        raise ExperimentError(f"eval: {e}") from None
