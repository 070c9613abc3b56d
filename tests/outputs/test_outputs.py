"""What a run shows: the progress bar (zero-column terminals, the initial AUC), grouped metric names, TensorBoard
tags, and the zoom of the AUC figures."""

from __future__ import annotations

import io
import os
import select
import sys

import numpy as np
import pytest

from fdam_ray.core.state import RoundPlan
from fdam_ray.outputs import Progress, RunStart, grouped_name, grouped_scalars, progress, scalars

RECORD = {"iteration": 40, "round": 4, "stage": 2, "lr": 0.05, "train_loss": 0.25, "test_auc": 0.8,
          "test_samples": 100, "task_auc": {"Edema": 0.7, "Atelectasis": None, "Cardiomegaly": 0.9},
          "client_auc": {"0": 0.85, "1": 0.6, "2": None}, "bytes_up": 1000, "bytes_down": 2000, "wall_s": 3.5,
          "samples_per_s": None}


def test_scalars_are_the_records_numbers_plus_the_worst_task_and_client():
    s = scalars(RECORD)
    assert s["task_auc.Edema"] == 0.7 and s["client_auc.1"] == 0.6 and s["bytes_up"] == 1000
    assert "task_auc.Atelectasis" not in s and "samples_per_s" not in s  # undefined values are left out
    assert s["worst_task_auc"] == 0.7 and s["worst_client_auc"] == 0.6
    assert "worst_client_auc" not in scalars({"iteration": 0, "test_auc": 0.5})


def test_grouped_names_put_aucs_communication_and_training_apart():
    g = grouped_scalars(RECORD)
    assert g == {"train/round": 4, "train/stage": 2, "train/lr": 0.05, "train/loss": 0.25, "auc/test": 0.8,
                 "auc/test_samples": 100, "auc/task/Edema": 0.7, "auc/task/Cardiomegaly": 0.9, "auc/client/0": 0.85,
                 "auc/client/1": 0.6, "comm/bytes_up": 1000, "comm/bytes_down": 2000, "train/wall_s": 3.5,
                 "auc/worst_task": 0.7, "auc/worst_client": 0.6}
    assert grouped_name("task_auc.Pleural Effusion") == "auc/task/Pleural Effusion"


