"""Typed, frozen configuration of one experiment.

Every section is a frozen dataclass whose ``__post_init__`` checks its own invariants and raises
:class:`ConfigError` naming the field. :mod:`dora_jax.config.loading` builds these from YAML and
dotted command-line overrides and prefixes every error with the full field path
(``train.lr: expected a float, got 'abc'``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from dora_jax.config.errors import (
    ConfigError,
    check_bool,
    check_choice,
    check_non_negative,
    check_positive,
)
from dora_jax.config.errors import check as _check
from dora_jax.config.mesh import MeshConfig, RolloutMeshConfig, TrainerMeshConfig  # noqa: F401
from dora_jax.config.model import (  # noqa: F401  (re-exported)
    MOE_FAMILIES,
    Dtype,
    ModelConfig,
    RopeScalingConfig,
)


@dataclass(frozen=True)
class RolloutConfig:
    """One engine per rollout group."""

    max_slots: int = 16  # concurrent requests per engine
    page_size: int = 16
    # KV pages per engine (page 0 is reserved as padding); null: as many as the memory left by
    # everything else allows (the memory plan sizes them, like vLLM's gpu_memory_utilization)
    num_pages: int | None = 256
    max_prompt_len: int = 64
    max_new_tokens: int = 128
    prefill_chunk: int = 64
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    attention_impl: Literal["reference", "pallas"] = "reference"
    # True: every decode/prefill step uses one batch shape (max_slots rows), so a request's
    # tokens and logprobs do not depend on which other requests share its steps: migration and
    # parking continue bit-identically. False: power-of-4 batch buckets (less padding compute).
    batch_invariant: bool = True
    # Requests admitted together with the same prompt (a GRPO group's members) are prefilled
    # once: the others copy its KV pages and sample their first token from its logits with their
    # own keys (the same tokens and logprobs as prefilling each).
    share_prefill: bool = True
    # Rows of one prefill call (0, or more than max_slots: max_slots). With share_prefill a call
    # holds one row per distinct prompt, so a GRPO group of G samples needs max_slots / G of
    # them; a fixed shape either way when batch_invariant.
    prefill_rows: int = 0
    # Decode steps per device call: > 1 amortises the host round trip (tokens past a request's
    # EOS or budget are dropped). 1 keeps one token per request per engine step (tick).
    decode_steps: int = 1
    # Token ids that also end a response, besides the tokenizer's EOS ids (its eos_token and the
    # model's generation_config.json eos_token_id, which may list several)
    extra_eos_ids: tuple[int, ...] = ()
    # Host copies of every group's requests (their tokens, and the KV of those holding it on the
    # device), taken every this many engine steps (ticks on the logical clock). A group whose
    # engine fails continues them on a group of their version from the copy, with nothing
    # prefilled again. 0: no copies (a failed group's requests go on from their tokens so far,
    # re-prefilled, or from their prompts).
    backup_every_steps: int = 0
    # Times one group's engine may fail (and be rebuilt on its devices) before the run stops.
    max_group_restarts: int = 3

    def __post_init__(self):
        check_positive(self, "max_slots", "page_size", "max_prompt_len", "max_new_tokens")
        check_non_negative(self, "backup_every_steps", "max_group_restarts")
        check_positive(self, "prefill_chunk")
        check_non_negative(self, "prefill_rows")
        check_non_negative(self, "temperature", "top_k")
        _check(
            self.num_pages is None or self.num_pages >= 2,
            "num_pages",
            f"must be >= 2 (page 0 is reserved) or null, got {self.num_pages}",
        )
        _check(
            all(i >= 0 for i in self.extra_eos_ids),
            "extra_eos_ids",
            f"must be token ids >= 0, got {list(self.extra_eos_ids)}",
        )
        _check(self.decode_steps >= 1, "decode_steps", f"must be >= 1, got {self.decode_steps}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")

    @property
    def resolved_prefill_rows(self) -> int:
        """Rows of one prefill call: ``prefill_rows`` (0: ``max_slots``), at most ``max_slots``."""
        return min(self.prefill_rows or self.max_slots, self.max_slots)


@dataclass(frozen=True)
class TrainConfig:
    """GRPO optimisation on the trainer submesh."""

    lr: float = 1e-5
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    # [first step, steps, factor]: the learning rate times factor over those optimizer steps (a
    # drift stress for staleness_k: auto, benchmarks/bench_adaptive_k.py); empty: none
    lr_boost: tuple[float, ...] = ()
    total_steps: int = 100
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    microbatches: int = 1
    fp32_master_weights: bool = False
    # Adam's first and second moments. float32 unless asked otherwise: in bfloat16 the second
    # moment of small gradients underflows and the moments lose the precision the update needs.
    adam_moment_dtype: Dtype = "float32"
    logprob_chunk: int = 4096  # vocabulary chunk for per-token log-probabilities
    group_size: int = 8  # G: samples per prompt
    advantage: Literal["grpo", "rloo"] = "grpo"
    normalize_std: bool = True  # False: Dr. GRPO (no division by the group std)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    tis_cap: float | None = None  # truncated importance weight cap for engine/trainer mismatch
    # Mixture-of-experts policies: the train forward uses the experts the engine routed each
    # token to (recorded while sampling) instead of recomputing the routing, so the importance
    # ratio compares the same experts. Either way the metrics report routing_diff_share.
    routing_replay: bool = False
    kl_beta: float = 0.0
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    length_buckets: tuple[int, ...] = (64, 128, 256, 512)
    adv_eps: float = 1e-6  # added to the group std before dividing (grpo with normalize_std)
    # seq_mean_token_sum_norm divides each sequence's token sum by this constant; None: the
    # largest length bucket (a constant, so the loss scale does not jump with the bucket)
    loss_norm_len: int | None = None
    # How trajectories fill a train batch's rows. "tokens": several per row (each its own
    # segment), first-fit-decreasing into rows of a length bucket, the row count the smallest
    # of a fixed ladder that fits (train.batch.row_ladder: every integer up to 8, then four steps
    # per doubling, times microbatches x data), so the trainer's cost follows the real tokens and
    # the step compiles once per (rows, bucket) it meets. "rows": one trajectory per row, padded
    # to the batch's bucket (what model.attention=cudnn needs).
    packing: Literal["tokens", "rows"] = "tokens"
    # a fixed number of rows for packed batches (0: the ladder's choice; "rows" ignores it)
    pack_rows: int = 0
    # With packing "tokens": a GRPO group whose members share one prompt is packed with that
    # prompt once, each response attending to the one copy (model/attention.py, "shared
    # prefixes"), so the step computes a group's prompt once instead of group_size times. The
    # loss, gradients and metrics are those of the unshared batch (up to float rounding); a
    # group that does not fit one row is split into runs, each with its own copy of the prompt.
    # Not with train.pack_rows (a fixed row count) or a mixture-of-experts policy's routes.
    share_prompts: bool = False
    # Microbatches by a token budget: with packing "tokens", each microbatch is this many
    # positions per data-parallel device (rows of a bucket: max(1, budget // bucket) per device),
    # the batch has room for the worst case (one sample per row) and the step loops over the
    # microbatches that hold samples only: its cost follows the real tokens and it compiles once
    # per length bucket. 0: the row count is chosen from a ladder instead (a compilation per
    # (rows, bucket) met) and split into train.microbatches.
    microbatch_tokens: int = 0
    # When the step compiles for a packed batch shape it has not met. "inline": there and then
    # (the step waits). "background": on a worker thread, while the batch runs in the smallest
    # compiled shape that holds it (the memory plan's largest at worst); the shape then depends
    # on timing, so a run no longer repeats exactly. "auto": background on the wall clock with
    # the trainer in one process, inline otherwise.
    compile_shapes: Literal["auto", "inline", "background"] = "auto"
    staleness_bins: int = 8  # staleness histogram bins 0..bins-1; the last also counts larger
    # a step whose loss or gradient is not finite is skipped (params unchanged), logged and
    # counted; after this many in a row the run stops with a checkpoint (0: never stop)
    max_consecutive_skips: int = 5

    def __post_init__(self):
        check_positive(self, "lr", "total_steps", "max_grad_norm", "microbatches", "logprob_chunk")
        _check(
            not self.lr_boost or (len(self.lr_boost) == 3 and min(self.lr_boost) >= 0),
            "lr_boost",
            f"expected [first step, steps, factor], each >= 0, or []; got {list(self.lr_boost)}",
        )
        check_non_negative(self, "warmup_steps", "weight_decay", "clip_eps_low", "clip_eps_high")
        _check(self.group_size >= 2, "group_size", f"must be >= 2, got {self.group_size}")
        _check(
            self.tis_cap is None or self.tis_cap >= 1.0,
            "tis_cap",
            f"must be >= 1 or null, got {self.tis_cap}",
        )
        check_non_negative(
            self, "kl_beta", "pack_rows", "microbatch_tokens", "max_consecutive_skips"
        )
        _check(len(self.length_buckets) > 0, "length_buckets", "must not be empty")
        _check(
            all(b > 0 for b in self.length_buckets)
            and list(self.length_buckets) == sorted(set(self.length_buckets)),
            "length_buckets",
            f"must be positive and strictly increasing, got {list(self.length_buckets)}",
        )
        check_positive(self, "adv_eps", "staleness_bins")
        _check(
            self.loss_norm_len is None or self.loss_norm_len > 0,
            "loss_norm_len",
            f"must be > 0 or null, got {self.loss_norm_len}",
        )
        check_choice(self, "packing", ("tokens", "rows"))
        if self.microbatch_tokens:
            _check(
                self.packing == "tokens" and not self.pack_rows,
                "microbatch_tokens",
                "needs train.packing: tokens and train.pack_rows: 0 (it sizes the batch itself)",
            )
            _check(
                self.microbatches == 1,
                "microbatch_tokens",
                f"sets the microbatches itself: train.microbatches must be 1, got "
                f"{self.microbatches}",
            )
        check_choice(self, "compile_shapes", ("auto", "inline", "background"))
        _check(
            not self.share_prompts or (self.packing == "tokens" and not self.pack_rows),
            "share_prompts",
            "packs several segments a row: it needs train.packing: tokens and train.pack_rows: 0, "
            f"got packing={self.packing!r}, pack_rows={self.pack_rows}",
        )

    @property
    def resolved_loss_norm_len(self) -> int:
        """The seq_mean_token_sum_norm normaliser: ``loss_norm_len`` or the largest bucket."""
        return self.loss_norm_len if self.loss_norm_len is not None else self.length_buckets[-1]


# orchestrator.mode: the built-in modes; orchestrator.register_mode adds each name it registers
Mode = Literal["sync", "one_step", "partial", "oversample", "dora"]
Clock = Literal["logical", "wall"]
Admission = Literal["spread", "fill"]


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """The dora planner's switches (``orchestrator/planner.py``), each on by default (off, one at
    a time: the simulator's ablation). The planner's ``PlanPolicy`` is this class plus what the
    mode gives it: a field added here is a config key of real and simulated runs alike."""

    kv_aware: bool = True  # releases and moves budget KV pages (off: slot counts only)
    consolidate: bool = True  # older versions' tails packed onto as few groups as their KV needs
    spread: bool = True  # spare groups take over part of the gate version's load
    prewarm: bool = True  # idle groups of versions without work load the newest version
    # legacy fill only at versions that stay consumable for at least this many more train steps
    # (v - oldest): a request started one step before its deadline holds the window up
    legacy_fill_margin: int = 2

    def __post_init__(self):
        check_bool(self, "kv_aware", "consolidate", "spread", "prewarm")
        check_positive(self, "legacy_fill_margin")


@dataclass(frozen=True)
class OrchestratorConfig:
    """The control plane: mode, staleness window K, batch sizes and planner triggers."""

    mode: Mode = "dora"
    # logical: one control round per tick, every group one engine step per tick, the trainer's
    # step inline (deterministic, exactly resumable); wall: every group and the trainer on
    # their own worker threads, the control plane reacting to their events (speed)
    clock: Clock = "wall"
    staleness_k: int | Literal["auto"] = 2  # K, or auto (k_min, k_max, ess_min below)
    train_batch_prompts: int = 4  # TBS: prompt groups consumed per train step
    rollout_batch_prompts: int = 8  # RBS: prompt groups in flight
    plan_period_ticks: int = 32
    # Which groups of a request's version take new requests: spread (the most free slots first:
    # groups on their own devices share the work) or fill (the fullest group with a free slot
    # first: groups that share the same cores, as fake CPU devices do, cost a whole batch's
    # step each however few rows they hold, and an empty group's step is skipped)
    admission: Admission = "spread"
    kv_pressure_threshold: float = 0.9
    # dora: supplement older versions with prompts that fill their idle slots (tiered injection)
    legacy_fill: bool = True
    # dora: also plan when a ready group idles with nothing admissible while requests of another
    # version wait or another group could share its load
    plan_on_idle: bool = True
    # dora: a KV-pressure or idle trigger whose plan moved nothing stays quiet until what it
    # looks at changes (groups' versions, idle or hot groups, room, pending versions)
    plan_hysteresis: bool = True
    # dora, multi-process runs: migrations go to groups on the source's own host first and an
    # older version's weights come from a holder on the receiver's host first (off: the same
    # choices as one process would make, host ignored)
    prefer_local_moves: bool = True
    planner: PlannerConfig = field(default_factory=PlannerConfig)  # dora's planner switches
    # staleness_k: auto (beyond the paper): K re-chosen after every train step within [k_min,
    # k_max] from the measured drift (the importance weights' ESS by lag) and from how long the
    # trainer waited for the window's oldest version (orchestrator/staleness.py). ess_min: the
    # drift budget, the ESS (as a share of lag 0's) allowed at the bound.
    k_min: int = 1
    k_max: int = 4
    ess_min: float = 0.9
    # wall clock: stop with an error after this many seconds without progress (no train step,
    # no trajectory, no dispatch)
    stall_s: float = 600.0
    # a run with no rollout group left in it (every one's process gone, or every engine failed
    # past rollout.max_group_restarts) waits this many seconds for one to come back, counting
    # down on the terminal, then stops with a checkpoint and the resume command
    no_groups_wait_s: float = 300.0

    @property
    def auto_k(self) -> bool:
        return self.staleness_k == "auto"

    @property
    def k_bound(self) -> int:
        """The largest K the run may use: ``staleness_k``, or ``k_max`` when it is auto."""
        return self.k_max if self.staleness_k == "auto" else self.staleness_k

    def __post_init__(self):
        known = ", ".join(map(repr, get_args(Mode)))
        _check(self.mode in get_args(Mode), "mode", f"expected one of {known}, got {self.mode!r}")
        _check(
            self.admission in get_args(Admission),
            "admission",
            f"expected one of {', '.join(map(repr, get_args(Admission)))}, got {self.admission!r}",
        )
        if self.staleness_k != "auto":
            _check(
                isinstance(self.staleness_k, int) and not isinstance(self.staleness_k, bool),
                "staleness_k",
                f"expected an integer or 'auto', got {self.staleness_k!r}",
            )
            check_non_negative(self, "staleness_k")
        check_non_negative(self, "k_min")
        _check(
            self.k_max >= self.k_min,
            "k_max",
            f"must be >= k_min ({self.k_min}), got {self.k_max}",
        )
        _check(0 < self.ess_min < 1, "ess_min", f"must be in (0, 1), got {self.ess_min}")
        _check(
            self.staleness_k != "auto" or self.mode == "dora",
            "staleness_k",
            f"auto is for mode dora (the others fix K), got mode {self.mode!r}",
        )
        _check(
            self.mode != "one_step" or self.staleness_k >= 1,
            "staleness_k",
            "one_step mode trains on the previous version (K = 1 whatever staleness_k says): "
            f"needs staleness_k >= 1, got {self.staleness_k}",
        )
        check_positive(
            self, "stall_s", "no_groups_wait_s", "train_batch_prompts", "plan_period_ticks"
        )
        check_choice(self, "clock", ("logical", "wall"))
        check_bool(self, "legacy_fill", "plan_on_idle", "plan_hysteresis")
        _check(
            self.rollout_batch_prompts >= self.train_batch_prompts,
            "rollout_batch_prompts",
            f"must be >= train_batch_prompts ({self.train_batch_prompts}), "
            f"got {self.rollout_batch_prompts}",
        )
        _check(
            0 < self.kv_pressure_threshold <= 1,
            "kv_pressure_threshold",
            f"must be in (0, 1], got {self.kv_pressure_threshold}",
        )


BUILT_IN_REWARDS = ("exact", "boxed_math", "partial_credit", "final_number")
# ``seed`` seeds numpy (``default_rng`` refuses negative integers; the warm-start and held-out
# problems use ``seed`` plus an offset, which numpy takes at any size) and jax
# (``jax.random.key`` keeps the low 32 bits without x64: seeds 2**32 apart would share their
# initial params), so it must be an integer in [0, SEED_MAX].
SEED_MAX = 2**32 - 1


@dataclass(frozen=True)
class DataConfig:
    """Prompts: the built-in synthetic task, or rows of a dataset file (``path``): ``jsonl``
    (one JSON object per line), ``parquet``, or ``hf`` (a directory written by a Hugging Face
    dataset's ``save_to_disk``, or a ``.json``/``.jsonl``/``.parquet`` file read through
    ``datasets.load_dataset``)."""

    task: Literal["arithmetic", "jsonl", "parquet", "hf"] = "arithmetic"
    path: str | None = None
    split: str = "train"  # hf: the split of a DatasetDict or of load_dataset
    # dotted paths into a row: 'prompt' (a string, or a list of chat messages), and the
    # reference answer, e.g. veRL's 'reward_model.ground_truth'
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    # a string prompt becomes the user message prompt_template.format(prompt=...); a system
    # message is put first unless the row's messages already start with one
    system_prompt: str | None = None
    prompt_template: str = "{prompt}"
    shuffle: bool = True  # a fresh seeded order every epoch (exact on resume)
    # exact: the answer (arithmetic: the remainder after '#') equals the reference; boxed_math:
    # the last \\boxed{} against the reference through math-verify (files only); final_number:
    # the response's last number equals the reference and the response ended (files only);
    # partial_credit: arithmetic only, also credits a correct countdown prefix; or your own
    # function, 'path/to/file.py:function' or 'package.module:function'
    reward: str = "exact"
    # boxed_math and your own functions run in reward_workers worker processes; a call past
    # reward_timeout_s seconds is stopped and scores 0 (counted)
    reward_timeout_s: float = 30.0
    reward_workers: int = 2
    # a trajectory whose reward call or environment call failed (timeout, exception, invalid
    # result, crashed worker; counted by kind either way) scores 0; what that 0 does to the
    # advantages of its prompt group: "zero" keeps it in the group's baseline like a wrong
    # answer (it drags the mean down and hands the other members advantage they did not earn);
    # "drop_sample" leaves it out: the group's mean and std are over its other members, and the
    # failed one gets advantage 0 and no loss weight; "drop_group" gives every member of a group
    # with a failed one advantage 0 and no loss weight. Dropped samples are still consumed and
    # counted (failed_samples_dropped, failed_groups_dropped in metrics.jsonl and summary.json)
    on_failure: Literal["zero", "drop_sample", "drop_group"] = "drop_sample"
    # a broken reward function or environment stops the run (with a checkpoint, naming it and
    # its last error) once max_failed_steps train steps in a row had at least max_failed_share
    # of their samples failed (0: never stop for that)
    max_failed_steps: int = 3
    max_failed_share: float = 1.0
    tokenizer: Literal["char", "hf"] = "char"
    # a prompt longer than rollout.max_prompt_len: "error" refuses the data file before the run
    # starts, naming the line; "skip" leaves it out and counts it (summary.json)
    long_prompts: Literal["error", "skip"] = "error"
    # arithmetic: the median number of countdown steps of a problem (lognormal, capped at 40);
    # larger means longer responses and a longer tail
    median_steps: int = 3

    def __post_init__(self):
        _check(
            1 <= self.median_steps <= 40,
            "median_steps",
            f"must be in [1, 40], got {self.median_steps}",
        )
        _check(
            self.task == "arithmetic" or bool(self.path),
            "path",
            f"must be set when task is {self.task!r}",
        )
        _check(
            self.reward in BUILT_IN_REWARDS or ":" in self.reward,
            "reward",
            f"must be one of {', '.join(BUILT_IN_REWARDS)} or 'file.py:function' / "
            f"'package.module:function', got {self.reward!r}",
        )
        _check(
            (self.task == "arithmetic" or self.reward != "partial_credit")
            and (self.task != "arithmetic" or self.reward not in ("boxed_math", "final_number")),
            "reward",
            f"{self.reward!r} does not apply to task {self.task!r}",
        )
        _check(
            "{prompt}" in self.prompt_template,
            "prompt_template",
            f"must contain '{{prompt}}', got {self.prompt_template!r}",
        )
        for name in ("prompt_field", "answer_field"):
            value = getattr(self, name)
            _check(
                bool(value) and all(value.split(".")),
                name,
                f"must be a field name or a dotted path, got {value!r}",
            )
        check_positive(self, "reward_timeout_s", "reward_workers")
        check_bool(self, "shuffle")
        check_choice(self, "on_failure", ("zero", "drop_sample", "drop_group"))
        _check(
            self.max_failed_steps >= 0,
            "max_failed_steps",
            f"must be >= 0 (0: never stop), got {self.max_failed_steps}",
        )
        _check(
            0.0 < self.max_failed_share <= 1.0,
            "max_failed_share",
            f"must be in (0, 1], got {self.max_failed_share}",
        )


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start on the built-in task's worked solutions, cached in the run
    directory, so a tiny random policy starts with a non-zero, non-perfect pass rate."""

    steps: int = 300  # 0: no warm start
    batch_size: int = 32  # rows of seq_len tokens per step, each packed with whole examples
    lr: float = 3e-3
    seq_len: int = 192
    # share of the teacher's demonstrations that give the bare answer without the scratchpad
    # (see ArithmeticTask.demonstration); 0: every demonstration is worked out
    direct_frac: float = 0.0

    def __post_init__(self):
        check_non_negative(self, "steps")
        check_positive(self, "batch_size", "lr", "seq_len")
        _check(
            0.0 <= self.direct_frac <= 1.0,
            "direct_frac",
            f"must be in [0, 1], got {self.direct_frac}",
        )


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 0  # 0: only at the end and on SIGINT/SIGTERM
    keep: int = 3
    async_save: bool = True

    def __post_init__(self):
        _check(self.every_steps >= 0, "every_steps", f"must be >= 0, got {self.every_steps}")
        _check(self.keep > 0, "keep", f"must be > 0, got {self.keep}")


