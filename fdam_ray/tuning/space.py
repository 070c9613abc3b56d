"""Search-space files of ``fdam tune``: reading, validating, and Ray Tune's spaces.

A search-space file has three sections, all keyed by the
training config's own field names:

    base:   fixed fields of every trial (a training config)
    search: field -> {grid: [...]} | {choice: [...]} | {uniform: [lo, hi]}
                     | {loguniform: [lo, hi]} | {randint: [lo, hi]}
    tune:   metric (test_auc, train_loss, ..., task_auc.<task>, client_auc.<id>, worst_task_auc,
            worst_client_auc; val_auc, val_task_auc.<task>, val_client_auc.<id>, worst_val_client_auc with
            val_fraction > 0, where the trials' select_by, val_auc, is the default; with clinical: on test_pauc,
            val_pauc, test_auc_ci_low, ...), mode, searcher (grid | random | optuna),
            num_samples, scheduler (fifo | asha), grace_period, reduction_factor, max_concurrent_trials,
            driver_cpus, name, storage_path
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
from pathlib import Path
from typing import Any

from fdam_ray.config import (
    FIELD_BY_NAME,
    ConfigError,
    build_config,
    load_config_file,
    read_text_value,
    read_yaml_file,
    typed_value,
)
from fdam_ray.files.locations import RemoteFolder, is_uri, join_uri
from fdam_ray.outputs.run_folder import RUN_NAME_ALLOWED, is_folder_name
from fdam_ray.settings.redact import clip, short
from fdam_ray.settings.yamlio import kind_of

log = logging.getLogger(__name__)
SPEC_KINDS = ("grid", "choice", "uniform", "loguniform", "randint")
RANGE_KINDS = ("uniform", "loguniform", "randint")
REPORTED = ("iteration", "round", "stage", "test_auc", "val_auc", "train_loss", "bytes_up", "bytes_down", "wall_s")
# Reported as well where a run has them (multi-task data, clients with test splits of their own): the AUC of each
# task and each client under the metrics.csv names, and the lowest of each.
REPORTED_PATTERNS = (re.compile(r"task_auc\..+"), re.compile(r"client_auc\..+"), re.compile(r"worst_task_auc"),
                     re.compile(r"worst_client_auc"), re.compile(r"lr|samples_per_s|test_samples"),
                     re.compile(r"val_task_auc\..+|val_client_auc\..+|worst_val_client_auc|val_samples"),
                     # clinical: on: the pooled read-out of the test and the validation parts (val_pauc, ...)
                     re.compile(r"(test|val)_(auc_se|auc_ci_(logit_)?(low|high)|pauc|pauc_mcclish|tpauc"
                                r"|(sens_at_spec|spec_at_sens)_[0-9.]+)"))


def is_reported(metric: str) -> bool:
    """Whether trials report ``metric`` to Tune (where the run has it): see :data:`REPORTED`."""
    return metric in REPORTED or any(p.fullmatch(metric) for p in REPORTED_PATTERNS)
SPACE_FILE = "fdam_space.yaml"  # the space a sweep folder was started with
# Example spaces shipped inside the package (so a wheel install has them): ``fdam tune small`` runs small.yaml.
EXAMPLE_SPACES = Path(__file__).resolve().parent / "spaces"


def example_names() -> list[str]:
    """The names of the example spaces shipped with fdam-ray (small, paper_grid)."""
    return sorted(p.stem for p in EXAMPLE_SPACES.glob("*.yaml"))


def space_path(arg: str) -> str:
    """What ``fdam tune SPACE`` reads: a file (or storage URI) of that name where there is one, else the example
    space of that name shipped with fdam-ray (``small``, ``small.yaml``, ``tune/small.yaml`` as older
    instructions wrote it)."""
    if is_uri(arg) or Path(arg).exists():
        return arg
    name = Path(arg).name.removesuffix(".yaml")
    example = EXAMPLE_SPACES / f"{name}.yaml"
    if example.is_file() and (arg in (name, f"{name}.yaml", f"tune/{name}.yaml")):
        return str(example)
    return arg


def no_space_hint() -> str:
    """What ``fdam tune`` without a space says: the example spaces and where they are installed."""
    return (f"fdam tune needs a search-space file, an example's name ({', '.join(example_names())}: `fdam tune "
            f"small`; copy one from {EXAMPLE_SPACES} to start your own) or --resume DIR")


@dataclasses.dataclass
class TuneOptions:
    metric: str = "test_auc"  # val_auc where the base config has val_fraction > 0 (see make_space)
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
                raise ConfigError(f"tune option '{name}': {short(getattr(self, name))} is not allowed "
                                  f"(one of {', '.join(choices)})")
        if not isinstance(self.metric, str) or not is_reported(self.metric):
            raise ConfigError(f"tune option 'metric': {short(self.metric)} is not reported (one of "
                              f"{', '.join(REPORTED)}, task_auc.<task>, client_auc.<client>, worst_task_auc, "
                              "worst_client_auc)")
        _check_option("num_samples", self.num_samples, integer=True, low=1)
        _check_option("grace_period", self.grace_period, integer=True, low=1, optional=True)
        _check_option("max_concurrent_trials", self.max_concurrent_trials, integer=True, low=1, optional=True)
        _check_option("top_trials", self.top_trials, integer=True, low=0)
        _check_option("driver_cpus", self.driver_cpus, positive=True)
        _check_option("reduction_factor", self.reduction_factor, above_one=True)
        for name in ("num_samples", "grace_period", "max_concurrent_trials", "top_trials"):
            if isinstance(getattr(self, name), float):  # 1e3 is read as a float
                setattr(self, name, int(getattr(self, name)))
        for name in ("name", "storage_path"):
            value = getattr(self, name)
            if not (isinstance(value, str) and value.strip()) and not (name == "name" and value is None):
                raise ConfigError(f"tune option '{name}': {short(value)} is not allowed (a non-empty text)")
        if self.name is not None and not is_folder_name(self.name):  # the sweep's folder stays under storage_path
            raise ConfigError(f"tune option 'name': {short(self.name)} is not allowed ({RUN_NAME_ALLOWED})")


def _check_option(name: str, value: Any, *, integer: bool = False, low: int = 0, positive: bool = False,
                  above_one: bool = False, optional: bool = False) -> None:
    """A numeric tune option: one line naming it, its value and what is allowed."""
    if value is None and optional:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if integer:
        ok, allowed = number and float(value).is_integer() and value >= low, f"an integer >= {low}"
    elif above_one:
        ok, allowed = number and value > 1, "a number > 1"
    else:
        ok, allowed = number and value > 0, "a number > 0"
    if not ok or (number and value != value):  # NaN
        raise ConfigError(f"tune option '{name}': {short(value)} is not allowed ({allowed}"
                          + (" or null" if optional else "") + ")")


@dataclasses.dataclass
class Space:
    base: dict[str, Any]
    search: dict[str, dict]
    options: TuneOptions


def _check_spec(name: str, spec: Any) -> None:
    """One search entry: a config field and one of {grid | choice | uniform | loguniform | randint: [...]}."""
    if name not in FIELD_BY_NAME:
        raise ConfigError(f"search field {_name(name)} is not a config field (see `fdam fields`)")
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in SPEC_KINDS:
        raise ConfigError(f"search field '{name}': {short(spec)} must be one of "
                          + ", ".join(f"{{{k}: ...}}" for k in SPEC_KINDS))
    kind, values = next(iter(spec.items()))
    if not isinstance(values, list) or not values:
        raise ConfigError(f"search field '{name}': {kind} needs a non-empty list, got {short(values)}")
    if kind in RANGE_KINDS:
        _check_range(name, kind, values)


def _check_range(name: str, kind: str, values: list) -> None:
    """[low, high] of a uniform, loguniform or randint entry."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if kind == "randint":
        numbers = numbers and all(float(v).is_integer() for v in values)
    if len(values) != 2 or not numbers:
        what = "two integers" if kind == "randint" else "two numbers"
        raise ConfigError(f"search field '{name}': {kind} needs [low, high] ({what}), got {short(values)}")
    if not values[0] < values[1]:
        raise ConfigError(f"search field '{name}': {kind} needs low < high, got {short(values)}")
    if kind == "loguniform" and min(values) <= 0:
        raise ConfigError(f"search field '{name}': loguniform needs positive bounds, got {short(values)}")


