"""Figures of one or several run folders (``fdam plot``).

    auc_vs_iterations.png   test AUC against iterations, one curve per run (the paper's top-row figure); the
                            y-axis is zoomed to where the runs differ, past the first 10% of each run
    auc_vs_local_steps.png  final test AUC against I, CODA+ and CODASCA side by side (its bottom row);
                            runs that share algorithm and I (seeds) give a mean with a min-max band
    auc_vs_bytes.png        test AUC against megabytes communicated
    task_auc.png            final per-task AUC bars (multi-label runs only)

and of a sweep (``fdam tune``): ``top_trials.png``, its best trials' curves.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from fdam_ray.config import read_yaml_file

log = logging.getLogger(__name__)


class Run:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        metrics = self.path / "metrics.jsonl"
        if not metrics.is_file():
            raise ValueError(f"'{path}' is not a run folder (it has no metrics.jsonl)")
        self.history = _read_metrics(metrics)
        if not self.history:
            raise ValueError(f"'{path}' has no evaluation records yet")
        cfg_file = self.path / "config.yaml"
        self.config = read_yaml_file(cfg_file, "run config") if cfg_file.is_file() else {}
        if not isinstance(self.config, dict):
            raise ValueError(f"run config '{cfg_file}' is damaged: it holds a {type(self.config).__name__}, "
                             "not a mapping of field: value")
        self.algorithm = self.config.get("algorithm", "?")
        self.local_steps = self.config.get("local_steps")
        if not isinstance(self.local_steps, int) or isinstance(self.local_steps, bool):
            self.local_steps = None

    @property
    def label(self) -> str:
        return f"{self.algorithm} I={self.local_steps}"

    def series(self, key: str) -> np.ndarray:
        return np.array([np.nan if h.get(key) is None else h[key] for h in self.history], dtype=float)


def _read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``; a damaged line is an error naming the file and the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"metrics file '{path}' is not UTF-8 text (byte {exc.start})") from None
    records = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"metrics file '{path}', line {i} is not a JSON record ({exc.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("test_auc"), (int, float, type(None))):
            raise ValueError(f"metrics file '{path}', line {i} is not an evaluation record")
        records.append(rec)
    return records


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def auc_limits(curves: list[tuple[np.ndarray, np.ndarray]], *, skip: float = 0.1) -> tuple[float, float] | None:
    """Y-limits of an AUC plot zoomed to where the curves differ.

    Each curve is (iterations, AUC). The first ``skip`` of each run's iterations (its initial evaluation of an
    untrained network, near 0.5 or below, and the climb after it) is left out of the range, which then spans
    the remaining values of every curve with a margin of 10% of that span (at least 0.01), capped at 0 and 1.
    None when no curve has a finite value there.
    """
    kept = []
    for xs, ys in curves:
        xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
        finite = np.isfinite(xs) & np.isfinite(ys)
        if not finite.any():
            continue
        x, y = xs[finite], ys[finite]
        late = x > x.min() + skip * (x.max() - x.min())
        kept.append(y[late] if late.any() else y)
    if not kept:
        return None
    values = np.concatenate(kept)
    lo, hi = float(values.min()), float(values.max())
    pad = max(0.1 * (hi - lo), 0.01)
    return max(0.0, lo - pad), min(1.0, hi + pad)


def _labels(runs: list[Run]) -> list[str]:
    labels = [r.label for r in runs]
    counts: dict[str, int] = defaultdict(int)
    for lab in labels:
        counts[lab] += 1
    return [f"{r.label} ({r.path.name})" if counts[r.label] > 1 else r.label for r in runs]


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Draw every figure that the given runs support into ``out_dir``; return the files written.

    A run without a single finite test AUC (NaN throughout: a test set of one class, a diverged run) has no
    curve to draw: it is named in one warning and left out, and the other runs are drawn; if no run is left,
    that is a ``ValueError`` naming them."""
    runs: list[Run] = []
    skipped: list[Run] = []
    for p in run_dirs:
        run = Run(Path(p))
        (runs if np.isfinite(run.series("test_auc")).any() else skipped).append(run)
    if skipped:
        names = ", ".join(f"'{r.path}'" for r in skipped)
        if not runs:
            raise ValueError(f"nothing to plot: the test AUC of {names} is NaN at every evaluation")
        log.warning("not plotted: the test AUC of %s is NaN at every evaluation", names)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    labelled = list(zip(runs, _labels(runs), strict=True))
    zoom = auc_limits([(run.series("iteration"), run.series("test_auc")) for run in runs])
    figures = [_auc_vs_iterations(plt, labelled, zoom, out / "auc_vs_iterations.png"),
               _auc_vs_bytes(plt, labelled, zoom, out / "auc_vs_bytes.png"),
               _auc_vs_local_steps(plt, runs, out / "auc_vs_local_steps.png"),
               _task_auc(plt, labelled, out / "task_auc.png")]
    return [path for path in figures if path is not None]