def test_tensorboard_tags_are_grouped(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fdam_ray.assembly.recipe import run
    from fdam_ray.config import build_config

    r = run(build_config(dataset="synthetic", model="mlp", model_width=8, num_clients=2, samples_per_client=60,
                         local_steps=3, iterations=9, eval_every=3, executor="inline", out_dir=str(tmp_path),
                         run_name="tb", tensorboard=True))
    events = EventAccumulator(str(r.run_dir / "events"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"auc/test", "auc/client/0", "auc/client/1", "auc/worst_client", "comm/bytes_up", "comm/bytes_down",
            "train/loss", "train/lr"} <= tags
    assert all(t.split("/")[0] in ("auc", "comm", "train") for t in tags), tags
    assert [e.step for e in events.Scalars("auc/test")] == [h["iteration"] for h in r.history]
    assert [e.value for e in events.Scalars("auc/test")] == pytest.approx([h["test_auc"] for h in r.history])


def plan(round_, steps=2):
    return RoundPlan(round=round_, stage=1, steps=steps, lr=0.1, iteration=(round_ - 1) * steps)


def test_progress_shows_the_initial_auc_before_the_first_evaluated_round():
    bar = Progress(file=io.StringIO())
    bar.start(RunStart(resumed=False, history=[], round=0, iteration=0, iterations=6))
    bar.record({"test_auc": 0.3125}, dict)
    bar.round_end(plan(1), None, dict)  # round 1 is not evaluated
    assert "auc=0.3125" in bar.bar.postfix
    bar.round_end(plan(2), {"test_auc": 0.75}, dict)
    assert "auc=0.7500" in bar.bar.postfix
    bar.close(None)


def test_progress_of_a_resumed_run_starts_from_its_last_auc():
    bar = Progress(file=io.StringIO())
    bar.start(RunStart(resumed=True, history=[{"test_auc": 0.5}, {"test_auc": 0.875}], round=2, iteration=4,
                       iterations=8))
    bar.round_end(plan(3), None, dict)
    assert "auc=0.8750" in bar.bar.postfix
    bar.close(None)


def test_progress_draws_where_the_terminal_reports_zero_columns(monkeypatch):
    monkeypatch.setattr(progress.os, "get_terminal_size", lambda *a: os.terminal_size((0, 0)))
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
    assert progress.terminal_size(sys.stderr) == (80, 24)
    monkeypatch.setenv("COLUMNS", "100")
    assert progress.terminal_size(sys.stderr)[0] == 100


def test_progress_bar_on_a_terminal_of_zero_columns(monkeypatch):
    # A fresh pseudo-terminal reports 0 x 0, as under `script` and in some CI runners and containers; tqdm alone
    # then draws nothing at all.
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
    master, slave = os.openpty()
    try:
        assert os.get_terminal_size(slave) == (0, 0)
        with open(slave, "w", closefd=False) as terminal:
            bar = Progress(file=terminal)
            bar.start(RunStart(resumed=False, history=[], round=0, iteration=0, iterations=4))
            bar.record({"test_auc": 0.3125}, dict)
            bar.round_end(plan(1), None, dict)
            bar.round_end(plan(2), {"test_auc": 0.75}, dict)
            bar.close(None)
        shown = b""
        while select.select([master], [], [], 0.5)[0]:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(master)
        os.close(slave)
    text = shown.decode(errors="replace")
    assert "4/4" in text and "auc=0.7500" in text and "round=2" in text


def history(values, every=100):
    return np.arange(len(values)) * every, np.array(values, dtype=float)


def test_the_auc_axis_is_zoomed_past_the_untrained_start():
    from fdam_ray.plots import auc_limits

    a = history([0.31, 0.80, 0.95, 0.97, 0.98, 0.985, 0.99, 0.99, 0.99, 0.99, 0.991])
    b = history([0.29, 0.70, 0.90, 0.93, 0.94, 0.95, 0.955, 0.96, 0.96, 0.96, 0.962])
    # the first 10% of iterations (0 and 100 of 1000) are left out: 0.90 .. 0.991, padded by at least 0.01, capped
    assert auc_limits([a, b]) == pytest.approx((0.89, 1.0))
    # 0.5 .. 0.9 past iteration 50 of 500, padded by 10% of the span
    assert auc_limits([history([0.3, 0.5, 0.7, 0.8, 0.85, 0.9])]) == pytest.approx((0.46, 0.94))
    assert auc_limits([history([0.5, np.nan, 0.99, 1.0])]) == pytest.approx((0.98, 1.0))
    assert auc_limits([history([0.4])]) == pytest.approx((0.39, 0.41))  # a single evaluation: itself
    assert auc_limits([history([np.nan, np.nan])]) is None


def test_fdam_plot_draws_auc_vs_iterations_with_the_zoomed_axis(tmp_path, monkeypatch):
    import json

    from fdam_ray import plots

    for name, values in (("a", [0.3, 0.9, 0.95, 0.96, 0.97]), ("b", [0.32, 0.85, 0.9, 0.92, 0.93])):
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text("algorithm: codasca\nlocal_steps: 4\n")
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"iteration": 100 * i, "test_auc": v, "bytes_up": 10 * i, "bytes_down": 10 * i}) + "\n"
            for i, v in enumerate(values)))
    limits = {}

    def keep(fig, path, plt):
        limits[path.name] = fig.axes[0].get_ylim()
        plt.close(fig)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    plots.plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "fig")
    lo, hi = limits["auc_vs_iterations.png"]
    assert (lo, hi) == pytest.approx((0.85 - 0.012, 0.97 + 0.012))  # past iteration 0 (0.3): 0.85 .. 0.97
    assert limits["auc_vs_bytes.png"] == (lo, hi)
