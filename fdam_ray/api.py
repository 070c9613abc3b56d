"""The Python entry points: :func:`train` (a dataset by name), :func:`train_arrays` (your own arrays) and
:func:`train_datasets` (your own torch Datasets)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from fdam_ray.config import FIELD_BY_NAME, Config, build_config
from fdam_ray.data import make_source
from fdam_ray.data.arrays import ArrayPair, ArraysSource
from fdam_ray.data.datasets import DatasetsSource, Entry
from fdam_ray.evaluation import one_class_problems
from fdam_ray.factories import PYTHON_PREFIX
from fdam_ray.federation import RunResult
from fdam_ray.models import build_model, model_name
from fdam_ray.recipe import run
from fdam_ray.sites import client_label
from fdam_ray.weights import safe_load, torch_load_failure
from fdam_ray.yamlio import read_yaml_file

log = logging.getLogger(__name__)


def _config(config: Config | Mapping[str, Any] | None, **overrides: Any) -> Config:
    if isinstance(config, Config):
        return config.replace(**overrides) if overrides else config
    return build_config(dict(config or {}), **overrides)


def warn_one_class(source: ArraysSource, client_names: Sequence[str] | None = None) -> None:
    """One warning naming every test set (``test``, ``client_tests[k]``) that holds one class only for a task:
    the AUC it gives is NaN, since an AUC compares positives with negatives. Given before the run; the run's
    evaluations then do not warn again (other sources are warned about on their first evaluation)."""
    sets = ([("test", source.test[1], "the pooled test AUC")] if source.test is not None else []) + [
        (f"client_tests[{k}]", pair[1], f"client {client_label(k, client_names)}'s AUC")
        for k, pair in sorted((source.tests or {}).items())]
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
    warn_one_class(source, cfg.client_names)
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


def load_model(run_dir: str | Path, *, best: bool = False, model: Callable | None = None) -> nn.Module:
    """The network a finished run trained, rebuilt and loaded, on CPU in eval mode: ``net(x)`` gives its (B, T)
    logits, as the run's final global model did.

    The network is built as the run built it: the model fields that ``model.pt`` records (the model's name or
    factory ``module:attr``, ``model_width``, the input shape and task count of the run's data), or, for a
    ``model.pt`` written before that record, those of the run's ``config.yaml`` and its dataset. A factory given
    in Python that cannot be imported by name (recorded as ``python:...``) must be given again as ``model``.

    Args:
        run_dir: the run folder.
        best: load ``best_model.pt`` (the model a validation split selected) instead of ``model.pt``.
        model: the model factory of a run that was given one in Python (it must have the name the run recorded).

    Raises:
        ValueError: one line naming the folder or file and what is wrong (not a finished run, no best model,
            a factory that cannot be imported, weights that do not fit the network).
    """
    folder = Path(run_dir).expanduser()
    name = "best_model.pt" if best else "model.pt"
    file = folder / name
    if not file.is_file():
        raise ValueError(_missing_model(folder, name))
    payload = _read_model_file(file)
    network = payload.get("network") if isinstance(payload.get("network"), Mapping) else None
    if network is None and best and (folder / "model.pt").is_file():
        network = _read_model_file(folder / "model.pt").get("network")
    if not isinstance(network, Mapping):
        network = _network_of_config(folder, payload)
    recorded = str(network["model"])
    factory: str | Callable = recorded
    if model is not None:
        if model_name(model) != recorded:
            raise ValueError(f"load_model: '{folder}' holds model {recorded!r}, not {model_name(model)!r}")
        factory = model
    elif recorded.startswith(PYTHON_PREFIX):
        raise ValueError(f"load_model: '{folder}' was trained with a model factory given in Python ({recorded}), "
                         "which cannot be imported by that name; give it again: "
                         f"fdam_ray.load_model('{folder}', model=<that factory>)")
    try:
        net = build_model(factory, tuple(network["input_shape"]), int(network["num_tasks"]),
                          width=int(network["model_width"]), seed=int(network.get("seed", 0)))
    except ValueError as exc:
        raise ValueError(f"load_model: '{folder}': {exc}") from None
    try:
        net.load_state_dict(payload["model"])
    except (RuntimeError, KeyError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"load_model: '{file}' does not fit the network {recorded!r} it records: {first[:200]}"
                         ) from None
    return net.eval()


def _missing_model(folder: Path, name: str) -> str:
    if not folder.is_dir():
        return f"load_model: '{folder}' is not a run folder"
    if name == "best_model.pt":
        return (f"load_model: '{folder}' has no best_model.pt (a run writes it when it selects on a validation "
                "split); load its final model with best=False")
    return f"load_model: '{folder}' has no model.pt (its run has not finished; resume it to the end first)"


def _read_model_file(file: Path) -> dict[str, Any]:
    try:
        payload = safe_load(file)
    except Exception as exc:  # torch raises several kinds; all mean "not a model file"
        raise ValueError(f"load_model: '{file}' cannot be read: {torch_load_failure(exc)}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("model"), Mapping):
        raise ValueError(f"load_model: '{file}' is not a run's model file (no state_dict under 'model')")
    return payload


def _network_of_config(folder: Path, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The network of a ``model.pt`` written before it recorded one: the model fields of the run's
    ``config.yaml``, the input shape of its dataset (a dataset given in Python has none to read)."""
    recorded = read_yaml_file(folder / "config.yaml", "run config")
    if not isinstance(recorded, dict) or "model" not in recorded:
        raise ValueError(f"load_model: '{folder}' has no config.yaml naming its model")
    try:
        config = build_config({**recorded, "model": "linear"})  # the model is read as recorded, below
        source = make_source(config)
        input_shape, num_tasks = source.input_shape, source.num_tasks
    except Exception as exc:  # a config or data source of its own that cannot be rebuilt here
        raise ValueError(f"load_model: the model.pt of '{folder}' does not record its network, and the input "
                         f"shape of its dataset {str(recorded.get('dataset'))!r} cannot be read "
                         f"({type(exc).__name__}: {str(exc)[:200]})") from None
    return {"model": recorded["model"], "model_width": config.model_width, "seed": config.seed,
            "input_shape": list(input_shape), "num_tasks": len(payload.get("task_names") or []) or num_tasks}
