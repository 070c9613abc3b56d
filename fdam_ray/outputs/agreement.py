"""A run folder holds one run: before a resume reads it, every file it reads is checked against ``checkpoint.pt``.

A resume continues from ``checkpoint.pt`` and trusts the rest of the folder to be the same run: it rewrites
``config.yaml`` and the metric files from the checkpoint and, for a finished run, returns ``summary.json`` and
``model.pt`` as its result. A file of another run put into the folder (another algorithm, ``num_clients``, data or
model) would so become this run without a word. :func:`check_one_run` refuses such a folder in one line naming
both files, the first field that differs and its two values, before anything in the folder is written.

What may legitimately differ: the config fields a resume may change (:data:`fdam_ray.config.RESUME_MAY_CHANGE`,
``config.yaml`` is written just after the checkpoint that holds a resume's changes); metric records past the
checkpoint (the run went on after its last checkpoint; the resume drops them) or missing at the end (a resume
stopped while it rewrote them); ``summary.json`` and ``model.pt`` of an earlier, shorter session of the run. A
file that is missing, or that cannot be read as what it should be (a summary or model that is not one), says
nothing about which run it is from and is left to the resume (which writes it again); ``config.yaml`` that is
there but not readable is refused, since the run's record cannot be checked.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import yaml

from fdam_ray.checkpoint import Checkpoint
from fdam_ray.files.torchload import safe_load
from fdam_ray.files.versions import VERSIONS_KEY
from fdam_ray.files.yamlfile import read_yaml_file
from fdam_ray.outputs.records import flatten_record

CHECKPOINT_FILE = "checkpoint.pt"
# The numbers of an evaluation record that tell runs apart (timing is left out: two runs of one config differ in it)
_RECORD_FIELDS = ("iteration", "round", "stage", "lr", "train_loss", "test_auc", "val_auc", "bytes_up", "bytes_down")
_ABSENT = "(absent)"


class RunFolderMismatch(ValueError):
    """Files of a run folder come from different runs; nothing in the folder was changed."""


def check_one_run(run_dir: Path, checkpoint: Checkpoint, *, may_differ: Collection[str]) -> None:
    """Refuse (:class:`RunFolderMismatch`, one line) a run folder whose files do not all belong to the run of its
    ``checkpoint.pt`` (``checkpoint``): ``config.yaml`` (but for the fields in ``may_differ``), ``metrics.jsonl``,
    ``metrics.csv``, ``summary.json``, ``model.pt`` and ``best_model.pt``. Reads only."""
    run_dir = Path(run_dir)
    config = dict(checkpoint.config or {})
    _check_config(run_dir, config, may_differ)
    history = checkpoint.loop.history
    _check_jsonl(run_dir, history)
    _check_csv(run_dir, history)
    summary = _check_summary(run_dir, checkpoint, config)
    finished_here = summary is not None and summary.get("iterations") == checkpoint.loop.state.iteration
    for name in ("model.pt", "best_model.pt"):
        _check_model(run_dir, name, checkpoint, config, values=finished_here and name == "model.pt")


def check_same_config(run_dir: Path, holder: str, recorded: Mapping[str, Any], config: Mapping[str, Any], *,
                      may_differ: Collection[str]) -> None:
    """Refuse a config recorded in ``holder`` (a file of ``run_dir``) that is not the checkpoint's ``config`` but
    for the fields in ``may_differ``."""
    recorded = {k: v for k, v in recorded.items() if k != VERSIONS_KEY}
    for key in [*config, *(k for k in recorded if k not in config)]:
        if key in may_differ:
            continue
        mine, theirs = _as_yaml(recorded.get(key, _ABSENT)), _as_yaml(config.get(key, _ABSENT))
        if not _same(mine, theirs):
            _refuse(run_dir, holder, key, _shown(mine), _shown(theirs))


def _refuse(run_dir: Path, this: str, field: str, its: str, checkpoints: str, at: str = "") -> NoReturn:
    raise RunFolderMismatch(
        f"run folder '{run_dir}' holds files of different runs: {this}{at} has {field}={its} but {CHECKPOINT_FILE}{at} "
        f"has {field}={checkpoints}; nothing was changed: resume only a folder whose files all come from one run (put "
        f"that run's own {this} or {CHECKPOINT_FILE} back), or start a new run")


def _shown(value: Any) -> str:
    return value if value == _ABSENT else repr(value)


def _as_yaml(value: Any) -> Any:
    """A value as ``config.yaml`` holds it (tuples are lists; what YAML writes, read back)."""
    if value == _ABSENT:
        return value
    plain = list(value) if isinstance(value, tuple) else value
    try:
        return yaml.safe_load(yaml.safe_dump(plain))
    except yaml.YAMLError:
        return plain


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN (and to null: summary.json writes null for NaN), in lists and mappings too."""
    if _is_nan(a) or _is_nan(b):
        return (_is_nan(a) or a is None) and (_is_nan(b) or b is None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def _is_nan(x: Any) -> bool:
    """NaN or infinite: what summary.json and metrics.jsonl write as null."""
    return isinstance(x, float) and not math.isfinite(x)


def _check_config(run_dir: Path, config: dict, may_differ: Collection[str]) -> None:
    path = run_dir / "config.yaml"
    if not path.exists():
        return  # written again from the checkpoint
    try:
        recorded = read_yaml_file(path, "run config") if path.is_file() else None
    except ValueError as exc:
        raise RunFolderMismatch(f"run folder '{run_dir}': config.yaml cannot be read ({exc}), so it cannot be "
                                f"checked against {CHECKPOINT_FILE}; nothing was changed: remove config.yaml to have "
                                "it written again from the checkpoint") from None
    if not isinstance(recorded, dict):
        raise RunFolderMismatch(f"run folder '{run_dir}': config.yaml does not hold a run's config, so it cannot be "
                                f"checked against {CHECKPOINT_FILE}; nothing was changed: remove config.yaml to have "
                                "it written again from the checkpoint")
    check_same_config(run_dir, "config.yaml", recorded, config, may_differ=may_differ)


def _compare_records(run_dir: Path, name: str, found: Iterable[tuple[int, dict]], history: list[dict],
                     shown: Any) -> None:
    """The records of metrics file ``name`` (index, record; a record cut short at the end is left out) against the
    checkpoint's ``history``; ``shown(value)`` is how the file holds a history value."""
    for i, rec in found:
        if i >= len(history):
            return  # evaluations after the checkpoint: the resume drops them
        want = history[i]
        for key in _RECORD_FIELDS:
            if key not in rec and key not in want:
                continue
            mine, theirs = rec.get(key, _ABSENT), shown(want[key]) if key in want else _ABSENT
            if not _same(mine, theirs):
                _refuse(run_dir, name, key, _shown(mine), _shown(theirs), f" (evaluation {i + 1})")


def _check_jsonl(run_dir: Path, history: list[dict]) -> None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().splitlines()

    def records() -> Iterable[tuple[int, dict]]:
        for i, line in enumerate(lines):
            try:
                rec = json.loads(line)
            except ValueError:
                if i == len(lines) - 1:
                    return  # a line cut short by a stop mid-write
                _refuse(run_dir, "metrics.jsonl", "a record", "a line that is not JSON", "one",
                        f" (evaluation {i + 1})")
            if not isinstance(rec, dict):
                _refuse(run_dir, "metrics.jsonl", "a record", repr(rec)[:40], "one", f" (evaluation {i + 1})")
            yield i, rec

    _compare_records(run_dir, "metrics.jsonl", records(), history, lambda v: v)


def _check_csv(run_dir: Path, history: list[dict]) -> None:
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return
    with open(path, encoding="utf-8", errors="replace", newline="") as fh:
        try:
            rows = list(csv.DictReader(fh))
        except csv.Error as exc:
            _refuse(run_dir, "metrics.csv", "its rows", f"not CSV ({exc})", "records")
    wanted = [flatten_record(h) for h in history]

    def records() -> Iterable[tuple[int, dict]]:
        for i, row in enumerate(rows):
            if None in row.values() and i == len(rows) - 1:
                return  # a row cut short by a stop mid-write
            yield i, {k: v for k, v in row.items() if k in _RECORD_FIELDS}

    _compare_records(run_dir, "metrics.csv", records(), wanted, lambda v: "" if v is None else str(v))


def _check_summary(run_dir: Path, checkpoint: Checkpoint, config: dict) -> dict | None:
    """``summary.json`` (None: none, or not a summary) against the checkpoint: its run's algorithm, global p, and
    the evaluation it ends at (the checkpoint's last, or one of an earlier, shorter session)."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict):
        return None
    name = "summary.json"
    if "algorithm" in summary and "algorithm" in config and summary["algorithm"] != config["algorithm"]:
        _refuse(run_dir, name, "algorithm", repr(summary["algorithm"]), repr(config["algorithm"]))
    if "positive_ratio" in summary:
        p = [round(float(x), 6) for x in np.asarray(checkpoint.positive_ratio).ravel()]
        if not _same(summary["positive_ratio"], p):
            _refuse(run_dir, name, "positive_ratio", repr(summary["positive_ratio"]), repr(p))
    iterations = summary.get("iterations")
    done = checkpoint.loop.state.iteration
    if not isinstance(iterations, int):
        return summary
    ends = [h for h in checkpoint.loop.history if h.get("iteration") == iterations]
    if iterations > done or not ends:
        _refuse(run_dir, name, "iterations", repr(iterations),
                f"{done} (and no evaluation at iteration {iterations})" if iterations <= done else repr(done))
    end = ends[-1]
    for key, field in (("rounds", "round"), ("final_test_auc", "test_auc"), ("final_val_auc", "val_auc")):
        if key in summary and field in end and not _same(summary[key], end[field]):
            _refuse(run_dir, name, key, repr(summary[key]), repr(end[field]))
    return summary


def _check_model(run_dir: Path, name: str, checkpoint: Checkpoint, config: dict, *, values: bool) -> None:
    """A saved model (``model.pt`` or ``best_model.pt``) against the checkpoint: the network its record names, the
    sizes of its state and, with ``values`` (the run finished at the checkpoint), the values of its state."""
    path = run_dir / name
    if not path.is_file():
        return
    try:
        payload = safe_load(path)
    except Exception:  # not a model file: nothing says which run it is of; the resume writes it again
        return
    if not isinstance(payload, dict):
        return
    network = payload.get("network")
    if isinstance(network, dict):
        for key in ("model", "model_width", "seed"):
            if key in network and key in config and not _same(network[key], config[key]):
                _refuse(run_dir, name, f"network {key}", repr(network[key]), repr(config[key]))
    state = checkpoint.loop.state
    m = int(np.asarray(state.alpha).size)
    for key in ("a", "b", "alpha"):
        got = payload.get(key)
        if isinstance(got, torch.Tensor) and got.numel() != m:
            _refuse(run_dir, name, f"len({key})", str(got.numel()), str(m))
    if not values:
        return
    v = np.asarray(state.v)
    model = payload.get("model")
    if isinstance(model, dict) and all(isinstance(t, torch.Tensor) for t in model.values()):
        # every value of the saved network is one of the final state's (its parameters and float buffers; compared
        # as sets, so tied weights and buffers a state_dict leaves out do not matter)
        floats = [t.detach().reshape(-1).to(torch.float32).numpy() for t in model.values() if t.is_floating_point()]
        final = np.concatenate([v[: v.size - 2 * m], np.asarray(state.buffers).ravel()]).astype(np.float32)
        if floats and not np.isin(np.concatenate(floats), final).all():
            _refuse(run_dir, name, "network weights", "those of another state", "the final state's")
    for key, want in (("a", v[v.size - 2 * m : v.size - m]), ("b", v[v.size - m :]), ("alpha", state.alpha)):
        got = payload.get(key)
        if isinstance(got, torch.Tensor) and not np.array_equal(got.numpy().ravel(), np.asarray(want).ravel(),
                                                                equal_nan=True):
            _refuse(run_dir, name, key, "another value", "the final state's")
