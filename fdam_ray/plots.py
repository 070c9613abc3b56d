"""Figures of one or several run folders (``fdam plot``).

    auc_vs_iterations.png   test AUC against iterations, one curve per run (the paper's top-row figure); the
                            y-axis is zoomed to where the runs differ, past the first 10% of each run; a run
                            with ``clinical: on`` also its 95% interval as a band (DeLong, logit scale)
    auc_vs_local_steps.png  final test AUC against I, CODA+ and CODASCA side by side (its bottom row);
                            runs that differ only in their seed give a mean with a min-max band, runs that
                            differ in another field (lr, ...) a curve each
    auc_vs_bytes.png        test AUC against megabytes communicated
    task_auc.png            final per-task AUC bars (multi-label runs only)
    site_auc.png            final AUC of the pool and of each site with its 95% interval (runs with
                            ``clinical: on`` whose sites' figures are kept: their own test splits)

A run's legend is its algorithm and I followed by the config fields in which the plotted runs differ
(``codasca I=4 lr=0.1``), so runs of a sweep are told apart by what the sweep varied. A sweep folder (of
``fdam tune`` or a Tuner of your own over :func:`fdam_ray.tuning.trainable`) stands for its trials' run folders
(``<trial>/run``). And of a sweep (``fdam tune``): ``top_trials.png``, its best trials' curves.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from fdam_ray.files.extras import require
from fdam_ray.files.yamlfile import read_yaml_file

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

    @property
    def name(self) -> str:
        """The run's folder name; a sweep trial's run folder (``run``) by its trial's."""
        return self.path.parent.name if self.path.name == "run" else self.path.name

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
    require("matplotlib", "plots", "plotting")
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


# Fields that say where and how a run was kept, not what was trained: never what tells plotted runs apart.
NOT_COMPARED = frozenset({"out_dir", "run_name", "checkpoint_every", "tensorboard", "trackers", "tracker_project",
                          "address", "ray_timeout_s", "placement_timeout_s", "data_workers", "eval_batch_size"})
MAX_LEGEND_FIELDS = 4


def differing_fields(runs: list[Run]) -> list[str]:
    """The config fields whose value is not the same in every run (algorithm and I, always shown, left out),
    in config order: what a legend needs to tell the runs apart."""
    if len(runs) < 2:
        return []
    names: list[str] = []
    for run in runs:
        names += [k for k in run.config if k not in names]
    return [k for k in names if k not in NOT_COMPARED and k not in ("algorithm", "local_steps")
            and "version" not in k  # the software a run was made with: not a setting of the run
            and not any(isinstance(run.config.get(k), dict) for run in runs)
            and len({_shown(run.config.get(k)) for run in runs}) > 1]


def _shown(value) -> str:
    """A config value as a legend shows it: numbers short (0.1, 1e-05), anything long clipped."""
    if isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, (list, tuple)):
        text = ",".join(_shown(v) for v in value)
    else:
        text = str(value)
    return text if len(text) <= 24 else text[:21] + "..."


def _fields_text(run: Run, fields: list[str]) -> str:
    shown = [f"{k}={_shown(run.config.get(k))}" for k in fields[:MAX_LEGEND_FIELDS]]
    return " ".join(shown + (["..."] if len(fields) > MAX_LEGEND_FIELDS else []))


def _labels(runs: list[Run]) -> list[str]:
    """Each run's legend: algorithm and I, the fields in which the runs differ, and the folder's name where
    that still leaves two alike."""
    fields = differing_fields(runs)
    labels = [" ".join(filter(None, (r.label, _fields_text(r, fields)))) for r in runs]
    counts: dict[str, int] = defaultdict(int)
    for lab in labels:
        counts[lab] += 1
    return [f"{lab} ({r.name})" if counts[lab] > 1 else lab for r, lab in zip(runs, labels, strict=True)]


def is_sweep_folder(path: Path) -> bool:
    """Whether ``path`` is a sweep's folder: no run of its own, trial folders holding run folders."""
    return not (path / "metrics.jsonl").is_file() and any(path.glob("*/run/metrics.jsonl"))