def _candidates(search: dict[str, dict]) -> list[dict]:
    """Values to validate up front: every grid/choice value, both ends of each range."""
    lists = {k: next(iter(v.values())) for k, v in search.items()}
    keys = list(lists)
    combos = itertools.product(*(lists[k] for k in keys)) if keys else [()]
    return [dict(zip(keys, c, strict=True)) for c in itertools.islice(combos, 512)]


def load_space(path: str, overrides: dict[str, Any] | None = None) -> Space:
    """Read and validate a search-space file (or an example space by name: `space_path`); ``overrides`` set
    base fields (``tune.X`` keys set options)."""
    path = space_path(path)
    return make_space(load_config_file(path), overrides, where=f"search space '{clip(path)}'")


def make_space(data: dict[str, Any], overrides: dict[str, Any] | None = None, *,
               where: str = "search space") -> Space:
    """Validate a search space given as a mapping with the sections of a space file (``base``, ``search``,
    ``tune``), as [`load_space`][fdam_ray.tuning.load_space] does for a file: a sweep from Python,
    ``run_sweep(make_space({"base": {...}, "search": {"lr": {"grid": [0.1, 0.01]}}, "tune": {...}}))``."""
    _check_sections(data, where)
    base, search, opts = _with_overrides(data, overrides or {})
    known = {f.name for f in dataclasses.fields(TuneOptions)}
    for key in opts:
        if key not in known:
            raise ConfigError(f"unknown tune option {_name(key)} (one of {', '.join(sorted(known))})")
    for name, spec in search.items():
        _check_spec(name, spec)
    configs = [build_config({**base, **combo}) for combo in _candidates(search)]
    if "metric" not in opts and configs and all(c.val_fraction > 0 for c in configs):
        selecting = {c.select_by for c in configs}  # select on validation, never on the test set
        opts["metric"] = selecting.pop() if len(selecting) == 1 else "val_auc"
    options = TuneOptions(**opts)
    _check_validation_metric(options.metric, configs)
    if options.searcher == "grid" and any(k not in ("grid", "choice") for s in search.values() for k in s):
        raise ConfigError("tune option 'searcher': grid takes only {grid: [...]} and {choice: [...]}; "
                          "use searcher: random for ranges")
    return Space(base, search, options)


