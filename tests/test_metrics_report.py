"""Run reporting: metrics JSONL / TensorBoard, timeline PNG, run summary, reward curves."""

import json
import math
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from reliability_cases import expect  # tests/reliability_cases.py

from dora_jax import report
from dora_jax.config.schema import OrchestratorConfig
from dora_jax.curves import reward_curve_plot
from dora_jax.metrics import MetricsWriter, progress, read_metrics
from dora_jax.orchestrator import FakeBackendConfig, GroupTick, Records, run_fake
from dora_jax.orchestrator.backend import HOST_LEAVING
from dora_jax.orchestrator.records import StepRecord
from dora_jax.report import (
    phase_fractions,
    plot_timeline,
    tick_durations,
    write_summary,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BACKEND = FakeBackendConfig(
    num_groups=4,
    max_slots=4,
    max_prompt_len=64,
    max_new_tokens=400,
    length_median=20,
    length_p99_ratio=12,
    prefill_tokens_per_tick=32,
    weight_transfer_ticks=3,
    migrate_ticks=1,
    seed=1,
)


def _run(mode: str, steps: int = 8):
    cfg = OrchestratorConfig(
        mode=mode,
        staleness_k=2,
        train_batch_prompts=2,
        rollout_batch_prompts=4,
        plan_period_ticks=8,
    )
    return run_fake(cfg, 4, BACKEND, num_steps=steps, step_ticks=10, prompt_len=(8, 64)).result


@pytest.fixture(scope="module")
def dora():
    return _run("dora")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _tick(g: int, v: int, act: str, active: int = 0, tokens: int = 0) -> GroupTick:
    return GroupTick(g, v, act, active, tokens, 0, 0, 1.0)


def _tiny() -> Records:
    """2 groups x 10 ticks; steps cover ticks [2, 5) and [8, 12) (the last one runs past the end).

    tick:      0  1  2  3  4  5  6  7  8  9
    training:  .  .  T  T  T  .  .  .  T  T
    rolling:   R  R  R  R  .  .  .  R  R  R   (tick 6: a weight transfer only; 7: a waiting request)
    """
    rec = Records(mode="dora", num_groups=2, max_slots=4)
    acts = ["decode"] * 4 + ["idle", "idle", "idle", "idle", "decode", "decode"]
    for t, a in enumerate(acts):
        busy = a == "decode"
        g0 = _tick(0, 0 if t < 5 else 1, a, active=int(busy or t == 7), tokens=int(busy))
        g1 = _tick(1, 0 if t < 6 else 1, "transfer" if t == 6 else "idle")
        rec.groups.append((g0, g1))
    rec.steps = [StepRecord(2, 5, 1, 1, 0), StepRecord(8, 12, 2, 1, 0)]
    rec.transfers = [(5, 0, 1), (6, 1, 1)]
    rec.migrations = [(7, 2)]
    return rec


# -- metrics ---------------------------------------------------------------------------------------


def _tb_events(run_dir: Path) -> list:
    from tensorboardX.proto import event_pb2

    files = list((run_dir / "tb").rglob("events.out.tfevents*"))
    events = []
    for f in files:
        data, i = f.read_bytes(), 0
        while i < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (n,) = struct.unpack("<Q", data[i : i + 8])
            events.append(event_pb2.Event.FromString(data[i + 12 : i + 12 + n]))
            i += 12 + n + 4
    return events


def test_metrics_jsonl_round_trip_and_tensorboard(tmp_path):
    rows = [
        {"loss": 0.5, "reward": np.float32(0.25), "n": np.int64(3), "lens": [1, 2, 3]},
        {
            "loss": math.nan,
            "reward": math.inf,
            "n": 4,
            "lens": np.array([4.0, 5.0]),
            "opt": {"lr": 1e-3, "clip": -math.inf},
            "note": "ok",
        },
    ]
    with MetricsWriter(tmp_path, tensorboard=True) as w:
        assert w.tensorboard
        for step, m in enumerate(rows):
            w.write(step * 10, m)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    for line in lines:  # strict JSON: no NaN / Infinity tokens

        def bad(tok):
            raise AssertionError(f"non-standard JSON constant {tok}")

        json.loads(line, parse_constant=bad)
    assert json.loads(lines[1])["loss"] is None and json.loads(lines[1])["reward"] == "inf"
    back = read_metrics(tmp_path)
    assert [r["step"] for r in back] == [0, 10]
    assert back[0] == {"step": 0, "loss": 0.5, "reward": 0.25, "n": 3, "lens": [1, 2, 3]}
    assert type(back[0]["n"]) is int
    assert math.isnan(back[1]["loss"]) and back[1]["reward"] == math.inf
    assert back[1]["opt"] == {"lr": 1e-3, "clip": -math.inf} and back[1]["lens"] == [4.0, 5.0]
    assert back[1]["note"] == "ok"

    events = _tb_events(tmp_path)
    values = {(e.step, v.tag): v for e in events for v in e.summary.value}
    assert values[(0, "loss")].simple_value == 0.5 and values[(10, "opt/lr")].simple_value > 0
    assert math.isnan(values[(10, "loss")].simple_value)
    assert values[(0, "lens")].HasField("histo") and values[(0, "lens")].histo.num == 3
    assert (10, "note") not in values  # strings are JSONL-only


def test_a_tensorboard_write_that_fails_is_a_warning_and_the_jsonl_goes_on(
    tmp_path, monkeypatch, capsys
):
    """A full disk under the event file: one warning naming it, TensorBoard off from then on,
    every record still in metrics.jsonl, and nothing blocks (the writer has no thread to die)."""
    import errno

    from tensorboardX import record_writer

    w = MetricsWriter(tmp_path, tensorboard=True)
    w.write(1, {"loss": 0.5})

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    for step in range(2, 30):  # past any queue a writer thread would have held
        w.write(step, {"loss": 0.25, "lens": [1, 2]})
        w.write_text(step, "samples", "text")
    w.close()
    err = capsys.readouterr().err
    expect("tensorboard-write-fails", err)
    assert err.count("warning: TensorBoard events cannot be written to") == 1, err
    assert "No space left on device" in err and str(tmp_path / "metrics.jsonl") in err
    assert not w.tensorboard
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 30))