def _expand(run_dirs: list[str | Path]) -> tuple[list[Path], set[Path]]:
    """The run folders to plot: each given run folder, and for a sweep folder its trials' run folders (those of
    trials that never reported are left out later, with a warning); (folders, those that came from sweeps)."""
    folders: list[Path] = []
    from_sweeps: set[Path] = set()
    for p in map(Path, run_dirs):
        if p.is_dir() and is_sweep_folder(p):
            trials = sorted(m.parent for m in p.glob("*/run/metrics.jsonl"))
            folders += trials
            from_sweeps.update(trials)
        elif p.is_dir() and not (p / "metrics.jsonl").exists():
            raise ValueError(f"'{p}' is not a run folder (it has no metrics.jsonl) nor a sweep folder (no "
                             "<trial>/run/metrics.jsonl in it)")
        else:
            folders.append(p)
    return folders, from_sweeps


def _read_runs(run_dirs: list[str | Path]) -> tuple[list[Run], list[Run]]:
    """(runs with a finite test AUC, those without); a sweep's trial that has no records yet is left out with a
    warning, a run folder given by name without them is an error."""
    folders, from_sweeps = _expand(run_dirs)
    runs: list[Run] = []
    skipped: list[Run] = []
    for folder in folders:
        try:
            run = Run(folder)
        except ValueError as exc:
            if folder not in from_sweeps:
                raise
            log.warning("not plotted: %s", exc)
            continue
        (runs if np.isfinite(run.series("test_auc")).any() else skipped).append(run)
    return runs, skipped


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Draw every figure that the given runs support into ``out_dir``; return the files written.

    A sweep folder stands for its trials' run folders. A run without a single finite test AUC (NaN throughout:
    a test set of one class, a diverged run) has no curve to draw: it is named in one warning and left out, and
    the other runs are drawn; if no run is left, that is a ``ValueError`` naming them."""
    runs, skipped = _read_runs(run_dirs)
    if not runs and not skipped:
        raise ValueError("nothing to plot: no trial of the sweep has an evaluation record yet")
    if skipped:
        names = ", ".join(f"'{r.path}'" for r in skipped)
        if not runs:
            raise ValueError(f"nothing to plot: the test AUC of {names} is NaN at every evaluation")
        log.warning("not plotted: the test AUC of %s is NaN at every evaluation", names)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    labelled = list(zip(runs, _labels(runs), strict=True))
    zoom = auc_limits([(run.series("iteration"), run.series(key)) for run in runs  # the interval bands shown too
                       for key in ("test_auc", "test_auc_ci_logit_low", "test_auc_ci_logit_high")])
    figures = [_auc_vs_iterations(plt, labelled, zoom, out / "auc_vs_iterations.png"),
               _auc_vs_bytes(plt, labelled, zoom, out / "auc_vs_bytes.png"),
               _auc_vs_local_steps(plt, runs, out / "auc_vs_local_steps.png"),
               _task_auc(plt, labelled, out / "task_auc.png"),
               _site_auc(plt, labelled, out / "site_auc.png")]
    return [path for path in figures if path is not None]


Zoom = tuple[float, float] | None


def _auc_vs_iterations(plt, labelled: list[tuple[Run, str]], zoom: Zoom, path: Path) -> Path:
    """Test AUC against iterations, one curve per run (the paper's top row)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    banded = False
    for run, label in labelled:
        xs = run.series("iteration")
        line, = ax.plot(xs, run.series("test_auc"), marker=".", label=label)
        low, high = (run.series(f"test_auc_ci_logit_{end}") for end in ("low", "high"))
        if np.isfinite(low).any():  # clinical: on: the 95 % interval as a band, where it is defined
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
            banded = True
    ax.set(xlabel="iteration", ylabel="test AUC (pooled)" + (", 95% CI band" if banded else ""),
           title="Test AUC during training")
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


def local_steps_groups(runs: list[Run]) -> dict[str, dict[str, dict[int, list[float]]]]:
    """Final test AUCs of the CODA+ and CODASCA runs: algorithm -> curve -> I -> values. Runs that differ only
    in their seed share a curve (their values at one I make its band); runs that differ in any other field
    (lr, prox_weight, ...) are curves of their own, named by those fields ("" when there is one curve)."""
    coda = [r for r in runs if r.algorithm in ("coda_plus", "codasca") and r.local_steps]
    fields = [k for k in differing_fields(coda) if k != "seed"]
    groups: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for run in coda:
        final, steps = run.series("test_auc")[-1], run.local_steps
        if math.isfinite(final) and steps is not None:
            groups[run.algorithm][_fields_text(run, fields)][int(steps)].append(float(final))
    return groups


def _auc_vs_local_steps(plt, runs: list[Run], path: Path) -> Path | None:
    """Final test AUC against I, CODA+ and CODASCA side by side (the paper's bottom row): per curve
    (:func:`local_steps_groups`) the mean with a min-max band over seeds. None without a CODA+ or CODASCA run."""
    by_alg = local_steps_groups(runs)
    if not by_alg:
        return None
    names = [a for a in ("coda_plus", "codasca") if a in by_alg]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for curve, by_steps in sorted(by_alg[name].items()):
            steps = sorted(by_steps)
            vals = [np.array(by_steps[i]) for i in steps]
            line, = ax.plot(steps, [v.mean() for v in vals], marker="o", label=curve or "mean")
            ax.fill_between(steps, [v.min() for v in vals], [v.max() for v in vals], alpha=0.2,
                            color=line.get_color(), label=None if curve else "min-max")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="local steps I", title={"coda_plus": "CODA+", "codasca": "CODASCA"}[name])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("final test AUC")
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


