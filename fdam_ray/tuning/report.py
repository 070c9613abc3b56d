"""The results of a sweep: a table sorted by the metric (CSV, Markdown), the best config, a figure."""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import yaml

from fdam_ray.config import build_config
from fdam_ray.locations import RemoteFolder, is_uri, output_root
from fdam_ray.plots import plot_top_trials
from fdam_ray.tuning.space import Space

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
    that ran to its end), ``top_trials.png`` and, when trials failed, their errors in full in ``errors.log``."""
    opts = space.options
    location = str(grid.experiment_path)
    remote = RemoteFolder(location) if is_uri(location) else None
    out = Path(location)
    if remote is not None:  # tables and best config also go to a local folder, to read and train from
        out = (output_root(LOCAL_COPY, "tune.storage_path") / out.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    failed: list[tuple[str, str]] = []
    full_errors: list[str] = []
    done = 0
    for result in grid:
        done += result.error is None and bool((result.metrics or {}).get("done"))  # ended, or stopped by ASHA
        if result.error is not None:
            name = Path(result.path).name
            failed.append((name, error_line(result.error)))
            full_errors.append(f"== trial {name}\n{result.error}\n")
        if result.config is None:
            continue
        df = result.metrics_dataframe
        hist = [] if df is None or opts.metric not in df else df[["iteration", opts.metric]].dropna().values.tolist()
        last = result.metrics or {}
        values = [v for _, v in hist]
        best = (max(values) if opts.mode == "max" else min(values)) if values else None
        rows.append({"trial": Path(result.path).name, **{k: result.config.get(k) for k in space.search},
                     f"final_{opts.metric}": last.get(opts.metric), f"best_{opts.metric}": best,
                     "iterations": last.get("iteration"), "error": None if result.error is None else "error",
                     "_history": hist})
    sign = -1 if opts.mode == "max" else 1

    def key(r):
        v = r[f"final_{opts.metric}"]
        return (r["error"] is not None, v is None or (isinstance(v, float) and math.isnan(v)), sign * (v or 0))

    rows.sort(key=key)
    cols = [c for c in (rows[0] if rows else {}) if c != "_history"]
    with open(out / "sweep_results.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        md.append("| " + " | ".join(cell(r[c]) for c in cols) + " |")
    (out / "sweep_results.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    # trials not yet made count too: with max_concurrent_trials a stopped sweep has not made them all
    unfinished = max(0, expected_trials(space) - done - len(failed))
    best_file = out / "best_config.yaml"
    best_file.unlink(missing_ok=True)  # a resumed sweep's earlier answer does not stand
    (out / ERRORS_FILE).unlink(missing_ok=True)
    if full_errors:
        (out / ERRORS_FILE).write_text("\n".join(full_errors), encoding="utf-8")
    if (not unfinished and rows and rows[0]["error"] is None
            and rows[0][f"final_{opts.metric}"] is not None):
        best = {**space.base, **{k: rows[0][k] for k in space.search}}
        best_cfg = build_config(best).to_dict()
        best_cfg.update(out_dir="runs", run_name=None)
        plain = {k: list(v) if isinstance(v, tuple) else v for k, v in best_cfg.items()}
        (out / "best_config.yaml").write_text(
            f"# best trial {rows[0]['trial']}: {opts.metric} = {rows[0][f'final_{opts.metric}']}\n"
            f"# fdam train --config {out / 'best_config.yaml'}\n" + yaml.safe_dump(plain, sort_keys=False),
            encoding="utf-8")
    plot_top_trials(rows[: opts.top_trials], out / "top_trials.png", opts.metric, list(space.search))
    if remote is not None:
        for name in (best_file.name, ERRORS_FILE):
            if not (out / name).exists():
                remote.remove(name)
        remote.upload(out, ["sweep_results.csv", "sweep_results.md", best_file.name, ERRORS_FILE, "top_trials.png"])
    return SweepOutcome(out, max(len(grid), expected_trials(space)), failed, unfinished,
                        best_file if best_file.exists() else None, None if remote is None else remote.uri)


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
