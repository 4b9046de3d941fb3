"""The simulator's prediction of a real multi-turn run on this machine: the CPU preset with the
conversations a run measured.

    python benchmarks/sim_agentic_cpu.py CONVERSATIONS.jsonl [--latency 0.1] [--sigma 1.0]
        [--modes sync,partial,dora] [--steps 40] [--seed 0] [--train-step-s S]
        [--env-workers N] [--parallel-groups] [--json OUT]
    python benchmarks/sim_agentic_cpu.py OUT.jsonl --synthesize 64 [...]   # ideal play first

:func:`predict` reads a run's ``conversations.jsonl`` (one JSON object per consumed
conversation: ``turns``, ``model_tokens``, ``env_tokens``, ``env_seconds``, ``prompt_tokens``,
``model_turn_tokens``, as ``benchmarks/wallclock_driver.py`` writes them for a multi-turn run),
builds a simulator config from the CPU preset (``configs/sim/cpu_default_task.yaml``: the
measured engine and trainer constants of ``benchmarks/results/calibrate_cpu.json``) and the
settings of the recipe the real run used (``configs/recipes/tool-arithmetic-cpu.yaml``: slots,
pages, prompt and response budgets, TBS, RBS, G, K, the environment's workers, timeout and
turn limit), runs each mode disaggregated as in the real two-process arrangement (the trainer
on one core, the four rollout groups sharing the other: ``cluster.shared_rollout_device``), and
returns the model tokens of the consumed conversations per modeled second.

How the measured conversations become the simulator's workload (see "Where the fit is
approximate" below):

- **turns per conversation**: the measured counts themselves (``turns.kind: file``: their own
  distribution, drawn by quantile), capped at the recipe's ``env.max_turns``; the share of
  their variance shared by a prompt group's ``G`` members (``turns.prompt_corr``) is estimated
  from the file, whose lines come prompt group by prompt group (``G`` consecutive lines each,
  the order in which the trainer consumed them), as the intra-class correlation of the turns'
  normal scores;
- **model tokens per turn**: every measured model turn's length (``response.kind: file``), one
  distribution for every turn, independent of the problem (``response.prompt_corr: 0``);
- **observation tokens per environment turn**: log-normal, its shape from the spread of the
  conversations' observation tokens, its median solved so that the simulator's mean (rounded,
  at least 1) equals the measured tokens per observation (:func:`fit_observations`);
- **tool latency**: log-normal of median ``latency_median_s`` and ``p99_ratio = exp(2.326 *
  latency_sigma)``, capped at ``env.timeout_s``, the same for every member of a prompt group at
  a given call (the built-in tool's latency is a pure function of the seed, the problem and the
  call's number), on ``env.workers`` environment workers that each run one call at a time;
- **prompt tokens**: log-normal of the measured median and p99, clipped to
  ``[1, max_prompt_len]``; a conversation's model and observation tokens stop at
  ``max_new_tokens``.

KV: the recipe's ``num_pages`` give each group ``(num_pages - 1) * page_size`` tokens, and the
real engine admits while slots allow and the prompt's pages fit (it parks past capacity), so a
request reserves only its prompt's pages at admission (``kv_admit_reserve_tokens``).

Where the fit is approximate, and what the simulator does not mirror:

- **The four rollout groups share one core** in the real arrangement (process 1 is pinned to
  it): the simulator divides each 10 ms tick among the groups with work by what each has left
  (``shared_core=False`` runs them in parallel instead); the real threads interleave at finer
  grain, and the core also runs process 1's share of weight and KV transfers and its Python
  (a calibration with ``weight_trip_s`` and ``engine_call_overhead_s``, as
  ``bench_regime.py`` measures them, charges the weights' trip and the Python per engine call).
  ``rollout_core_load`` is the share of the window the groups kept the core busy.
- **The constants** were measured in one process on both cores (``calibrate_cpu.py``), at the
  default task's sequences: an engine step pinned to one core, and a train step on the
  two-process arrangement (gloo collectives over loopback) at the recipe's longer sequences,
  differ (``train_step_s`` replaces the train step, e.g. with the real runs' median one; the
  engine steps are taken as measured).
- **Turn positions**: every model turn's length is drawn from the pooled per-turn lengths,
  while a real conversation's calls are long (``<call>23-5</call>``) and its final answer
  short (``#3``): the mean model tokens per conversation match, their spread and order do not.
- **Prompt groups**: a real group's members share one problem (its number of steps) and choose
  between calling the tool and answering bare each on its own; the simulator draws each
  member's turns from the measured distribution through a normal shared in part by the group,
  which matches the measured within-group correlation in that one figure only.
- **The control plane's round trips**: a turn's end and its tool's answer cross between the
  two processes in the real run; the simulator hands them over at its tick (10 ms) boundaries.
- Worker assignment by live conversations is the real pool's rule; the real pool also spends a
  little time on each episode's first call (its replay), which is not modeled.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import quiet  # noqa: E402

from dora_jax.config import load_config  # noqa: E402
from dora_jax.config.loading import to_dict  # noqa: E402
from dora_jax.sim.backend import CATEGORIES  # noqa: E402
from dora_jax.sim.config import load_sim_config  # noqa: E402
from dora_jax.sim.conversations import US, Conversations, conversation_stats  # noqa: E402
from dora_jax.sim.run import simulate  # noqa: E402
from dora_jax.sim.workload import Z99, ResponseLengths  # noqa: E402

PRESET = ROOT / "configs" / "sim" / "cpu_default_task.yaml"
RECIPE = ROOT / "configs" / "recipes" / "tool-arithmetic-cpu.yaml"
FIELDS = (
    "turns",
    "model_tokens",
    "env_tokens",
    "env_seconds",
    "prompt_tokens",
    "model_turn_tokens",
)
BUSY = ("transfer", "migrate", "prefill", "reprefill", "decode")


# -- the measured conversations ------------------------------------------------------------------


def read_conversations(path: Path) -> list[dict]:
    """The rows of a ``conversations.jsonl``, checked (every field present, counts >= 0)."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e})") from None
        missing = [f for f in FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}:{i}: missing {', '.join(missing)}")
        turns = row["model_turn_tokens"]
        if not (isinstance(turns, list) and all(isinstance(t, int) and t > 0 for t in turns)):
            raise ValueError(f"{path}:{i}: model_turn_tokens must be a list of counts > 0")
        if int(row["turns"]) < 1 or int(row["prompt_tokens"]) < 1 or int(row["env_tokens"]) < 0:
            raise ValueError(f"{path}:{i}: needs turns >= 1, prompt_tokens >= 1, env_tokens >= 0")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no conversations")
    return rows


