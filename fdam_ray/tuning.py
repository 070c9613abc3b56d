"""Ray Tune sweeps whose trials are whole federations (``fdam tune``).

A search-space file (``tune/*.yaml``) has three sections, all keyed by the
training config's own field names:

    base:   fixed fields of every trial (a training config)
    search: field -> {grid: [...]} | {choice: [...]} | {uniform: [lo, hi]}
                     | {loguniform: [lo, hi]} | {randint: [lo, hi]}
    tune:   metric, mode, searcher (grid | random | optuna), num_samples, scheduler (fifo | asha),
            grace_period, reduction_factor, max_concurrent_trials, driver_cpus, name, storage_path

Each trial reserves one placement group: a driver bundle plus, with the Ray
executor, one bundle per client (``cpus_per_client``, ``gpus_per_client``), so
its client actors run inside the trial's reservation and concurrent trials
cannot deadlock waiting for each other's CPUs. Every evaluation is reported to
Tune with a checkpoint of the federation (global state, control variates,
schedule position), so a stopped sweep resumes (``fdam tune --resume DIR``)
and a paused trial continues where it was.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from fdam_ray.config import FIELD_BY_NAME, ConfigError, build_config, load_config_file, read_text_value, typed_value

log = logging.getLogger(__name__)

SPEC_KINDS = ("grid", "choice", "uniform", "loguniform", "randint")
REPORTED = ("iteration", "round", "stage", "test_auc", "train_loss", "bytes_up", "bytes_down", "wall_s")
CHECKPOINT_FILE = "checkpoint.pt"


@dataclasses.dataclass
class TuneOptions:
    metric: str = "test_auc"
    mode: str = "max"
    searcher: str = "grid"
    num_samples: int = 1
    scheduler: str = "fifo"
    grace_period: int | None = None  # iterations before ASHA may stop a trial (default: 2 x eval_every)
    reduction_factor: float = 2.0
    max_concurrent_trials: int | None = None
    driver_cpus: float = 0.5
    name: str | None = None
    storage_path: str = "tune_results"
    top_trials: int = 5

    def __post_init__(self) -> None:
        allowed = {"mode": ("max", "min"), "searcher": ("grid", "random", "optuna"), "scheduler": ("fifo", "asha")}
        for name, choices in allowed.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"tune option '{name}': {getattr(self, name)!r} is not allowed "
                                  f"(one of {', '.join(choices)})")
        if self.metric not in REPORTED:
            raise ConfigError(f"tune option 'metric': {self.metric!r} is not reported (one of {', '.join(REPORTED)})")
        if not (isinstance(self.num_samples, int) and self.num_samples >= 1):
            raise ConfigError(f"tune option 'num_samples': {self.num_samples!r} is not allowed (an integer >= 1)")
        if not (isinstance(self.driver_cpus, (int, float)) and self.driver_cpus > 0):
            raise ConfigError(f"tune option 'driver_cpus': {self.driver_cpus!r} is not allowed (> 0)")
        if self.reduction_factor <= 1:
            raise ConfigError(f"tune option 'reduction_factor': {self.reduction_factor!r} is not allowed (> 1)")


@dataclasses.dataclass
class Space:
    base: dict[str, Any]
    search: dict[str, dict]
    options: TuneOptions


def _check_spec(name: str, spec: Any) -> None:
    if name not in FIELD_BY_NAME:
        raise ConfigError(f"search field '{name}' is not a config field (see `fdam fields`)")
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in SPEC_KINDS:
        raise ConfigError(f"search field '{name}': {spec!r} must be one of "
                          + ", ".join(f"{{{k}: ...}}" for k in SPEC_KINDS))
    kind, values = next(iter(spec.items()))
    if not isinstance(values, list) or not values:
        raise ConfigError(f"search field '{name}': {kind} needs a non-empty list, got {values!r}")
    if kind in ("uniform", "loguniform", "randint") and len(values) != 2:
        raise ConfigError(f"search field '{name}': {kind} needs [low, high], got {values!r}")
    if kind == "loguniform" and min(values) <= 0:
        raise ConfigError(f"search field '{name}': loguniform needs positive bounds, got {values!r}")


def _candidates(search: dict[str, dict]) -> list[dict]:
    """Values to validate up front: every grid/choice value, both ends of each range."""
    lists = {k: next(iter(v.values())) for k, v in search.items()}
    keys = list(lists)
    combos = itertools.product(*(lists[k] for k in keys)) if keys else [()]
    return [dict(zip(keys, c, strict=True)) for c in itertools.islice(combos, 512)]


def load_space(path: str, overrides: dict[str, Any] | None = None) -> Space:
    """Read and validate a search-space file; ``overrides`` set base fields (``tune.X`` keys set options)."""
    data = load_config_file(path)
    unknown = set(data) - {"base", "search", "tune"}
    if unknown:
        raise ConfigError(f"search space '{path}': unknown section(s) {sorted(unknown)} (base, search, tune)")
    base = dict(data.get("base") or {})
    search = dict(data.get("search") or {})
    opts = dict(data.get("tune") or {})
    for key, value in (overrides or {}).items():
        if key.startswith("tune."):
            opts[key[5:]] = read_text_value(value)
        else:
            base[key] = typed_value(key, value)
            search.pop(key, None)
    known = {f.name for f in dataclasses.fields(TuneOptions)}
    for key in opts:
        if key not in known:
            raise ConfigError(f"unknown tune option '{key}' (one of {', '.join(sorted(known))})")
    for name, spec in search.items():
        _check_spec(name, spec)
    for combo in _candidates(search):
        build_config({**base, **combo})
    options = TuneOptions(**opts)
    if options.searcher == "grid" and any(k not in ("grid", "choice") for s in search.values() for k in s):
        raise ConfigError("tune option 'searcher': grid takes only {grid: [...]} and {choice: [...]}; "
                          "use searcher: random for ranges")
    return Space(base, search, options)


def param_space(search: dict[str, dict], searcher: str) -> dict:
    from ray import tune

    out = {}
    for name, spec in search.items():
        kind, values = next(iter(spec.items()))
        if kind == "grid" and searcher == "grid":
            out[name] = tune.grid_search(values)
        elif kind in ("grid", "choice"):
            out[name] = tune.choice(values)
        elif kind == "uniform":
            out[name] = tune.uniform(*values)
        elif kind == "loguniform":
            out[name] = tune.loguniform(*values)
        else:
            out[name] = tune.randint(values[0], values[1] + 1)
    return out


def trial_bundles(config, driver_cpus: float) -> list[dict[str, float]]:
    """Bundle 0 for the trial's driver, then one per client when clients are Ray actors."""
    bundles = [{"CPU": driver_cpus}]
    if config.executor == "ray":
        client = {"CPU": float(config.cpus_per_client)}
        if config.gpus_per_client:
            client["GPU"] = float(config.gpus_per_client)
        bundles += [dict(client) for _ in range(config.num_clients)]
    return bundles