def test_a_wandb_log_that_fails_is_a_warning_and_the_run_goes_on(capsys):
    from dora_jax.wandb_log import WandbLog

    class Run:  # a W&B run whose service goes away at step 3
        def __init__(self):
            self.logged, self.finished = [], []

        def log(self, data, step):
            if step >= 3:
                raise ConnectionError("the wandb service is gone")
            self.logged.append(step)

        def finish(self, exit_code=0):
            self.finished.append(exit_code)

    log = WandbLog.__new__(WandbLog)  # (no wandb.init: the run is the fake above)
    run = log.run = Run()
    for step in range(1, 6):
        log.log(step, {"loss": 0.5})
    log.close()
    err = capsys.readouterr().err
    expect("wandb-log-fails", err)
    assert err.count("warning: W&B logging failed at step 3 (ConnectionError") == 1, err
    assert run.logged == [1, 2] and run.finished == [1]


def test_metrics_without_tensorboard_and_errors(tmp_path):
    w = MetricsWriter(tmp_path / "run", tensorboard=False)
    w.write(1, {"a": 1.0})
    with pytest.raises(ValueError, match="step"):
        w.write(2, {"step": 3})
    with pytest.raises(TypeError):
        w.write(2, {"a": object()})
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.write(3, {"a": 2.0})
    assert not (tmp_path / "run" / "tb").exists()
    # a torn last line (killed mid-write) is dropped; appending resumes the file
    path = tmp_path / "run" / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 2, "a"')
    assert read_metrics(path) == [{"step": 1, "a": 1.0}]
    path.write_text(path.read_text() + "\n" + '{"step": 3, "a": 3}\n')
    with pytest.raises(json.JSONDecodeError):  # a malformed line in the middle is an error
        read_metrics(path)
    bar = progress(10, "x", enabled=False)
    assert bar.disable
    bar.close()


# -- timeline --------------------------------------------------------------------------------------


