"""The Python entry points: :func:`train` (a dataset by name), :func:`train_arrays` (your own arrays) and
:func:`train_datasets` (your own torch Datasets)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fdam_ray.config import FIELD_BY_NAME, Config, build_config
from fdam_ray.data.arrays import ArrayPair, ArraysSource
from fdam_ray.data.datasets import DatasetsSource, Entry
from fdam_ray.evaluation import one_class_problems
from fdam_ray.federation import RunResult
from fdam_ray.recipe import run

log = logging.getLogger(__name__)


def _config(config: Config | Mapping[str, Any] | None, **overrides: Any) -> Config:
    if isinstance(config, Config):
        return config.replace(**overrides) if overrides else config
    return build_config(dict(config or {}), **overrides)


def warn_one_class(source: ArraysSource) -> None:
    """One warning naming every test set (``test``, ``client_tests[k]``) that holds one class only for a task:
    the AUC it gives is NaN, since an AUC compares positives with negatives. Given before the run; the run's
    evaluations then do not warn again (other sources are warned about on their first evaluation)."""
    sets = ([("test", source.test[1], "the pooled test AUC")] if source.test is not None else []) + [
        (f"client_tests[{k}]", pair[1], f"client {k}'s AUC") for k, pair in sorted((source.tests or {}).items())]
    problems = one_class_problems(sets, source.task_names)
    if problems:
        log.warning("%s (an AUC needs positives and negatives)", "; ".join(problems))
    source.one_class_warned = True


def _with_model(overrides: dict[str, Any], model: str | Callable | None) -> dict[str, Any]:
    return overrides if model is None else {**overrides, "model": model}


def _shown(progress: bool | None, on_eval: Callable[[dict], None] | None) -> dict[str, Any]:
    """``run``'s ``progress`` and ``on_eval`` for a ``progress`` argument: as ``fdam train`` shows a run, the
    bar on stderr and a line per evaluation on stdout (fitted to the terminal); None: when stderr is a
    terminal (a script run from a shell shows progress, one whose output goes to a file or a notebook does
    not: pass True there)."""
    shown = sys.stderr.isatty() if progress is None else bool(progress)
    if not shown:
        return {"progress": False, "on_eval": on_eval}
    from fdam_ray.outputs.progress import write_evaluation

    def show_and_call(record: dict) -> None:
        write_evaluation(record)
        if on_eval is not None:
            on_eval(record)

    return {"progress": True, "on_eval": show_and_call}


def train(
    config: Config | Mapping[str, Any] | None = None,
    *,
    model: str | Callable | None = None,
    save: bool = True,
    on_eval: Callable[[dict], None] | None = None,
    progress: bool | None = None,
) -> RunResult:
    """Train a federation on the dataset the config names; see :func:`fdam_ray.recipe.run`.

    ``model`` sets the config's ``model``: a built-in name, an import path ``module:attr``, or your own
    factory ``(input_shape, num_tasks) -> nn.Module`` (README, "Your own model and data"). A factory that
    can be imported by name is recorded by its path; any other (a lambda, a local function, one of the
    ``__main__`` script) travels to the clients by value, and resuming its run needs it given again.
    ``progress``: show the run as ``fdam train`` does (a bar on stderr, a line per evaluation on stdout);
    None (the default) shows it when stderr is a terminal.
    """
    return run(_config(config, **_with_model({}, model)), save=save, **_shown(progress, on_eval))


def train_arrays(
    config: Config | Mapping[str, Any] | None,
    clients: Sequence[ArrayPair],
    test: ArrayPair | None,
    *,
    client_tests: Sequence[ArrayPair] | None = None,
    model: str | Callable | None = None,
    save: bool = False,
    on_eval: Callable[[dict], None] | None = None,
    progress: bool | None = None,
) -> RunResult:
    """Train on in-memory data: one ``(X_k, y_k)`` pair per client and a test set ``(X, y)``.

    ``y`` holds 0 (negative), 1 (positive) or NaN (missing), of shape (n,) or
    (n, T) for T tasks. ``num_clients`` is taken from ``len(clients)``. Set
    ``batch_size`` to 0 (or "full") for full-batch, sampling-free, deterministic
    gradients. ``client_tests`` adds each client's own test split and a
    per-client AUC to the history. ``model`` and ``progress`` as for :func:`train`.

    Returns:
        :class:`RunResult` with the final ``model_state`` (a ``state_dict``), ``a``,
        ``b``, ``alpha``, the global ``control_variates`` (or None) and ``history``.
    """
    source = ArraysSource(clients, test, client_tests)
    cfg = _config(config, **_with_model({"dataset": "arrays", "num_clients": len(clients)}, model))
    warn_one_class(source)
    return run(cfg, source=source, save=save, **_shown(progress, on_eval))


def train_datasets(
    config: Config | Mapping[str, Any] | None,
    clients: Sequence[Entry],
    test: Entry | None,
    *,
    client_tests: Sequence[Entry | None] | None = None,
    model: str | Callable | None = None,
    save: bool | None = None,
    on_eval: Callable[[dict], None] | None = None,
    progress: bool | None = None,
) -> RunResult:
    """Train on your own torch Datasets: one entry per client and a test set.

    Each entry of ``clients`` is a ``torch.utils.data.Dataset`` or a picklable
    callable ``() -> Dataset`` that builds the client's Dataset where the client
    runs (under Ray on its own actor, so the driver never reads that site's
    data). ``test`` (and each of ``client_tests``, which adds per-client test
    splits and AUCs) is a Dataset, such a callable, or None. Items are ``(x, y)``
    with ``x`` a tensor or array and ``y`` 0, 1 or NaN (missing), of shape () or
    (T,) for T tasks; each client reads and checks its labels in one pass over
    its Dataset. Batches are read by a DataLoader with ``data_workers``
    processes; ``batch_size`` 0 (full batch) is not available. ``num_clients``
    is taken from ``len(clients)``; ``model`` and ``progress`` as for :func:`train`. ``save``:
    write a run folder, as :func:`train` does; None (the default) writes one
    when the config names where (``run_name`` or ``out_dir``), else none.

    Returns:
        :class:`RunResult`, as :func:`train_arrays`.
    """
    cfg = _config(config, **_with_model({"dataset": "datasets", "num_clients": len(clients)}, model))
    source = DatasetsSource(clients, test, client_tests, data_workers=cfg.data_workers)
    return run(cfg, source=source, save=names_a_run_folder(cfg) if save is None else save,
               **_shown(progress, on_eval))


def names_a_run_folder(config: Config) -> bool:
    """Whether ``config`` says where a run folder goes (a ``run_name``, or an ``out_dir`` of its own)."""
    return config.run_name is not None or config.out_dir != FIELD_BY_NAME["out_dir"].default
