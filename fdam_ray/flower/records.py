"""fdam-ray's records as Flower records: state vectors as an ArrayRecord, plans and counts as a ConfigRecord.

Arrays travel as Flower serialises them (``np.save`` bytes, no pickle), so a
float32 state arrives bit for bit; a vector an algorithm does not use (the
control variates of CODA+) is simply absent.
"""

from __future__ import annotations

from fdam_ray.flower import needs_flower  # noqa: F401 (first: without Flower, says what to install)

# isort: split
import dataclasses
import json
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fdam_ray.core.state import (
    ClientInfo,
    GlobalState,
    RoundPlan,
    ScoreHistogram,
    Scores,
    ScoreSums,
    StepStats,
    vector_names,
)
from fdam_ray.scores.histogram import Binning

STATE = "state"
ARRAYS = "arrays"
CONFIG = "config"


def config(values: Mapping[str, Any]) -> ConfigRecord:
    """A ConfigRecord of plain values (int, float, str, bytes, bool, or lists of one of them)."""
    return ConfigRecord(cast(Any, dict(values)))


def arrays(values: Mapping[str, np.ndarray | None]) -> ArrayRecord:
    """An ArrayRecord of the arrays that are not None."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in values.items() if v is not None})


def numpy_of(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in record.items()}


def state_vectors(record: ArrayRecord) -> dict[str, np.ndarray | None]:
    """The state vectors by name (None where absent)."""
    found = numpy_of(record)
    return {name: found.get(name) for name in vector_names()}


def global_state_content(state: GlobalState, values: Mapping[str, Any]) -> RecordDict:
    """A message carrying the global state and the given config values."""
    return RecordDict({STATE: arrays(state.vectors()),
                       CONFIG: config({"round": state.round, "iteration": state.iteration, **values})})


def global_state_of(content: RecordDict) -> GlobalState:
    cfg = content.config_records[CONFIG]
    return GlobalState.from_vectors(state_vectors(content.array_records[STATE]), round=integer(cfg, "round"),
                                    iteration=integer(cfg, "iteration"))


def plan_config(plan: RoundPlan) -> dict[str, Any]:
    return {f"plan_{f.name}": getattr(plan, f.name) for f in dataclasses.fields(RoundPlan)}


def plan_of(cfg: ConfigRecord) -> RoundPlan:
    return RoundPlan(**{f.name: raw(cfg, f"plan_{f.name}") for f in dataclasses.fields(RoundPlan)})


def stats_config(stats: StepStats) -> dict[str, Any]:
    return {f"stats_{f.name}": getattr(stats, f.name) for f in dataclasses.fields(StepStats)}


def stats_of(cfg: ConfigRecord) -> StepStats:
    return StepStats(**{f.name: raw(cfg, f"stats_{f.name}") for f in dataclasses.fields(StepStats)})


def info_content(info: ClientInfo) -> RecordDict:
    return RecordDict({ARRAYS: arrays({"positives": info.positives, "labelled": info.labelled}),
                       CONFIG: config({"client_id": info.client_id, "num_train": info.num_train,
                                             "num_test": info.num_test, "state_size": info.state_size})})


def info_of(content: RecordDict) -> ClientInfo:
    cfg, arr = content.config_records[CONFIG], numpy_of(content.array_records[ARRAYS])
    return ClientInfo(integer(cfg, "client_id"), integer(cfg, "num_train"), integer(cfg, "num_test"), arr["positives"],
                      arr["labelled"], integer(cfg, "state_size"))


def scores_content(scores: Scores | None) -> RecordDict:
    if scores is None:
        return RecordDict({CONFIG: config({"has_scores": False})})
    return RecordDict({ARRAYS: arrays({"scores": scores.scores, "labels": scores.labels}),
                       CONFIG: config({"has_scores": True, "client_id": scores.client_id})})


def scores_of(content: RecordDict) -> Scores | None:
    cfg = content.config_records[CONFIG]
    if not raw(cfg, "has_scores"):
        return None
    arr = numpy_of(content.array_records[ARRAYS])
    return Scores(integer(cfg, "client_id"), arr["scores"], arr["labels"])


def histogram_content(found: ScoreHistogram | None) -> RecordDict:
    """A site's score histogram (``test_scores: histogram``): its counts and own AUC per task, no per-sample
    value."""
    if found is None:
        return RecordDict({CONFIG: config({"has_scores": False})})
    return RecordDict({ARRAYS: arrays({"counts": found.counts, "task_auc": np.asarray(found.task_auc)}),
                       CONFIG: config({"has_scores": True, "client_id": found.client_id, "samples": found.samples,
                                       "nan_outputs": found.nan_outputs})})


def histogram_of(content: RecordDict) -> ScoreHistogram | None:
    cfg = content.config_records[CONFIG]
    if not raw(cfg, "has_scores"):
        return None
    arr = numpy_of(content.array_records[ARRAYS])
    return ScoreHistogram(integer(cfg, "client_id"), arr["counts"], arr["task_auc"], integer(cfg, "samples"),
                          integer(cfg, "nan_outputs"))


def binning_header(binning: Binning) -> dict[str, Any]:
    """A :class:`Binning` as header values: ``bins``, and on the second pass ``bins_lo``/``bins_hi`` (one float per
    task, NaN: the fixed layout); the range comes from the summed counts of every site, never one site's scores."""
    out: dict[str, Any] = {"bins": binning.bins}
    if binning.lo is not None and binning.hi is not None:
        out.update(bins_lo=list(binning.lo), bins_hi=list(binning.hi))
    return out


def binning_of_header(cfg: ConfigRecord) -> Binning:
    """The :class:`Binning` that :func:`binning_header` wrote into ``cfg``."""
    if "bins_lo" not in cfg:
        return Binning(integer(cfg, "bins"))
    return Binning(integer(cfg, "bins"), tuple(float(v) for v in raw(cfg, "bins_lo")),
                   tuple(float(v) for v in raw(cfg, "bins_hi")))


def score_sums_content(m: ScoreSums) -> RecordDict:
    return RecordDict({ARRAYS: arrays({"sum_pos": np.asarray(m.sum_pos), "num_pos": np.asarray(m.num_pos),
                                       "sum_neg": np.asarray(m.sum_neg), "num_neg": np.asarray(m.num_neg)}),
                       CONFIG: config({"client_id": m.client_id})})


def score_sums_of(content: RecordDict) -> ScoreSums:
    arr = numpy_of(content.array_records[ARRAYS])
    return ScoreSums(arr["sum_pos"], arr["num_pos"], arr["sum_neg"], arr["num_neg"],
                   integer(content.config_records[CONFIG], "client_id"))


def raw(record: ConfigRecord, key: str) -> Any:
    """A config record's value, as whatever type the sender gave it (the caller converts it)."""
    return cast(Any, record[key])


def integer(record: ConfigRecord, key: str) -> int:
    return int(raw(record, key))


def to_json(value: object) -> str:
    return json.dumps(value, sort_keys=True)