def test_timeline_png(dora, tmp_path):
    rec = dora.records
    p = plot_timeline(rec, tmp_path / "timeline.png", title="dora fake")
    w, h = _png_size(p)
    assert w > 1000 and h > 250 and p.stat().st_size > 20_000
    secs = tick_durations(rec)
    assert len(secs) == len(rec.groups) and all(s > 0 for s in secs)
    p2 = plot_timeline(rec, tmp_path / "sub" / "timeline_s.png", tick_seconds=secs)
    assert _png_size(p2)[0] > 1000 and p2.stat().st_size > 20_000
    with pytest.raises(ValueError, match="tick_seconds"):
        plot_timeline(rec, tmp_path / "bad.png", tick_seconds=secs[:-1])
    p3 = plot_timeline(_tiny(), tmp_path / "tiny.png")
    assert _png_size(p3)[0] > 1000


def test_timeline_image_colours_and_downsampling():
    rec = _tiny()
    version, act, active = report._grid(rec)
    assert version.shape == (2, 10) and act.shape == (2, 10)
    img = report._image(version, act, active, np.arange(11.0), 10)
    c0, c1 = np.array(report.version_color(0)), np.array(report.version_color(1))
    assert np.allclose(img[0, 0], c0) and np.allclose(img[0, 9], c1)  # decode: full colour
    assert np.allclose(img[0, 4], report.IDLE_RGB)  # idle, no request
    assert np.allclose(img[0, 7], c1 * (1 - report.TINT) + report.TINT)  # waiting request: tint
    assert np.allclose(img[1, 6], report.TRANSFER_RGB)
    assert not np.allclose(c0, c1)
    # 10 ticks into 5 columns: each column is the mean of two ticks
    half = report._image(version, act, active, np.arange(11.0), 5)
    assert np.allclose(half[0, 1], c0) and np.allclose(half[0, 2], report.IDLE_RGB)
    assert np.allclose(half[1, 3], (report.TRANSFER_RGB + report.IDLE_RGB) / 2)  # ticks 6, 7
    # 3 columns of 10/3 ticks: column 1 is 2/3 tick of decode (tick 3) and 8/3 of idle
    third = report._image(version, act, active, np.arange(11.0), 3)
    assert np.allclose(third[0, 1], 0.2 * c0 + 0.8 * report.IDLE_RGB)
    # seconds: tick 0 lasts 9 s, the others 1/9 s: the first 9 of 10 columns are tick 0
    edges = np.concatenate([[0.0], np.cumsum([9.0] + [1 / 9] * 9)])
    long = report._image(version, act, active, edges, 10)
    assert np.allclose(long[0, :9], c0) and np.allclose(long[1, :9], report.IDLE_RGB)


# -- summary ---------------------------------------------------------------------------------------


def test_phase_fractions_on_hand_built_records():
    ph = phase_fractions(_tiny())
    assert ph == pytest.approx(
        {"rollout_only": 0.3, "overlap": 0.4, "train_only": 0.1, "neither": 0.2}
    )
    secs = [1.0] * 10
    secs[0], secs[6] = 11.0, 3.0  # tick 0 (rollout-only) lasts 11 s, tick 6 (transfer) 3 s
    ph = phase_fractions(_tiny(), tick_seconds=secs)
    assert ph == pytest.approx(
        {"rollout_only": 13 / 22, "overlap": 4 / 22, "train_only": 1 / 22, "neither": 4 / 22}
    )
    assert phase_fractions(_tiny(), end=4)["rollout_only"] == pytest.approx(0.5)  # ticks 0, 1


def test_write_summary_tiny(tmp_path):
    rec = _tiny()
    s = rec.summary()
    jpath, mpath = write_summary(tmp_path, summary=s, records=rec, rewards=[], wall_s=0.0)
    d = json.loads(jpath.read_text())
    assert d["rollout_only_frac"] == pytest.approx(0.3) and d["ticks"] == 10
    assert d["bubble"] == pytest.approx(s.bubble) and d["staleness_hist"] == {}
    assert d["throughput"]["traj_per_s"] is None  # wall_s = 0: n/a, written as null
    assert d["reward"]["start"] is None and "![timeline](timeline.png)" in mpath.read_text()


