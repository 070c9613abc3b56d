"""The results of a sweep: a table sorted by the metric (CSV, Markdown), the best config, a figure."""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
from pathlib import Path

import yaml

from fdam_ray.config import build_config
from fdam_ray.files.extras import MissingExtraError
from fdam_ray.files.locations import RemoteFolder, is_uri, output_root
from fdam_ray.plots import plot_top_trials
from fdam_ray.settings.redact import redact
from fdam_ray.tuning.space import Space

log = logging.getLogger(__name__)

ERRORS_FILE = "errors.log"
LOCAL_COPY = "tune_results"  # where a sweep kept at a storage URI gets a local copy of its results


@dataclasses.dataclass
class SweepOutcome:
    """How a sweep ended.

    Attributes:
        path: the sweep folder.
        trials: trials the sweep makes.
        failed: (trial, the error's last line) for every trial that raised.
        unfinished: trials neither finished nor failed (the sweep was interrupted).
        best_config: ``best_config.yaml``, or None when no trial finished or the sweep is unfinished.
        storage: the sweep's storage URI when it is kept remotely (``path`` is then a local copy of the
            tables, best config and figure); None for a local sweep.
    """

    path: Path
    trials: int
    failed: list[tuple[str, str]]
    unfinished: int
    best_config: Path | None
    storage: str | None = None

    @property
    def resume_from(self) -> str:
        """What ``fdam tune --resume`` takes to continue this sweep."""
        return self.storage or str(self.path)

    @property
    def errors_file(self) -> Path:
        return self.path / ERRORS_FILE