def _check_validation_metric(metric: str, configs: list) -> None:
    """A validation metric needs every trial to have a validation split; a test metric where they have one is
    allowed but selects on the test set, so it is said."""
    validated = [c.val_fraction > 0 for c in configs]
    if metric.startswith(("val_", "worst_val_")) and not all(validated):
        raise ConfigError(f"tune option 'metric': {metric} needs val_fraction > 0 in every trial (set it in base)")
    if not metric.startswith(("val_", "worst_val_")) and metric.endswith("auc") and any(validated):
        log.warning("tune option 'metric' is %s while trials have a validation split (val_fraction > 0): the "
                    "sweep selects on it, not on val_auc", metric)


def _check_sections(data: Any, where: str) -> None:
    """A mapping of the sections base, search and tune, each a mapping (or left out)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping with sections base, search and tune, not "
                          f"{type(data).__name__}")
    _check_keys(data, where)
    unknown = set(data) - {"base", "search", "tune"}
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {', '.join(map(_name, sorted(unknown)))} (base, search, "
                          "tune)")
    for section in ("base", "search", "tune"):
        if not isinstance(data.get(section) or {}, dict):
            raise ConfigError(f"{where}: section '{section}' must be a mapping of name: value, "
                              f"not {type(data[section]).__name__}")
        _check_keys(data.get(section) or {}, f"{where}: section '{section}'")


def _check_keys(mapping: dict, where: str) -> None:
    """Every key of a space's mapping is text (a section, a field or an option name)."""
    for key in mapping:
        if not isinstance(key, str):
            raise ConfigError(f"{where}: key {short(key, 60)} is {kind_of(key)}, not a name; keys are "
                              "field and option names, written as text")


def _name(key: Any) -> str:
    """A name the user gave, as a message shows it: quoted, redacted, at most 80 characters."""
    return f"'{clip(key, 80)}'"


def _with_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict, dict, dict]:
    """(base, search, tune options) of ``data`` with ``key=value`` overrides: ``tune.X`` sets an option, any other
    key a base field (read as that field reads text), which then is not searched."""
    base = dict(data.get("base") or {})
    search = dict(data.get("search") or {})
    opts = dict(data.get("tune") or {})
    for key, value in overrides.items():
        if key.startswith("tune."):
            opts[key[5:]] = read_text_value(value)
        else:
            base[key] = typed_value(key, value)
            search.pop(key, None)
    return base, search, opts


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
    remote = is_uri(str(sweep_dir))
    path: str | Path = join_uri(str(sweep_dir), SPACE_FILE) if remote else Path(sweep_dir) / SPACE_FILE
    if not (RemoteFolder(str(sweep_dir)).exists(SPACE_FILE) if remote else Path(path).is_file()):
        raise ConfigError(f"'{clip(sweep_dir)}' is not a sweep folder made by fdam tune (no {SPACE_FILE})")
    data = read_yaml_file(path, "sweep space file")
    known = {f.name for f in dataclasses.fields(TuneOptions)}
    if (not isinstance(data, dict) or not all(isinstance(data.get(k), dict) for k in ("base", "search", "tune"))
            or not set(data["tune"]) <= known):
        raise ConfigError(f"sweep space file '{clip(path)}' is damaged: it must hold base, search and tune mappings "
                          "as fdam tune wrote them")
    for name, spec in data["search"].items():
        _check_spec(name, spec)
    return Space(data["base"], data["search"], TuneOptions(**data["tune"]))