def _normal_scores(x: np.ndarray) -> np.ndarray:
    """Standard normal scores of ``x``'s mid-ranks (ties share their mean rank)."""
    nd = statistics.NormalDist()
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):  # ties: the mean of their ranks
        sel = x == v
        ranks[sel] = ranks[sel].mean()
    return np.array([nd.inv_cdf((r - 0.5) / len(x)) for r in ranks])


def group_correlation(turns: np.ndarray, group_size: int) -> float | None:
    """The intra-class correlation (one-way ANOVA) of the turns' normal scores over consecutive
    blocks of ``group_size``, clipped to [0, 1]; None when the rows are not whole groups (fewer
    than 4) or have no spread."""
    k = group_size
    if k < 2 or len(turns) % k or len(turns) // k < 4 or np.all(turns == turns[0]):
        return None
    z = _normal_scores(turns.astype(np.float64)).reshape(-1, k)
    n = z.shape[0]
    means = z.mean(axis=1)
    msb = k * ((means - z.mean()) ** 2).sum() / (n - 1)
    msw = ((z - means[:, None]) ** 2).sum() / (n * (k - 1))
    icc = (msb - msw) / (msb + (k - 1) * msw) if msb + (k - 1) * msw > 0 else 0.0
    return float(min(1.0, max(0.0, icc)))


def _discrete_mean(median: float, sigma: float, cap: int) -> float:
    """Mean of ``clip(rint(median * exp(sigma z)), 1, cap)``, ``z`` standard normal (the
    simulator's observation tokens), by quadrature over 2,000 quantiles."""
    nd = statistics.NormalDist()
    z = np.array([nd.inv_cdf((i + 0.5) / 2000) for i in range(2000)])
    return float(np.clip(np.rint(median * np.exp(sigma * z)), 1, cap).mean())


