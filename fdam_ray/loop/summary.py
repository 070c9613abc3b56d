"""What a run reports of its evaluations: the one it selects as its best, and its summary.

With validation (``val_fraction`` > 0) the selected evaluation is the one of the highest validation figure
``select_by`` names (``val_auc``; or, with ``clinical: on``, the validation parts' pooled pAUC ``val_pauc`` or
two-way pAUC ``val_tpauc``), the first of equal ones, with one warning when several tie, and the driver keeps a copy
of the model there (``best_model.pt``); without, it is the evaluation of the highest test AUC. The checkpoint's
``best_val_auc`` holds the best value of that figure. The summary (``summary.json``,
:attr:`~fdam_ray.loop.summary.RunResult.summary`) reports it next to the final evaluation and the run's totals.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fdam_ray.checkpoint import LoopState
from fdam_ray.core.flat import FlatModel
from fdam_ray.core.state import GlobalState, Rule, vector_names
from fdam_ray.data import DataSource
from fdam_ray.scores.clinic import CLINICAL_KEYS

log = logging.getLogger(__name__)


def keep_best(loop: LoopState, rec: dict, by: str = "val_auc") -> None:
    """Keep the evaluation with the highest validation figure ``by`` so far (the first of equal ones): its value,
    its iteration and a copy of the model's state there (the loop's arrays change in later rounds; the control
    variates are not the model's and are left out)."""
    val = rec.get(by)
    if val is None or not math.isfinite(val) or (loop.best_val_auc is not None and val <= loop.best_val_auc):
        return
    state, control = loop.state, vector_names(Rule.CONTROL)
    loop.best_val_auc, loop.best_val_iteration = float(val), rec["iteration"]
    loop.best_val_state = GlobalState.from_vectors(
        {k: None if x is None or k in control else x.copy() for k, x in state.vectors().items()},
        round=state.round, iteration=state.iteration)


def selected_evaluation(loop: LoopState, *, validation: bool, by: str = "val_auc") -> int:
    """The index in ``loop.history`` of the evaluation the run reports as its best (see the module's docstring);
    with validation, one warning when others tie with it in ``by``."""
    if not validation:
        return _best_test(loop.history)
    best = _selected(loop)
    _warn_if_tied(loop.history, best, by)
    return best


def run_summary(loop: LoopState, best: int, *, algorithm: str, validation: bool, started: float,
                positive_ratio: np.ndarray, client_names: Sequence[str] | None, by: str = "val_auc") -> dict:
    """The run's summary: the final and the selected (``best``, by ``by`` with validation) evaluation, the run's
    totals (iterations, rounds, bytes, wall time since ``started`` plus earlier sessions', samples/s), p and the
    clients' names; with ``clinical: on`` the final and the selected evaluation's pooled test figures
    (``final_test_auc_ci_low``, ``best_test_pauc``, ...); ``run_dir`` is None (an observer that saves the run sets
    it)."""
    state, history = loop.state, loop.history
    return {
        "algorithm": algorithm,
        "final_test_auc": history[-1]["test_auc"],
        "best_test_auc": history[best]["test_auc"],
        "best_iteration": history[best]["iteration"],
        **(_validation_summary(history, best, selected=loop.best_val_iteration is not None, by=by)
           if validation else {}),
        **{f"final_{k}": v for k, v in history[-1].items() if k.startswith(CLINICAL_KEYS)},  # clinical: on
        **{f"best_{k}": v for k, v in history[best].items() if k.startswith(CLINICAL_KEYS)},
        "iterations": state.iteration,
        "rounds": state.round,
        "bytes_up": loop.bytes_up,
        "bytes_down": loop.bytes_down,
        "wall_s": round(loop.wall_offset + time.perf_counter() - started, 3),
        "samples_per_s": round(loop.samples / loop.train_s, 1) if loop.train_s else None,
        "positive_ratio": [round(float(x), 6) for x in positive_ratio],
        **({"client_names": list(client_names)} if client_names else {}),
        "run_dir": None,  # an observer that saves the run sets it
    }


def warn_if_test_set_changed(history: list[dict], rec: dict) -> None:
    """One warning when the pooled test set is not the one the last evaluation scored: a client dropped from the
    run (``on_client_failure=drop``) takes its own test split out of a pool made of the clients' splits, and an
    AUC over other samples cannot be compared with the earlier ones (each record keeps its ``test_samples``)."""
    before = history[-1].get("test_samples") if history else None
    now = rec.get("test_samples")
    if before is not None and now is not None and now != before:
        log.warning("the pooled test set has %d samples at iteration %d, %d at the evaluation before (the test "
                    "splits of dropped clients are no longer scored): test AUCs before and after are not comparable, "
                    "and best_test_auc may come from the larger set (metrics record test_samples per evaluation)",
                    now, rec["iteration"], before)


