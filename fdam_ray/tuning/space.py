"""Search-space files of ``fdam tune``: reading, validating, and Ray Tune's spaces.

A search-space file (``tune/*.yaml``) has three sections, all keyed by the
training config's own field names:

    base:   fixed fields of every trial (a training config)
    search: field -> {grid: [...]} | {choice: [...]} | {uniform: [lo, hi]}
                     | {loguniform: [lo, hi]} | {randint: [lo, hi]}
    tune:   metric, mode, searcher (grid | random | optuna), num_samples, scheduler (fifo | asha),
            grace_period, reduction_factor, max_concurrent_trials, driver_cpus, name, storage_path
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import yaml

from fdam_ray.config import FIELD_BY_NAME, ConfigError, build_config, load_config_file, read_text_value, typed_value

SPEC_KINDS = ("grid", "choice", "uniform", "loguniform", "randint")
REPORTED = ("iteration", "round", "stage", "test_auc", "train_loss", "bytes_up", "bytes_down", "wall_s")
SPACE_FILE = "fdam_space.yaml"  # the space a sweep folder was started with


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


def space_of_sweep(sweep_dir: str | Path) -> Space:
    """The search space a sweep folder was started with (for ``fdam tune --resume DIR``)."""
    path = Path(sweep_dir) / SPACE_FILE
    if not path.is_file():
        raise ConfigError(f"'{sweep_dir}' is not a sweep folder made by fdam tune (no {SPACE_FILE})")
    data = yaml.safe_load(path.read_text())
    return Space(data["base"], data["search"], TuneOptions(**data["tune"]))
