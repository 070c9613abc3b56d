"""The Python entry points: :func:`train` (a dataset by name) and :func:`train_arrays` (your own arrays)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fdam_ray.config import Config, build_config
from fdam_ray.data.arrays import ArrayPair, ArraysSource
from fdam_ray.federation import RunResult
from fdam_ray.recipe import run

log = logging.getLogger(__name__)


def _config(config: Config | Mapping[str, Any] | None, **overrides: Any) -> Config:
    if isinstance(config, Config):
        return config.replace(**overrides) if overrides else config
    return build_config(dict(config or {}), **overrides)


def warn_one_class(source: ArraysSource) -> None:
    """One warning naming every test set (``test``, ``client_tests[k]``) that holds one class only for a task:
    the AUC it gives is NaN, since an AUC compares positives with negatives."""
    sets = ([("test", source.test, "the pooled test AUC")] if source.test is not None else []) + [
        (f"client_tests[{k}]", pair, f"client {k}'s AUC") for k, pair in sorted((source.tests or {}).items())]
    problems = []
    for name, (_, labels), what in sets:
        for t, task in enumerate(source.task_names):
            column = labels[:, t][~np.isnan(labels[:, t])]
            positives = int(column.sum())
            negatives = len(column) - positives
            if positives == 0 or negatives == 0:
                if len(source.task_names) > 1:  # a multi-task AUC is the mean over the tasks that have one
                    problems.append(f"{name} has {positives} positives and {negatives} negatives for task "
                                    f"'{task}', so its AUC for that task is NaN")
                else:
                    problems.append(f"{name} has {positives} positives and {negatives} negatives, so {what} is NaN")
    if problems:
        log.warning("%s (an AUC needs positives and negatives)", "; ".join(problems))


def train(
    config: Config | Mapping[str, Any] | None = None,
    *,
    save: bool = True,
    on_eval: Callable[[dict], None] | None = None,
) -> RunResult:
    """Train a federation on the dataset the config names; see :func:`fdam_ray.recipe.run`."""
    return run(_config(config), save=save, on_eval=on_eval)


def train_arrays(
    config: Config | Mapping[str, Any] | None,
    clients: Sequence[ArrayPair],
    test: ArrayPair | None,
    *,
    client_tests: Sequence[ArrayPair] | None = None,
    save: bool = False,
    on_eval: Callable[[dict], None] | None = None,
) -> RunResult:
    """Train on in-memory data: one ``(X_k, y_k)`` pair per client and a test set ``(X, y)``.

    ``y`` holds 0 (negative), 1 (positive) or NaN (missing), of shape (n,) or
    (n, T) for T tasks. ``num_clients`` is taken from ``len(clients)``. Set
    ``batch_size`` to 0 (or "full") for full-batch, sampling-free, deterministic
    gradients. ``client_tests`` adds each client's own test split and a
    per-client AUC to the history.

    Returns:
        :class:`RunResult` with the final ``model_state`` (a ``state_dict``), ``a``,
        ``b``, ``alpha``, the global ``control_variates`` (or None) and ``history``.
    """
    source = ArraysSource(clients, test, client_tests)
    cfg = _config(config, dataset="arrays", num_clients=len(clients))
    warn_one_class(source)
    return run(cfg, source=source, save=save, on_eval=on_eval)