def _warn_if_tied(history: list[dict], best: int, by: str = "val_auc") -> None:
    """One warning when other evaluations have the selected one's validation figure ``by`` (a saturated or small
    validation set): the selection is then the earliest of them, not one the validation set tells apart."""
    val = history[best].get(by)
    if val is None or not math.isfinite(val):
        return
    tied = [h["iteration"] for h in history if h.get(by) == val]
    if len(tied) < 2:
        return
    shown = ", ".join(map(str, tied[:5])) + (", ..." if len(tied) > 5 else "")
    samples = history[best].get("val_samples")
    log.warning("%d evaluations tied at the best %s %.6g (iterations %s): the validation set%s cannot "
                "tell them apart, so best_model.pt and best_* are the earliest of them (iteration %d); a larger "
                "val_fraction (or more data) tells them apart", len(tied), _named(by), val, shown,
                "" if samples is None else f" ({samples} samples)", history[best]["iteration"])


def _best_test(history: list[dict]) -> int:
    """Without validation: the evaluation of the highest test AUC (the last one when none is defined)."""
    aucs = [h["test_auc"] for h in history]
    return int(np.nanargmax(aucs)) if np.any(np.isfinite(aucs)) else len(history) - 1


def _selected(loop: LoopState) -> int:
    """With validation: the evaluation of the best validation AUC (the last one when none is defined)."""
    at = [i for i, h in enumerate(loop.history) if h["iteration"] == loop.best_val_iteration]
    return at[-1] if at else len(loop.history) - 1


NOT_SELECTED = ("no model was selected: no evaluation had a defined validation AUC (the validation part holds one "
                "class in every task, so it has no positive-negative pair); best_* are the last evaluation's, and "
                "no best_model.pt is written")


def _named(by: str) -> str:
    """How a selecting figure is said: ``validation AUC``, ``validation pAUC``, ``validation two-way pAUC``."""
    return {"val_auc": "validation AUC", "val_pauc": "validation pAUC"}.get(by, "validation two-way pAUC")


def _validation_summary(history: list[dict], best: int, *, selected: bool, by: str = "val_auc") -> dict:
    """The summary's validation fields: best_test_auc and best_iteration are then those of this evaluation,
    ``selected_by: <by>`` (with a pAUC also its ``best_<by>`` and ``final_<by>``); when ``by`` was never defined,
    ``selected_by: last`` and why."""
    out = {"best_val_auc": history[best]["val_auc"], "final_val_auc": history[-1]["val_auc"],
           "selected_by": by if selected else "last"}
    if by != "val_auc":
        out.update({f"best_{by}": history[best].get(by), f"final_{by}": history[-1].get(by)})
    if not selected:
        why = NOT_SELECTED.replace("validation AUC", _named(by))
        log.warning("%s", why)
        out["selection"] = why
    return out


@dataclasses.dataclass
class RunResult:
    """What a finished run returns.

    Attributes:
        config: the run's config.
        model_state: the global network's ``state_dict`` (BatchNorm statistics included).
        a, b, alpha: the objective's extra primal and dual variables (empty for bce).
        control_variates: the global (c_v, c_alpha), or None without drift correction.
        history: one record per evaluation (iteration, round, stage, lr, losses, AUCs, bytes, time).
        summary: best and final test AUC, rounds, bytes moved, wall time, samples/s.
        state: the final global state as flat buffers.
        run_dir: where outputs were written (None when nothing was saved).
        pretrain: the BCE pre-training run of the two-stage recipe (``pretrain_iterations`` > 0), else None.
    """

    config: object
    model_state: dict[str, torch.Tensor]
    a: np.ndarray
    b: np.ndarray
    alpha: np.ndarray
    control_variates: tuple[np.ndarray, np.ndarray] | None
    history: list[dict]
    summary: dict
    state: GlobalState
    run_dir: Path | None
    pretrain: RunResult | None = None


def control_variates(state: GlobalState) -> tuple[np.ndarray, np.ndarray] | None:
    """The final (c_v, c_alpha) of an algorithm with drift correction, else None."""
    if state.c_v is None:
        return None
    if state.c_alpha is None:
        raise RuntimeError("the final state has a control variate of v but none of alpha")
    return state.c_v, state.c_alpha


def model_payload(flat: FlatModel, state: GlobalState, source: DataSource, network: dict) -> dict:
    """``model.pt``'s payload of ``state`` (loaded into the driver's replica ``flat``): the network's state_dict,
    a, b, alpha, the task names and which network it is (``network``, :func:`~fdam_ray.models.network_record`)."""
    flat.load(state)
    n_w, m = flat.num_weights, flat.aux_size
    a, b = state.v[n_w : n_w + m].copy(), state.v[n_w + m : n_w + 2 * m].copy()
    return {"model": flat.model_state_dict(), "a": torch.from_numpy(a), "b": torch.from_numpy(b),
            "alpha": torch.from_numpy(state.alpha.copy()), "task_names": list(source.task_names), "network": network}
