"""The results of a sweep: a table sorted by the metric (CSV, Markdown), the best config, a figure."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import yaml

from fdam_ray.config import build_config
from fdam_ray.plots import plot_top_trials
from fdam_ray.tuning.space import Space


def write_sweep_outputs(grid, space: Space) -> Path:
    """Table (CSV, Markdown) sorted by the metric, ``best_config.yaml`` and ``top_trials.png``."""
    opts = space.options
    out = Path(grid.experiment_path)
    rows = []
    for result in grid:
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
        return (v is None or (isinstance(v, float) and math.isnan(v)), sign * (v or 0))

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
    if rows and rows[0][f"final_{opts.metric}"] is not None:
        best = {**space.base, **{k: rows[0][k] for k in space.search}}
        best_cfg = build_config(best).to_dict()
        best_cfg.update(out_dir="runs", run_name=None)
        plain = {k: list(v) if isinstance(v, tuple) else v for k, v in best_cfg.items()}
        (out / "best_config.yaml").write_text(
            f"# best trial {rows[0]['trial']}: {opts.metric} = {rows[0][f'final_{opts.metric}']}\n"
            f"# fdam train --config {out / 'best_config.yaml'}\n" + yaml.safe_dump(plain, sort_keys=False),
            encoding="utf-8")
    plot_top_trials(rows[: opts.top_trials], out / "top_trials.png", opts.metric, list(space.search))
    return out


def cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1e4 else f"{v:.4g}"
    return "" if v is None else str(v)