def test_groups_that_left_are_counted_apart_from_failures(tmp_path):
    """A group whose process was asked to stop (it handed its requests over) left; an engine or
    a process that died failed. summary.json counts them apart; only failures before the end."""
    rec = _tiny()
    rec.health = [
        (1, 0, "dead", "engine step failed: boom"),
        (3, 1, "dead", f"process 1 {HOST_LEAVING}signal 15): handing over"),
        (4, 1, "restarting", "process 1 is back"),
        (5, 0, "dead", "process 1 is gone: lifeline closed"),
        (11, 1, "dead", "engine step failed: after the end"),
    ]
    s = rec.summary()
    assert (s.group_failures, s.groups_left) == (2, 1)
    jpath, _ = write_summary(tmp_path, summary=s, records=rec, rewards=[], wall_s=0.0)
    d = json.loads(jpath.read_text())["summary"]
    assert (d["group_failures"], d["groups_left"]) == (2, 1)


def test_write_summary_agrees_with_summary(dora, tmp_path):
    s, rec = dora.summary, dora.records
    rewards = [(i, 0.1 * i) for i in range(8)] + [(8, math.nan)]
    overheads = {"weight_transfer_s": 0.5, "weight_transfers": 3, "migration_s": 0.25}
    jpath, mpath = write_summary(
        tmp_path,
        summary=s,
        records=rec,
        rewards=rewards,
        wall_s=10.0,
        overheads=overheads,
        extra={"seed": 1},
    )
    d = json.loads(jpath.read_text())
    assert d["mode"] == "dora" and d["bubble"] == s.bubble and d["summary"]["bubble"] == s.bubble
    th = d["throughput"]
    assert th["traj_per_tick"] == s.traj_per_tick and th["traj_per_s"] == s.trajectories / 10.0
    assert th["tokens_per_s"] == s.tokens / 10.0
    hist = {int(k): n for k, n in d["staleness_hist"].items()}
    assert sum(hist.values()) == s.trajectories and max(hist) == s.staleness_max
    assert hist == Counter(c.staleness for c in report.consumed_in(rec, s))
    assert sum(k * n for k, n in hist.items()) / s.trajectories == pytest.approx(s.staleness_mean)
    assert 0.0 <= d["rollout_only_frac"] <= 1.0
    assert sum(d["phases"].values()) == pytest.approx(1.0) and d["phases"]["overlap"] > 0
    assert d["migrated_requests"] == s.migrated > 0 and d["migration_events"] > 0
    assert d["weight_transfers"] == s.weight_transfers and d["discarded"] == s.discarded == 0
    assert d["reprefill_tokens"] == s.reprefill_tokens
    oh = d["overheads"]
    assert oh["weight_transfer_frac"] == 0.05 and oh["migration_frac"] == 0.025
    assert "weight_transfers_frac" not in oh and oh["weight_transfers"] == 3
    r = d["reward"]  # 8 finite points: the first / last fifth is 1 point (max(1, 8 // 5))
    assert r["n_avg"] == 1 and r["start"] == pytest.approx(0.0) and r["end"] == pytest.approx(0.7)
    assert r["curve"][-1][1] is None and d["extra"] == {"seed": 1}
    md = mpath.read_text()
    assert "![timeline](timeline.png)" in md and "| bubble (idle group time) |" in md
    assert f"{100 * s.bubble:.1f} %" in md and "rollout-only" in md
    # a summary over the first 4 steps counts only the trajectories those steps consumed
    s4 = rec.summary(4)
    jpath, _ = write_summary(tmp_path / "s4", summary=s4, records=rec, rewards=[], wall_s=1.0)
    d4 = json.loads(jpath.read_text())
    assert sum(d4["staleness_hist"].values()) == s4.trajectories < len(rec.consumed)
    assert d4["ticks"] == s4.ticks < len(rec.groups) and d4["bubble"] == s4.bubble