def _site_auc(plt, labelled: list[tuple[Run, str]], path: Path) -> Path | None:
    """The final AUC of the pool and of each site, with its 95 % interval (logit scale) as an error bar, one bar
    group per run with ``clinical: on`` whose last record has the sites' intervals; None without one."""
    shown = [(r, lab) for r, lab in labelled if r.history[-1].get("client_auc_ci_logit_low")]
    if not shown:
        return None
    sites = list(dict.fromkeys(s for r, _ in shown for s in r.history[-1]["client_auc_ci_logit_low"]))
    names = ["pooled", *sites]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names) * len(shown)), 4.5))
    width, x = 0.8 / len(shown), np.arange(len(names))
    for i, (run, label) in enumerate(shown):
        last = run.history[-1]
        auc, low, high = site_intervals(last, sites)
        err = np.abs(np.array([auc - low, high - auc]))
        ax.bar(x + i * width - 0.4 + width / 2, auc, width, yerr=err, capsize=3, label=label)
    ax.set_xticks(x, names, rotation=20)
    ax.set(ylabel="final test AUC, 95% CI", title="AUC per site")
    finite = [v for r, _ in shown for v in site_intervals(r.history[-1], sites)[1] if math.isfinite(v)]
    ax.set_ylim(max(0.0, min(finite, default=0.05) - 0.05), 1.0)
    ax.legend(fontsize=8)
    return _save(fig, path, plt)


def site_intervals(rec: dict, sites: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(AUC, low, high) of the pool, then of each of ``sites`` (NaN where a site has none), from a record with
    ``clinical: on``: the logit-scale 95 % interval."""
    def of(key: str, pooled: str) -> np.ndarray:
        per_site = rec.get(key) or {}
        values = [rec.get(pooled), *(per_site.get(s) for s in sites)]
        return np.array([np.nan if v is None else v for v in values], dtype=float)

    return (of("client_auc", "test_auc"), of("client_auc_ci_logit_low", "test_auc_ci_logit_low"),
            of("client_auc_ci_logit_high", "test_auc_ci_logit_high"))


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_top_trials(rows: list[dict], path: Path, metric: str, keys: list[str]) -> None:
    """A sweep's best trials (``top_trials.png``): the metric against iterations, one curve per trial.

    Each row holds ``_history`` ([(iteration, value), ...]), ``trial`` and the searched ``keys``.
    """
    require("matplotlib", "plots", "a sweep's figure")
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