@dataclass(frozen=True)
class LoggingConfig:
    progress: bool = True
    tensorboard: bool = True
    every_steps: int = 1
    # Weights & Biases (optional package): the metrics.jsonl numbers under the same names;
    # WANDB_MODE=offline writes the run under run_dir/wandb/ without a network
    wandb: bool = False
    wandb_project: str = "dora_jax"
    wandb_name: str | None = None  # None: the run directory's name
    wandb_tags: tuple[str, ...] = ()
    # print the full per-device memory plan at the start (else one line; the full plan is
    # written to run_dir/memory_plan.txt either way, and printed when it refuses the run)
    memory_plan: bool = False
    # sampled completions (run_dir/samples.jsonl, TensorBoard text, a W&B table): the first
    # trajectories of each step's first prompt groups; 0: none
    samples_per_step: int = 2
    # print one of them (prompt, response, reward) every this many steps; 0: never
    samples_every: int = 10

    def __post_init__(self):
        _check(self.every_steps > 0, "every_steps", f"must be > 0, got {self.every_steps}")
        check_non_negative(self, "samples_per_step", "samples_every")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation between train steps: one sampled response (rollout temperature) per
    fixed problem, the same sampling keys every time, so evaluations compare paired. The built-in
    task draws its held-out problems from a seed of its own; a dataset run evaluates on ``path``
    (same fields as ``data``) and skips evaluation without it."""

    num_prompts: int = 256  # 0: no evaluation
    every_steps: int = 100  # also before the first step and after the last
    path: str | None = None
    # k responses per problem: mean@k and pass@j (unbiased estimator) for j = 1, 2, 4, ..., k
    samples_per_prompt: int = 1

    def __post_init__(self):
        _check(self.num_prompts >= 0, "num_prompts", f"must be >= 0, got {self.num_prompts}")
        _check(
            self.samples_per_prompt >= 1,
            "samples_per_prompt",
            f"must be >= 1, got {self.samples_per_prompt}",
        )
        _check(self.every_steps > 0, "every_steps", f"must be > 0, got {self.every_steps}")


ENV_REWARDS = ("sum", "last", "function")


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn environments (docs/agentic.md): each prompt is an episode of the environment
    ``spec`` names, played by the model's turns and the environment's answers. ``spec`` None:
    single-turn prompts from ``data`` (no environment)."""

    # a built-in (tool_arithmetic, guess_numbers, reasoning_gym, gem),
    # 'path/to/file.py:Class' or 'package.module:Class'
    spec: str | None = None
    # the class's constructor keyword arguments (plain JSON data: they go to worker processes).
    # Left out of the config's hash (a dict has none); equality still compares them.
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    workers: int = 2  # worker processes running the environment's calls
    # more are started, up to this many, for calls that wait behind a busy worker (a hanging
    # call holds up only itself); 0 or fewer than ``workers``: no more than ``workers``
    max_workers: int = 16
    timeout_s: float = 30.0  # a call past it is stopped (its worker killed) and ends the episode
    max_turns: int = 16  # model turns per episode
    # tokens of a whole episode, prompt included; 0: rollout.max_prompt_len +
    # rollout.max_new_tokens (each request's budget after its prompt is at most max_new_tokens)
    max_tokens: int = 0
    max_env_seconds: float = 300.0  # environment seconds per episode, all its calls together
    # the episode's reward: its step rewards summed, or the last one; "function": data.reward
    # scores the whole conversation's text instead
    reward: Literal["sum", "last", "function"] = "sum"

    def __post_init__(self):
        _check(
            self.spec is None or (isinstance(self.spec, str) and self.spec.strip() != ""),
            "spec",
            f"must be a built-in name, 'file.py:Class' or 'package.module:Class', or null, got "
            f"{self.spec!r}",
        )
        _check(
            isinstance(self.kwargs, dict) and all(isinstance(k, str) for k in self.kwargs),
            "kwargs",
            f"must be a mapping of argument names to values, got {self.kwargs!r}",
        )
        try:
            json.dumps(self.kwargs, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError("kwargs", f"must be plain JSON data ({e})") from None
        check_positive(self, "workers", "max_turns")
        _check(
            isinstance(self.max_workers, int) and self.max_workers >= 0,
            "max_workers",
            f"must be a whole number >= 0, got {self.max_workers!r}",
        )
        _check(
            self.timeout_s > 0 and math.isfinite(self.timeout_s),
            "timeout_s",
            f"must be > 0, got {self.timeout_s}",
        )
        _check(
            self.max_tokens == 0 or self.max_tokens >= 2,
            "max_tokens",
            f"must be >= 2, or 0 (rollout.max_prompt_len + rollout.max_new_tokens), got "
            f"{self.max_tokens}",
        )
        _check(
            self.max_env_seconds > 0 and math.isfinite(self.max_env_seconds),
            "max_env_seconds",
            f"must be > 0, got {self.max_env_seconds}",
        )
        _check(
            self.reward in ENV_REWARDS,
            "reward",
            f"must be one of {', '.join(ENV_REWARDS)}, got {self.reward!r}",
        )

    def resolved_max_tokens(self, max_prompt_len: int, max_new_tokens: int) -> int:
        """``max_tokens``, or ``max_prompt_len + max_new_tokens`` when it is 0."""
        return self.max_tokens or max_prompt_len + max_new_tokens


@dataclass(frozen=True)
class ExperimentConfig:
    """The whole experiment; written, resolved, next to every run."""

    seed: int = 0
    run_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self):
        seed_ok = isinstance(self.seed, int) and not isinstance(self.seed, bool)
        _check(
            seed_ok and 0 <= self.seed <= SEED_MAX,
            "seed",
            f"must be an integer in [0, 2**32 - 1 = {SEED_MAX}], got {self.seed!r}",
        )
        _check(
            self.model.attention != "cudnn" or self.train.packing == "rows",
            "model.attention",
            "cudnn takes one sequence per row (no packed segments), so it needs "
            f"train.packing=rows, got {self.train.packing!r}; use attention: blockwise for "
            "packed rows",
        )
        _check(
            not self.train.share_prompts or self.model.sliding_window is None,
            "train.share_prompts",
            "a sliding window counts positions in the row, and a shared prompt sits apart from "
            "its responses: set share_prompts: false for a model with model.sliding_window",
        )
        _check(
            not self.train.share_prompts or not self.model.is_moe,
            "train.share_prompts",
            "a mixture-of-experts policy's recorded routes are per sample: set share_prompts: "
            "false for it",
        )
        _check(
            self.env.max_tokens == 0 or self.env.max_tokens > self.rollout.max_prompt_len,
            "env.max_tokens",
            f"must be > rollout.max_prompt_len ({self.rollout.max_prompt_len}) so that a prompt "
            f"leaves room for the model, or 0, got {self.env.max_tokens}",
        )
        kv, tp = self.model.num_kv_heads, self.mesh.rollout.tp
        _check(
            kv % tp == 0,
            "mesh.rollout.tp",
            f"must divide model.num_kv_heads ({kv}) so KV pages shard over kv heads, got {tp}",
        )


def replace(cfg, **changes):
    """``dataclasses.replace`` that re-runs validation (frozen dataclasses re-check on init)."""
    return dataclasses.replace(cfg, **changes)