def test_sync_never_overlaps_and_partial_reprefills(tmp_path):
    sync = _run("sync", steps=4)
    ph = phase_fractions(sync.records, sync.summary.ticks)
    assert ph["overlap"] == 0.0 and ph["train_only"] > 0 and ph["rollout_only"] > 0.5
    partial = _run("partial", steps=4)
    jpath, _ = write_summary(
        tmp_path, summary=partial.summary, records=partial.records, rewards=[(0, 0.0)], wall_s=1.0
    )
    d = json.loads(jpath.read_text())
    assert d["reprefill_tokens"] == partial.summary.reprefill_tokens > 0
    assert d["reward"]["start"] == d["reward"]["end"] == 0.0


def test_reward_curve_plot(tmp_path):
    curves = {
        "dora": [(i * 64, 1 - math.exp(-i / 5)) for i in range(40)],
        "sync": [(i * 64, 1 - math.exp(-i / 6)) for i in range(40)] + [(41 * 64, math.nan)],
        "empty": [],
    }
    p = reward_curve_plot(curves, tmp_path / "curves" / "reward.png", title="convergence")
    w, h = _png_size(p)
    assert w > 500 and h > 300 and p.stat().st_size > 15_000


def test_seed_band_matches_numpy_and_plots(tmp_path):
    from dora_jax.curves import seed_band, seed_band_plot

    a = [(0, 0.2), (64, 0.4), (128, 0.5)]
    b = [(0, 0.3), (32, 0.1), (128, 0.9)]  # other x values: read at a's by linear interpolation
    c = [(128, 0.7), (0, 0.1), (64, 0.6)]  # unsorted
    xs, mean, se = seed_band([a, b, c])
    b_at = [0.3, 0.1 + (0.9 - 0.1) * (64 - 32) / (128 - 32), 0.9]
    ys = np.array([[0.2, 0.4, 0.5], b_at, [0.1, 0.6, 0.7]])
    np.testing.assert_allclose(xs, [0, 64, 128])
    np.testing.assert_allclose(mean, ys.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(se, ys.std(axis=0, ddof=1) / np.sqrt(3), rtol=1e-12)
    assert seed_band([a])[2] is None  # one seed: no error band
    p = seed_band_plot({"sync": [a, b, c], "dora": [a], "none": []}, tmp_path / "band.png")
    w, h = _png_size(p)
    assert w > 500 and h > 300


def test_head_keeps_only_the_first_ticks():
    from dora_jax.config.schema import OrchestratorConfig
    from dora_jax.orchestrator import FakeBackendConfig, run_fake
    from dora_jax.report import head

    rec = run_fake(
        OrchestratorConfig(mode="dora"),
        4,
        FakeBackendConfig(num_groups=4, max_slots=4),
        num_steps=6,
    ).result.records
    h = head(rec, 50)
    assert len(h.groups) == len(h.cluster) == 50 < len(rec.groups)
    assert all(t < 50 for t, *_ in h.transfers) and all(s.start < 50 for s in h.steps)
    assert all(c.tick < 50 for c in h.consumed) and len(h.consumed) < len(rec.consumed)


def test_lag_figures_one_per_lag_with_tokens():
    """The train step's per-lag arrays become ``lag/<k>/<name>`` figures for the lags that had
    tokens in the step; the arrays themselves leave the record."""
    from dora_jax.pipeline.observers import lag_figures

    m = {
        "loss": 0.5,
        "lag_tokens": [10.0, 0.0, 4.0],
        "lag_ess": [1.0, 0.0, 0.75],
        "lag_clip_frac": [0.0, 0.0, 0.25],
        "lag_kl": [1e-7, 0.0, 0.02],
    }
    assert lag_figures(m) == {
        "loss": 0.5,
        "lag/0/tokens": 10.0,
        "lag/0/ess": 1.0,
        "lag/0/clip_frac": 0.0,
        "lag/0/kl": 1e-7,
        "lag/2/tokens": 4.0,
        "lag/2/ess": 0.75,
        "lag/2/clip_frac": 0.25,
        "lag/2/kl": 0.02,
    }
    assert lag_figures({"loss": 1.0}) == {"loss": 1.0}  # a step without them (a fake trainer)