def fit_observations(rows: list[dict], cap: int) -> dict:
    """Log-normal observation tokens (see the module docstring): ``median``, ``p99_ratio`` and
    what they came from. A conversation of ``k`` environment turns (``turns - 1``) holding ``T``
    observation tokens gives the mean ``mu = sum T / sum k`` and, taking its observations as
    independent, the variance ``mean((T - k mu)^2 / k)``; the log-normal's shape is the one of
    that coefficient of variation, at least 0.05 and widened until the rounded, clipped draws can
    reach ``mu`` (a few tokens per observation are far from continuous); its median is solved
    for the mean."""
    k = np.array([int(r["turns"]) - 1 for r in rows], np.float64)
    t = np.array([int(r["env_tokens"]) for r in rows], np.float64)
    some = k > 0
    if not some.any() or t[some].sum() <= 0:
        return {
            "median": 1.0,
            "p99_ratio": 1.0,
            "measured_mean": 0.0,
            "observations": 0,
            "measured_cv": 0.0,
            "sigma": 0.0,
            "simulated_mean": 1.0,
        }
    mu = float(t[some].sum() / k[some].sum())
    var = float(np.mean((t[some] - k[some] * mu) ** 2 / k[some]))
    cv = math.sqrt(var) / mu
    sigma = max(0.05, math.sqrt(math.log1p(cv * cv)))
    while True:
        lo, hi = math.log(0.05), math.log(cap)
        for _ in range(60):  # the simulated mean grows with the median: bisect on its log
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _discrete_mean(math.exp(mid), sigma, cap) < mu else (lo, mid)
        got = _discrete_mean(math.exp(hi), sigma, cap)
        if abs(got / mu - 1) <= 0.01 or sigma >= 2.0:
            break
        sigma *= 1.25
    return {
        "median": math.exp(hi),
        "p99_ratio": math.exp(Z99 * sigma),
        "measured_mean": mu,
        "observations": int(k[some].sum()),
        "measured_cv": cv,
        "sigma": sigma,
        "simulated_mean": got,
    }


def measured_figures(rows: list[dict]) -> dict:
    """Per conversation: turns, model / observation / prompt tokens, environment seconds
    (median, p99, mean, max), and per model turn its tokens."""

    def stat(x) -> dict:
        x = np.asarray(x, np.float64)
        return {
            "median": float(np.median(x)),
            "p99": float(np.percentile(x, 99)),
            "mean": float(x.mean()),
            "max": float(x.max()),
        }

    per_turn = [t for r in rows for t in r["model_turn_tokens"]]
    return {
        "conversations": len(rows),
        "turns": stat([r["turns"] for r in rows]),
        "model_tokens": stat([r["model_tokens"] for r in rows]),
        "observation_tokens": stat([r["env_tokens"] for r in rows]),
        "prompt_tokens": stat([r["prompt_tokens"] for r in rows]),
        "env_s": stat([r["env_seconds"] for r in rows]),
        "model_turn_tokens": stat(per_turn),
        "turn_lists_disagreeing": sum(
            len(r["model_turn_tokens"]) != r["turns"]
            or sum(r["model_turn_tokens"]) != r["model_tokens"]
            for r in rows
        ),
    }


# -- the simulator's config ----------------------------------------------------------------------