def federation_trial(params: dict, base: dict) -> None:
    """One Tune trial: a whole federation, reporting every evaluation with a checkpoint."""
    from ray import tune

    from fdam_ray.checkpoint import load_checkpoint, save_checkpoint
    from fdam_ray.data import make_source
    from fdam_ray.executors import make_executor
    from fdam_ray.federation import Federation

    trial_dir = Path(tune.get_context().get_trial_dir())
    config = build_config({**base, **params, "out_dir": str(trial_dir), "run_name": "run"})
    resume = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            resume = load_checkpoint(Path(d) / CHECKPOINT_FILE)

    def report(rec: dict, make_payload) -> None:
        metrics = {k: rec[k] for k in REPORTED if rec.get(k) is not None}
        with tempfile.TemporaryDirectory() as d:
            save_checkpoint(Path(d) / CHECKPOINT_FILE, make_payload())
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))

    source = make_source(config)
    with make_executor(config.executor) as executor:
        Federation(config, source, executor).run(run_dir=trial_dir / "run", report=report, resume=resume,
                                                 checkpoints=False)


def _trial_name(trial) -> str:
    params = "_".join(f"{k}={_cell(v)}" for k, v in sorted(trial.config.items()))
    return f"trial_{trial.trial_id}_{params}"[:120]