Zoom = tuple[float, float] | None


def _auc_vs_iterations(plt, labelled: list[tuple[Run, str]], zoom: Zoom, path: Path) -> Path:
    """Test AUC against iterations, one curve per run (the paper's top row)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, label in labelled:
        ax.plot(run.series("iteration"), run.series("test_auc"), marker=".", label=label)
    ax.set(xlabel="iteration", ylabel="test AUC (pooled)", title="Test AUC during training")
    if zoom is not None:  # the untrained start (and the climb after it) may lie below the axis
        ax.set_ylim(*zoom)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path, plt)


def _auc_vs_bytes(plt, labelled: list[tuple[Run, str]], zoom: Zoom, path: Path) -> Path:
    """Test AUC against megabytes communicated (log scale)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, label in labelled:
        mb = (run.series("bytes_up") + run.series("bytes_down")) / 1e6
        ax.plot(np.maximum(mb, 1e-3), run.series("test_auc"), marker=".", label=label)
    if zoom is not None:
        ax.set_ylim(*zoom)
    ax.set_xscale("log")
    ax.set(xlabel="megabytes communicated (up + down)", ylabel="test AUC (pooled)", title="AUC against communication")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path, plt)


def _auc_vs_local_steps(plt, runs: list[Run], path: Path) -> Path | None:
    """Final test AUC against I, CODA+ and CODASCA side by side (the paper's bottom row); runs that share
    algorithm and I give a mean with a min-max band. None without a CODA+ or CODASCA run."""
    by_alg: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        final = run.series("test_auc")[-1]
        if run.algorithm in ("coda_plus", "codasca") and run.local_steps and math.isfinite(final):
            by_alg[run.algorithm][int(run.local_steps)].append(final)
    if not by_alg:
        return None
    names = [a for a in ("coda_plus", "codasca") if a in by_alg]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        steps = sorted(by_alg[name])
        vals = [np.array(by_alg[name][i]) for i in steps]
        mean = [v.mean() for v in vals]
        ax.plot(steps, mean, marker="o", label="mean")
        ax.fill_between(steps, [v.min() for v in vals], [v.max() for v in vals], alpha=0.2, label="min-max")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="local steps I", title={"coda_plus": "CODA+", "codasca": "CODASCA"}[name])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final test AUC")
    axes[0][0].legend(fontsize=8)
    return _save(fig, path, plt)


def _task_auc(plt, labelled: list[tuple[Run, str]], path: Path) -> Path | None:
    """Final per-task AUC bars of the multi-label runs; None without one."""
    multi = [(r, lab) for r, lab in labelled if r.history[-1].get("task_auc")]
    if not multi:
        return None
    tasks = list(multi[0][0].history[-1]["task_auc"])
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(tasks) * len(multi) / 2), 4.5))
    width = 0.8 / len(multi)
    x = np.arange(len(tasks))
    for i, (run, label) in enumerate(multi):
        vals = [run.history[-1]["task_auc"].get(t) or np.nan for t in tasks]
        ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=label)
    ax.set_xticks(x, tasks, rotation=20)
    ax.set(ylabel="final test AUC", title="AUC per task")
    finite = [v for r, _ in multi for v in r.history[-1]["task_auc"].values() if v is not None and math.isfinite(v)]
    ax.set_ylim(max(0.0, min(finite, default=0.05) - 0.05), 1.0)
    ax.legend(fontsize=8)
    return _save(fig, path, plt)


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_top_trials(rows: list[dict], path: Path, metric: str, keys: list[str]) -> None:
    """A sweep's best trials (``top_trials.png``): the metric against iterations, one curve per trial.

    Each row holds ``_history`` ([(iteration, value), ...]), ``trial`` and the searched ``keys``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for r in rows:
        if r["_history"]:
            xs, ys = zip(*r["_history"], strict=True)
            ax.plot(xs, ys, marker=".", label=", ".join(f"{k}={r[k]}" for k in keys) or r["trial"])
            drawn += 1
    ax.set(xlabel="iteration", ylabel=metric, title=f"Top {len(rows)} trials")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