def error_line(error: BaseException) -> str:
    """One line that says what went wrong in a trial: the original exception, not Ray's wrapping."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        error = cause
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return f"{type(error).__name__}: {text}".rstrip(": ")


def write_sweep_outputs(grid, space: Space) -> SweepOutcome:
    """Table (CSV, Markdown) sorted by the metric, ``best_config.yaml`` (from finished trials of a sweep
    that ran to its end; by ``val_auc``, the default metric, where trials have a validation split),
    ``top_trials.png`` and, when trials failed, their errors in full in ``errors.log``."""
    opts = space.options
    out, remote = _results_folder(str(grid.experiment_path))
    trials = _read_trials(grid, space)
    rows = _sorted_rows(trials.rows, opts.metric, opts.mode)
    _write_tables(rows, out)
    # trials not yet made count too: with max_concurrent_trials a stopped sweep has not made them all
    unfinished = max(0, expected_trials(space) - trials.done - len(trials.failed))
    best_file = out / "best_config.yaml"
    best_file.unlink(missing_ok=True)  # a resumed sweep's earlier answer does not stand
    (out / ERRORS_FILE).unlink(missing_ok=True)
    if trials.full_errors:
        (out / ERRORS_FILE).write_text(redact("\n".join(trials.full_errors)), encoding="utf-8")
    if not unfinished:
        _write_best_config(rows, space, best_file)
    try:
        plot_top_trials(rows[: opts.top_trials], out / "top_trials.png", opts.metric, list(space.search))
    except MissingExtraError as exc:  # the tables and the best config stand without the figure
        log.warning("top_trials.png not drawn: %s", exc)
    if remote is not None:
        _upload(remote, out, best_file)
    return SweepOutcome(out, max(len(grid), expected_trials(space)), trials.failed, unfinished,
                        best_file if best_file.exists() else None, None if remote is None else remote.uri)


def _results_folder(location: str) -> tuple[Path, RemoteFolder | None]:
    """Where the results are written: the sweep folder, or for a sweep kept at a storage URI a local folder (to
    read and train from) whose files are then uploaded to it."""
    remote = RemoteFolder(location) if is_uri(location) else None
    out = Path(location)
    if remote is not None:
        out = (output_root(LOCAL_COPY, "tune.storage_path") / out.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out, remote


@dataclasses.dataclass
class _Trials:
    """What the results of a sweep's trials say: one row per trial with a config, the failed trials' one-line
    and full errors, and how many trials are done."""

    rows: list[dict] = dataclasses.field(default_factory=list)
    failed: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    full_errors: list[str] = dataclasses.field(default_factory=list)
    done: int = 0


def _read_trials(grid, space: Space) -> _Trials:
    trials = _Trials()
    for result in grid:
        trials.done += result.error is None and bool((result.metrics or {}).get("done"))  # ended, or stopped by ASHA
        if result.error is not None:
            name = Path(result.path).name
            trials.failed.append((name, error_line(result.error)))
            trials.full_errors.append(f"== trial {name}\n{result.error}\n")
        if result.config is not None:
            trials.rows.append(_trial_row(result, space))
    return trials


def _trial_row(result, space: Space) -> dict:
    """A trial's row: its searched values, final and best metric, its final test AUC when the metric is another
    (a sweep selecting on validation still reports the test set), iterations, whether it failed, and its curve
    (``_history``, for the figure)."""
    opts = space.options
    df = result.metrics_dataframe
    hist = [] if df is None or opts.metric not in df else df[["iteration", opts.metric]].dropna().values.tolist()
    last = result.metrics or {}
    values = [v for _, v in hist]
    best = (max(values) if opts.mode == "max" else min(values)) if values else None
    return {"trial": Path(result.path).name, **{k: result.config.get(k) for k in space.search},
            f"final_{opts.metric}": last.get(opts.metric), f"best_{opts.metric}": best,
            **({} if opts.metric == "test_auc" else {"final_test_auc": last.get("test_auc")}),
            "iterations": last.get("iteration"), "error": None if result.error is None else "error",
            "_history": hist}


def _sorted_rows(rows: list[dict], metric: str, mode: str) -> list[dict]:
    """Best final metric first; trials without one, then failed trials, last."""
    sign = -1 if mode == "max" else 1

    def key(r):
        v = r[f"final_{metric}"]
        return (r["error"] is not None, v is None or (isinstance(v, float) and math.isnan(v)), sign * (v or 0))

    rows.sort(key=key)
    return rows


def _write_tables(rows: list[dict], out: Path) -> None:
    """``sweep_results.csv`` and ``sweep_results.md``."""
    cols = [c for c in (rows[0] if rows else {}) if c != "_history"]
    with open(out / "sweep_results.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        md.append("| " + " | ".join(cell(r[c]) for c in cols) + " |")
    (out / "sweep_results.md").write_text("\n".join(md) + "\n", encoding="utf-8")


def _write_best_config(rows: list[dict], space: Space, path: Path) -> None:
    """The best trial's config as ``best_config.yaml``, when the best trial finished with a metric."""
    metric = space.options.metric
    if not (rows and rows[0]["error"] is None and rows[0][f"final_{metric}"] is not None):
        return
    best = {**space.base, **{k: rows[0][k] for k in space.search}}
    best_cfg = build_config(best).to_dict()
    best_cfg.update(out_dir="runs", run_name=None)
    plain = {k: list(v) if isinstance(v, tuple) else v for k, v in best_cfg.items()}
    path.write_text(
        f"# best trial {rows[0]['trial']}: {metric} = {rows[0][f'final_{metric}']}\n"
        f"# fdam train --config {path}\n" + yaml.safe_dump(plain, sort_keys=False),
        encoding="utf-8")


def _upload(remote: RemoteFolder, out: Path, best_file: Path) -> None:
    """The local results to the sweep's storage, removing there what this sweep no longer has."""
    for name in (best_file.name, ERRORS_FILE):
        if not (out / name).exists():
            remote.remove(name)
    remote.upload(out, ["sweep_results.csv", "sweep_results.md", best_file.name, ERRORS_FILE, "top_trials.png"])


def expected_trials(space: Space) -> int:
    """How many trials the sweep makes: every grid combination ``num_samples`` times, or ``num_samples``."""
    n = space.options.num_samples
    if space.options.searcher == "grid":
        for spec in space.search.values():
            kind, values = next(iter(spec.items()))
            n *= len(values) if kind == "grid" else 1
    return n


def cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1e4 else f"{v:.4g}"
    return "" if v is None else str(v)