def _scheduler(space: Space, config):
    if space.options.scheduler != "asha":
        return None
    from ray.tune.schedulers import ASHAScheduler

    grace = space.options.grace_period or 2 * config.eval_every
    return ASHAScheduler(time_attr="iteration", max_t=config.iterations, grace_period=grace,
                         reduction_factor=space.options.reduction_factor)


def _searcher(space: Space):
    if space.options.searcher != "optuna":
        return None
    import importlib.util

    if importlib.util.find_spec("optuna") is None:
        raise ConfigError("tune option 'searcher': optuna needs the optuna package (pip install optuna)")
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch()


SPACE_FILE = "fdam_space.yaml"


def space_of_sweep(sweep_dir: str | Path) -> Space:
    """The search space a sweep folder was started with (for ``fdam tune --resume DIR``)."""
    path = Path(sweep_dir) / SPACE_FILE
    if not path.is_file():
        raise ConfigError(f"'{sweep_dir}' is not a sweep folder made by fdam tune (no {SPACE_FILE})")
    data = yaml.safe_load(path.read_text())
    return Space(data["base"], data["search"], TuneOptions(**data["tune"]))


def run_sweep(space: Space, *, resume_dir: str | None = None, address: str | None = None):
    """Run (or resume) a sweep and write its tables, best config and figure; returns the output folder."""
    from ray import tune

    base_config = build_config(space.base)
    if not resume_dir:
        if space.options.name is None:
            space.options.name = f"sweep-{datetime.now():%Y%m%d-%H%M%S}"
        exp_dir = Path(space.options.storage_path).resolve() / space.options.name
        if exp_dir.exists():
            raise ConfigError(f"sweep folder '{exp_dir}' exists; choose another tune.name or use --resume")
        exp_dir.mkdir(parents=True)
        (exp_dir / SPACE_FILE).write_text(yaml.safe_dump(
            {"base": space.base, "search": space.search, "tune": dataclasses.asdict(space.options)},
            sort_keys=False), encoding="utf-8")
    from fdam_ray.executors.ray_session import ensure_ray

    ensure_ray(address=address, cpus_needed=1)
    base, driver_cpus = space.base, space.options.driver_cpus

    def resources(params: dict):
        # per trial: a searched num_clients, cpus_per_client, gpus_per_client or executor changes its bundles
        config = build_config({**base, **params})
        return tune.PlacementGroupFactory(trial_bundles(config, driver_cpus), strategy=config.placement_strategy)

    trainable = tune.with_resources(tune.with_parameters(federation_trial, base=base), resources)
    if resume_dir:
        tuner = tune.Tuner.restore(str(Path(resume_dir).resolve()), trainable=trainable, resume_unfinished=True,
                                   resume_errored=True)
    else:
        opts = space.options
        tuner = tune.Tuner(
            trainable,
            param_space=param_space(space.search, opts.searcher),
            tune_config=tune.TuneConfig(
                metric=opts.metric, mode=opts.mode, num_samples=opts.num_samples,
                scheduler=_scheduler(space, base_config), search_alg=_searcher(space),
                max_concurrent_trials=opts.max_concurrent_trials,
                trial_name_creator=_trial_name, trial_dirname_creator=_trial_name,
            ),
            run_config=tune.RunConfig(name=opts.name, storage_path=str(Path(opts.storage_path).resolve()),
                                      checkpoint_config=tune.CheckpointConfig(num_to_keep=2), verbose=1),
        )
    grid = tuner.fit()
    return write_sweep_outputs(grid, space)


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
    import csv

    with open(out / "sweep_results.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        md.append("| " + " | ".join(_cell(r[c]) for c in cols) + " |")
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
    _plot_top(rows[: opts.top_trials], out / "top_trials.png", opts.metric, list(space.search))
    return out


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1e4 else f"{v:.4g}"
    return "" if v is None else str(v)


def _plot_top(rows: list[dict], path: Path, metric: str, keys: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r["_history"]:
            xs, ys = zip(*r["_history"], strict=True)
            ax.plot(xs, ys, marker=".", label=", ".join(f"{k}={r[k]}" for k in keys) or r["trial"])
    ax.set(xlabel="iteration", ylabel=metric, title=f"Top {len(rows)} trials")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