def build_overrides(
    rows: list[dict],
    latency_median_s: float,
    latency_sigma: float,
    workdir: Path,
    *,
    modes,
    steps: int,
    seed: int,
    recipe: Path = RECIPE,
    train_step_s: float | None = None,
    env_workers: int | None = None,
    turns_prompt_corr: float | None = None,
    shared_core: bool = True,
    recipe_overrides: Sequence[str] = (),
    calibration: Path | None = None,
) -> tuple[list[str], dict]:
    """The overrides of the CPU preset that give the measured workload (files written to
    ``workdir``), and the fitted figures."""
    rc = load_config(recipe, list(recipe_overrides))
    r, o, env = rc.rollout, rc.orchestrator, rc.env
    if rc.mesh.rollout.tp != 1:
        raise ValueError(f"{recipe}: the CPU preset has one device per rollout group")
    preset = load_sim_config(PRESET)
    calib_path = Path(calibration or preset.calibration_path())
    calib = json.loads(calib_path.read_text())
    c = calib["constants"]
    c["kv_capacity_tokens"] = (r.num_pages - 1) * r.page_size  # page 0 is reserved
    c["max_slots"] = r.max_slots
    if c["decode_steps_per_call"] != r.decode_steps or c["prefill_chunk_tokens"] != r.prefill_chunk:
        raise ValueError(f"{recipe}: decode_steps / prefill_chunk differ from the calibration's")
    if train_step_s is not None:
        c["train_step_s"] = float(train_step_s)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "calibration.json").write_text(json.dumps(calib, indent=2) + "\n")
    per_turn = [t for row in rows for t in row["model_turn_tokens"]]
    (workdir / "model_turn_tokens.txt").write_text(
        "# every measured model turn's tokens\n" + "\n".join(map(str, per_turn)) + "\n"
    )
    turns = np.array([int(row["turns"]) for row in rows])
    (workdir / "turns.txt").write_text(
        "# measured model turns per conversation\n" + "\n".join(map(str, turns)) + "\n"
    )
    G = rc.train.group_size
    estimated = group_correlation(turns, G)
    corr = turns_prompt_corr if turns_prompt_corr is not None else estimated
    corr = 0.5 if corr is None else corr
    # single-turn rows (every conversation one model turn): the lengths of a prompt group's
    # responses are what is correlated, estimated the same way
    single = bool((turns == 1).all())
    length_corr = 0.0
    if single:
        lengths = np.array([int(row["model_tokens"]) for row in rows])
        length_corr = group_correlation(lengths, G)
        length_corr = 0.5 if length_corr is None else length_corr
    obs = fit_observations(rows, r.max_new_tokens)
    plens = sorted(int(row["prompt_tokens"]) for row in rows)
    pmed = statistics.median(plens)
    p99 = plens[min(len(plens) - 1, int(0.99 * len(plens)))]
    workers = env.workers if env_workers is None else env_workers
    groups = rc.mesh.rollout.groups
    trainer_devices = preset.cluster.trainer_gpus
    reserve = r.page_size * -(-(r.max_prompt_len + 1) // r.page_size)  # a prompt's pages
    overrides = [
        f"calibration={workdir / 'calibration.json'}",
        f"cluster.total_gpus={trainer_devices + groups}",
        f"cluster.max_slots={r.max_slots}",
        f"cluster.page_size={r.page_size}",
        f"cluster.shared_rollout_device={'true' if shared_core else 'false'}",
        f"orchestration.staleness_k={o.staleness_k}",
        f"orchestration.train_batch_prompts={o.train_batch_prompts}",
        f"orchestration.rollout_batch_prompts={o.rollout_batch_prompts}",
        f"orchestration.group_size={G}",
        "orchestration.kv_admit_watermark=1.0",
        f"orchestration.kv_admit_reserve_tokens={reserve}",
        "response.kind=file",
        f"response.path={workdir / 'model_turn_tokens.txt'}",
        f"response.max_tokens={r.max_new_tokens}",
        f"response.prompt_corr={length_corr}",
        f"prompt.median={pmed}",
        f"prompt.p99_ratio={max(1.0, p99 / pmed)}",
        "prompt.min_tokens=1",
        f"prompt.max_tokens={r.max_prompt_len}",
        "turns.kind=file",
        f"turns.path={workdir / 'turns.txt'}",
        f"turns.max_turns={max(env.max_turns, int(turns.max()))}",
        f"turns.prompt_corr={corr}",
        f"turns.max_total_tokens={r.max_new_tokens}",
        f"turns.observation.median={obs['median']}",
        f"turns.observation.p99_ratio={obs['p99_ratio']}",
        f"turns.observation.max_tokens={r.max_new_tokens}",
        "turns.latency.kind=lognormal",
        f"turns.latency.median_s={max(latency_median_s, 1e-6)}",
        f"turns.latency.p99_ratio={math.exp(Z99 * latency_sigma)}",
        f"turns.latency.max_s={env.timeout_s}",
        "turns.latency.per_prompt=true",
        f"turns.latency.workers={workers}",
        f"run.steps={steps}",
        f"run.warmup_steps={min(5, steps - 1)}",
        f"run.seed={seed}",
        f"run.modes=[{','.join(modes)}]",
        "run.colocated=[]",
    ]
    fit = {
        "recipe": quiet.rel(recipe),
        "turns_prompt_corr": corr,
        "turns_prompt_corr_estimated": estimated,
        "response_prompt_corr": length_corr,
        "observation": obs,
        "prompt": {"median": pmed, "p99": p99},
        "latency": {
            "median_s": latency_median_s,
            "sigma": latency_sigma,
            "p99_ratio": math.exp(Z99 * latency_sigma),
            "workers": workers,
            "max_s": env.timeout_s,
        },
        "kv_capacity_tokens": c["kv_capacity_tokens"],
        "kv_admit_reserve_tokens": reserve,
        "train_step_s": c["train_step_s"],
        "train_step_s_from": "given" if train_step_s is not None else quiet.rel(calib_path),
        "calibration": quiet.rel(calib_path),
    }
    return overrides, fit


# -- the prediction ------------------------------------------------------------------------------


def _window_figures(run) -> dict:
    """What :class:`~dora_jax.sim.run.SimMetrics` leaves out, over the same window: how much of
    one core the rollout groups used, and the environment workers' load and queue."""
    cfg, rec, be = run.cfg, run.result.records, run.backend
    w, n = cfg.run.warmup_steps, min(cfg.run.steps, len(rec.steps))
    t0, t1 = (rec.steps[w - 1].end if w else 0), rec.steps[n - 1].end
    span = (t1 - t0) * cfg.run.tick_s
    secs = dict(zip(CATEGORIES, np.sum(be.seconds[t0:t1], axis=0).tolist(), strict=True))
    out = {"rollout_core_load": sum(secs[k] for k in BUSY) / span if span else 0.0}
    if be.waiting.workers:
        a, b = t0 * cfg.run.tick_s * US, t1 * cfg.run.tick_s * US
        calls = [(s, e, q) for _, s, e, q in be.waiting.env_calls if a <= s < b]
        busy = sum(min(e, b) - s for s, e, _ in calls)
        out["env_worker_load"] = busy / (be.waiting.workers * (b - a)) if b > a else 0.0
        out["env_queue_s_mean"] = float(np.mean([q for *_, q in calls]) / US) if calls else 0.0
        out["env_calls"] = len(calls)
    return out


def predict(
    conversations_path: Path,
    latency_median_s: float,
    latency_sigma: float,
    modes=("sync", "partial", "dora"),
    steps: int = 40,
    seed: int = 0,
    *,
    recipe: Path = RECIPE,
    train_step_s: float | None = None,
    env_workers: int | None = None,
    turns_prompt_corr: float | None = None,
    shared_core: bool = True,
    workdir: Path | None = None,
    recipe_overrides: Sequence[str] = (),
    calibration: Path | None = None,
) -> dict:
    """The simulator's model tokens per modeled second of consumed conversations, per mode, for
    the workload of ``conversations_path`` with tools of lognormal latency (median
    ``latency_median_s`` seconds, shape ``latency_sigma``); see the module docstring.

    ``train_step_s``: the train step's seconds (default: the CPU preset's measured one);
    ``env_workers``: environment workers (default: the recipe's ``env.workers``; 0: as many as
    calls); ``turns_prompt_corr``: instead of the one estimated from the file;
    ``shared_core``: the rollout groups share one core (False: each runs on its own);
    ``workdir``: where the derived files go (default: a temporary directory, removed);
    ``recipe_overrides``: config overrides of the recipe the real runs used (its slots, pages,
    prompt groups in flight: ``orchestrator.rollout_batch_prompts=32``);
    ``calibration``: the measured constants (default: the CPU preset's,
    ``benchmarks/results/calibrate_cpu.json``; ``benchmarks/calibrate_cpu.py --skip-runs --out``
    writes others, for example in a process pinned to one core as the rollout groups are).

    Returns ``model_tokens_per_s`` (mode -> figure), ``dora_over_sync`` and
    ``dora_over_partial`` (None without both modes), ``modes`` (mode -> the run's figures:
    step time, trajectories and tokens per second, bubble, the trainer's waiting share, the
    conversation figures, ``rollout_core_load``, the environment workers' load and queue),
    ``config`` (the simulator config used, as a dict), ``workload`` (``measured``: the file's
    figures; ``simulated``: the simulator's conversations, 8 batches; ``fit``: the fitted
    figures) and ``inputs``."""
    rows = read_conversations(Path(conversations_path))
    modes = tuple(modes)
    with tempfile.TemporaryDirectory(prefix="sim_agentic_cpu_") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        overrides, fit = build_overrides(
            rows,
            latency_median_s,
            latency_sigma,
            work,
            modes=modes,
            steps=steps,
            seed=seed,
            recipe=recipe,
            train_step_s=train_step_s,
            env_workers=env_workers,
            turns_prompt_corr=turns_prompt_corr,
            shared_core=shared_core,
            recipe_overrides=recipe_overrides,
            calibration=calibration,
        )
        cfg = load_sim_config(PRESET, overrides)
        o = cfg.orchestration
        conv = Conversations(
            cfg.turns, ResponseLengths(cfg.response, o.group_size, cfg.run.seed), cfg.run.seed
        )
        simulated = conversation_stats(conv, o.train_batch_prompts)
        per_mode = {}
        for mode in modes:
            run = simulate(cfg, mode, "disaggregated")
            m = run.metrics
            c = m.conversations
            per_mode[mode] = {
                "model_tokens_per_s": c.model_tokens_per_s,
                "trajectories_per_s": m.trajectories_per_s,
                "tokens_per_s": m.tokens_per_s,
                "step_s": m.step_s,
                "train_s": m.train_s,
                "trainer_waiting_frac": m.rollout_only_frac,
                "bubble": m.bubble,
                "env_wait_frac": c.env_wait_frac,
                "reprefill_frac": m.reprefill_frac,
                "staleness_mean": m.staleness_mean,
                "turns_mean": c.turns_mean,
                "model_tokens_mean": c.model_tokens_mean,
                "observation_tokens_mean": c.observation_tokens_mean,
                "env_s_mean": c.env_s_mean,
                "waiting_mean": c.waiting_mean,
                "migrated": m.migrated,
                "steps": m.steps,
                "ticks": m.ticks,
                "host_wall_s": m.wall_s,
                **_window_figures(run),
            }
        config = to_dict(cfg)
    rate = {m: v["model_tokens_per_s"] for m, v in per_mode.items()}

    def ratio(a: str, b: str) -> float | None:
        return rate[a] / rate[b] if a in rate and b in rate and rate[b] > 0 else None

    return {
        "model_tokens_per_s": rate,
        "dora_over_sync": ratio("dora", "sync"),
        "dora_over_partial": ratio("dora", "partial"),
        "modes": per_mode,
        "config": config,
        "workload": {"measured": measured_figures(rows), "simulated": simulated, "fit": fit},
        "inputs": {
            "conversations": str(conversations_path),
            "latency_median_s": latency_median_s,
            "latency_sigma": latency_sigma,
            "modes": list(modes),
            "steps": steps,
            "seed": seed,
            "preset": quiet.rel(PRESET),
        },
        "units": "modeled seconds; model_tokens_per_s: model tokens (tool answers left out) of "
        "the consumed conversations per modeled second, over steps warmup+1..steps; "
        "rollout_core_load: the rollout groups' busy seconds per second (the share of the one "
        "core they share in the real arrangement); env_worker_load: the environment "
        "workers' busy share; env_queue_s_mean: seconds a call waited for its worker",
    }


# -- a synthetic run: the teacher's ideal play ---------------------------------------------------


def synthesize(
    path: Path,
    groups: int = 64,
    *,
    seed: int = 0,
    latency_median_s: float = 0.1,
    latency_sigma: float = 1.0,
    direct_frac: float = 0.5,
    recipe: Path = RECIPE,
) -> Path:
    """Write ``groups`` prompt groups of ``G`` conversations of the recipe's ``tool_arithmetic``
    played ideally (``ideal_actions``: one call per step, then ``#`` and the remainder), each
    member answering bare instead with probability ``direct_frac``, counted in the built-in
    character tokenizer's tokens (one per character; a final answer ends with EOS, a call with
    its stop string), with the tool's own latency draws; in ``conversations.jsonl``'s format,
    prompt group by prompt group."""
    from dora_jax.envs.builtin.calculator import ToolArithmetic, calculate

    rc = load_config(recipe, [])
    if rc.env.spec != "tool_arithmetic":
        raise ValueError(f"{recipe}: env.spec is {rc.env.spec!r}, not tool_arithmetic")
    kw = {k: v for k, v in rc.env.kwargs.items() if not k.startswith("latency")}
    env = ToolArithmetic(**kw)
    budget, G = rc.rollout.max_new_tokens, rc.train.group_size
    lines = []
    for p in range(groups):
        n, s, _ = env.numbers(seed, p)
        ideal = env.ideal_actions(seed, p)
        for j in range(G):
            direct = np.random.default_rng((seed, p, j, 1)).random() < direct_frac
            actions = ideal[-1:] if direct else ideal
            used, model, env_tokens, secs, calls = 0, [], 0, 0.0, 0
            for a in actions:
                call = a.startswith("<call>")
                t = min(len(a) + (0 if call else 1), budget - used)  # EOS ends a final answer
                model.append(t)
                used += t
                if not call or used >= budget:
                    break
                calls += 1
                rng = np.random.default_rng((seed, p, calls, 7))  # the tool's own draw
                secs += latency_median_s * float(np.exp(latency_sigma * rng.standard_normal()))
                answer = len(calculate(a[len("<call>") : -len("</call>")]))
                if used + answer >= budget:
                    break
                used += answer
                env_tokens += answer
            lines.append(
                json.dumps(
                    {
                        "turns": len(model),
                        "model_tokens": sum(model),
                        "env_tokens": env_tokens,
                        "env_seconds": secs,
                        "prompt_tokens": len(f"{n}-{s}="),
                        "model_turn_tokens": model,
                    }
                )
            )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("conversations", type=Path, help="a run's conversations.jsonl")
    p.add_argument("--latency", type=float, default=0.1, help="median seconds of a tool call")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal shape of the latency")
    p.add_argument("--modes", default="sync,partial,dora")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-step-s", type=float, help="instead of the preset's train step")
    p.add_argument("--env-workers", type=int, help="instead of the recipe's env.workers")
    p.add_argument(
        "--parallel-groups",
        action="store_true",
        help="each rollout group on its own core (the real ones share one)",
    )
    p.add_argument(
        "--synthesize",
        type=int,
        metavar="GROUPS",
        help="first write GROUPS prompt groups of the ideal play to CONVERSATIONS",
    )
    p.add_argument("--json", type=Path, help="write the prediction there")
    p.add_argument("overrides", nargs="*", help="config overrides of the recipe the runs used")
    a = p.parse_intermixed_args(argv)
    if a.synthesize:
        synthesize(
            a.conversations,
            a.synthesize,
            seed=a.seed,
            latency_median_s=a.latency,
            latency_sigma=a.sigma,
        )
        print(f"wrote {a.synthesize} prompt groups of ideal play to {a.conversations}")
    res = predict(
        a.conversations,
        a.latency,
        a.sigma,
        tuple(a.modes.split(",")),
        a.steps,
        a.seed,
        train_step_s=a.train_step_s,
        env_workers=a.env_workers,
        shared_core=not a.parallel_groups,
        recipe_overrides=a.overrides,
    )
    w, fit = res["workload"], res["workload"]["fit"]
    meas, sim = w["measured"], w["simulated"]
    print(
        f"{meas['conversations']} conversations: turns mean {meas['turns']['mean']:.2f} "
        f"(simulated {sim['turns']['mean']:.2f}), p99 {meas['turns']['p99']:.0f} "
        f"({sim['turns']['p99']:.0f}); model tokens mean {meas['model_tokens']['mean']:.1f} "
        f"({sim['model_tokens']['mean']:.1f}); observation tokens mean "
        f"{meas['observation_tokens']['mean']:.2f} ({sim['observation_tokens']['mean']:.2f}); "
        f"turns' group correlation {fit['turns_prompt_corr']:.2f}; tools median "
        f"{a.latency} s, p99/median {fit['latency']['p99_ratio']:.1f}, "
        f"{fit['latency']['workers']} workers; train step "
        f"{fit['train_step_s']:.3f} s"
    )
    print(
        f"{'mode':<8} {'model tok/s':>11} {'traj/s':>7} {'step s':>7} {'tr wait':>7} "
        f"{'bubble':>6} {'env idle':>8} {'core':>5} {'workers':>7} {'queue s':>7} "
        f"{'turns':>5} {'stale':>5}"
    )
    for mode, f in res["modes"].items():
        print(
            f"{mode:<8} {f['model_tokens_per_s']:>11.1f} {f['trajectories_per_s']:>7.2f} "
            f"{f['step_s']:>7.3f} {f['trainer_waiting_frac']:>7.2f} {f['bubble']:>6.2f} "
            f"{f['env_wait_frac']:>8.3f} {f['rollout_core_load']:>5.2f} "
            f"{f.get('env_worker_load', 0):>7.2f} {f.get('env_queue_s_mean', 0):>7.3f} "
            f"{f['turns_mean']:>5.2f} {f['staleness_mean']:>5.2f}"
        )
    for k in ("dora_over_sync", "dora_over_partial"):
        if res[k] is not None:
            print(f"{k}: {res[k]:.2f}x")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=2, default=float) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
