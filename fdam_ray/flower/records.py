"""fdam-ray's records as Flower records: state vectors as an ArrayRecord, plans and counts as a ConfigRecord.

Arrays travel as Flower serialises them (``np.save`` bytes, no pickle), so a
float32 state arrives bit for bit; a vector an algorithm does not use (the
control variates of CODA+) is simply absent.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fdam_ray.state import ClientInfo, GlobalState, Moments, RoundPlan, Scores, StepStats, vector_names

STATE = "state"
ARRAYS = "arrays"
CONFIG = "config"


def arrays(values: Mapping[str, np.ndarray | None]) -> ArrayRecord:
    """An ArrayRecord of the arrays that are not None."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in values.items() if v is not None})


def numpy_of(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in record.items()}


def state_vectors(record: ArrayRecord) -> dict[str, np.ndarray | None]:
    """The state vectors by name (None where absent)."""
    found = numpy_of(record)
    return {name: found.get(name) for name in vector_names()}


def global_state_content(state: GlobalState, config: Mapping[str, object]) -> RecordDict:
    """A message carrying the global state and the given config values."""
    return RecordDict({STATE: arrays(state.vectors()),
                       CONFIG: ConfigRecord({"round": state.round, "iteration": state.iteration, **config})})


def global_state_of(content: RecordDict) -> GlobalState:
    cfg = content.config_records[CONFIG]
    return GlobalState.from_vectors(state_vectors(content.array_records[STATE]), round=int(cfg["round"]),
                                    iteration=int(cfg["iteration"]))


def plan_config(plan: RoundPlan) -> dict[str, object]:
    return {f"plan_{f.name}": getattr(plan, f.name) for f in dataclasses.fields(RoundPlan)}


def plan_of(cfg: ConfigRecord) -> RoundPlan:
    return RoundPlan(**{f.name: cfg[f"plan_{f.name}"] for f in dataclasses.fields(RoundPlan)})


def stats_config(stats: StepStats) -> dict[str, object]:
    return {f"stats_{f.name}": getattr(stats, f.name) for f in dataclasses.fields(StepStats)}


def stats_of(cfg: ConfigRecord) -> StepStats:
    return StepStats(**{f.name: cfg[f"stats_{f.name}"] for f in dataclasses.fields(StepStats)})


def info_content(info: ClientInfo) -> RecordDict:
    return RecordDict({ARRAYS: arrays({"positives": info.positives, "labelled": info.labelled}),
                       CONFIG: ConfigRecord({"client_id": info.client_id, "num_train": info.num_train,
                                             "num_test": info.num_test, "state_size": info.state_size})})


def info_of(content: RecordDict) -> ClientInfo:
    cfg, arr = content.config_records[CONFIG], numpy_of(content.array_records[ARRAYS])
    return ClientInfo(int(cfg["client_id"]), int(cfg["num_train"]), int(cfg["num_test"]), arr["positives"],
                      arr["labelled"], int(cfg["state_size"]))


def scores_content(scores: Scores | None) -> RecordDict:
    if scores is None:
        return RecordDict({CONFIG: ConfigRecord({"has_scores": False})})
    return RecordDict({ARRAYS: arrays({"scores": scores.scores, "labels": scores.labels}),
                       CONFIG: ConfigRecord({"has_scores": True, "client_id": scores.client_id})})


def scores_of(content: RecordDict) -> Scores | None:
    cfg = content.config_records[CONFIG]
    if not cfg["has_scores"]:
        return None
    arr = numpy_of(content.array_records[ARRAYS])
    return Scores(int(cfg["client_id"]), arr["scores"], arr["labels"])


def moments_content(m: Moments) -> RecordDict:
    return RecordDict({ARRAYS: arrays({"sum_pos": np.asarray(m.sum_pos), "num_pos": np.asarray(m.num_pos),
                                       "sum_neg": np.asarray(m.sum_neg), "num_neg": np.asarray(m.num_neg)}),
                       CONFIG: ConfigRecord({"client_id": m.client_id})})


def moments_of(content: RecordDict) -> Moments:
    arr = numpy_of(content.array_records[ARRAYS])
    return Moments(arr["sum_pos"], arr["num_pos"], arr["sum_neg"], arr["num_neg"],
                   int(content.config_records[CONFIG]["client_id"]))


def to_json(value: object) -> str:
    return json.dumps(value, sort_keys=True)
