"""The names an evaluation record's numbers go by: flat (``metrics.csv``, Tune) and grouped (TensorBoard tags,
experiment trackers)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def flatten_record(rec: dict) -> dict:
    out = {}
    for key, value in rec.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                out[f"{key}.{sub}"] = v
        else:
            out[key] = value
    return out


def scalars(rec: dict) -> dict[str, float]:
    """Every number of an evaluation record under its flat name (``task_auc.<task>``, ``client_auc.<id>``, as in
    ``metrics.csv``), plus ``worst_task_auc`` and ``worst_client_auc`` (the lowest defined AUC) where the record has
    per-task or per-client AUCs (and ``worst_val_client_auc`` over the validation parts). What Tune and the
    experiment trackers receive."""
    out: dict[str, float] = {}
    for key, value in flatten_record(rec).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
    for part, name in (("task_auc", "worst_task_auc"), ("client_auc", "worst_client_auc"),
                       ("val_client_auc", "worst_val_client_auc")):
        defined = [v for v in (rec.get(part) or {}).values()
                   if isinstance(v, (int, float)) and not math.isnan(v)]
        if defined:
            out[name] = min(defined)
    return out


# Groups of the grouped metric names (TensorBoard tags, tracker metrics): AUCs, communication, training.
_AUC_NAMES = {"test_auc": "auc/test", "worst_task_auc": "auc/worst_task", "worst_client_auc": "auc/worst_client",
              "test_samples": "auc/test_samples", "val_auc": "auc/val", "val_samples": "auc/val_samples",
              "worst_val_client_auc": "auc/worst_val_client"}
_COMM_NAMES = {"bytes_up": "comm/bytes_up", "bytes_down": "comm/bytes_down"}
_TRAIN_NAMES = {"train_loss": "train/loss"}


def grouped_name(key: str) -> str:
    """The grouped name of a flat metric name: ``test_auc`` -> ``auc/test``, ``task_auc.Edema`` ->
    ``auc/task/Edema``, ``client_auc.3`` -> ``auc/client/3``, ``val_auc`` -> ``auc/val``, ``val_client_auc.3`` ->
    ``auc/val_client/3``, ``bytes_up`` -> ``comm/bytes_up``, ``train_loss`` -> ``train/loss``, and any other (lr,
    stage, round, wall_s, samples_per_s) ``train/<key>``."""
    for prefix, group in (("task_auc.", "auc/task/"), ("client_auc.", "auc/client/"),
                          ("val_task_auc.", "auc/val_task/"), ("val_client_auc.", "auc/val_client/")):
        if key.startswith(prefix):
            return group + key[len(prefix):]
    return _AUC_NAMES.get(key) or _COMM_NAMES.get(key) or _TRAIN_NAMES.get(key) or f"train/{key}"


def grouped_scalars(rec: dict) -> dict[str, float]:
    """:func:`scalars` under their grouped names, without the step (``iteration``)."""
    return {grouped_name(k): v for k, v in scalars(rec).items() if k != "iteration"}


NOTES_KEY = "notes"  # summary.json: why a value is null


def _why_not_finite(key: str, value: float) -> str:
    if "auc" in key:
        where = ("the clients' validation parts together hold" if "val" in key else
                 "the test set holds" if "test" in key else "the samples it is computed on hold")
        return (f"{value} written as null: the AUC is not defined because {where} one class only (an AUC needs "
                "positives and negatives)")
    return f"{value} written as null: not a finite number"


def finite_or_null(value: Any, nulled: Callable[[float], None] | None = None) -> Any:
    """``value`` as strict JSON holds it: every NaN or infinite number (also inside a list or mapping) as None,
    each passed to ``nulled`` when given. ``metrics.jsonl`` is written so (one JSON record a line, which NaN is
    not); readers take null as NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        if nulled is not None:
            nulled(value)
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v, nulled) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v, nulled) for v in value]
    return value


def strict_summary(summary: dict) -> dict:
    """``summary`` as strict JSON can hold it (:func:`finite_or_null`), and ``notes`` says why for each key that
    held a number that is not finite. :func:`read_summary` reads it back."""
    out: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for key, value in summary.items():
        if key == NOTES_KEY:
            continue
        nulled: list[float] = []
        out[key] = finite_or_null(value, nulled.append)
        if nulled:
            notes[key] = _why_not_finite(key, nulled[0])
    if notes:
        out[NOTES_KEY] = notes
    return out


def read_summary(summary: dict) -> dict:
    """A summary written by :func:`strict_summary`, with each top-level null its notes explain the number it was
    again (NaN or infinite, as the run returned it)."""
    notes = summary.get(NOTES_KEY)
    if not isinstance(notes, dict):
        return summary
    out = dict(summary)
    for key, why in notes.items():
        if key in out and out[key] is None and isinstance(why, str):
            try:
                out[key] = float(why.split(" ", 1)[0])
            except ValueError:
                pass
    return out
