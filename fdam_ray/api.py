"""The Python entry points: [`train`][fdam_ray.api.train] (a dataset by name),
[`train_arrays`][fdam_ray.api.train_arrays] (your own arrays) and [`train_datasets`][fdam_ray.api.train_datasets] (your
own torch Datasets)."""

from __future__ import annotations

import logging
import os
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from fdam_ray.assembly.recipe import run
from fdam_ray.assembly.weights import is_state_dict, misfits, not_a_state_dict
from fdam_ray.config import FIELD_BY_NAME, Config, build_config
from fdam_ray.data import make_source
from fdam_ray.data.arrays import ArrayPair, ArraysSource
from fdam_ray.data.datasets import DatasetsSource, Entry
from fdam_ray.data.sections import DATASET_NAMES
from fdam_ray.features.sites import client_label
from fdam_ray.files.torchload import safe_load, torch_load_failure, value_problems
from fdam_ray.files.yamlfile import read_yaml_file
from fdam_ray.loop.evaluation import one_class_problems
from fdam_ray.loop.summary import RunResult
from fdam_ray.models import (
    BUILDERS,
    MAX_TASKS,
    NetworkRecord,
    build_model,
    layout,
    model_name,
    read_network_record,
    record_problem,
)
from fdam_ray.settings.factories import PYTHON_PREFIX, is_import_path
from fdam_ray.settings.redact import short

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
    """Train a federation on the dataset the config names; see
    [`fdam_ray.assembly.recipe.run`][fdam_ray.assembly.recipe.run].

    Args:
        config: a [`Config`][fdam_ray.config.Config], or a mapping of field names to values (validated by
            [`build_config`][fdam_ray.config.build_config]); None: every default (the ``fdam train`` job).
        model: sets the config's ``model``: a built-in name, an import path ``module:attr``, or your own
            factory ``(input_shape, num_tasks) -> nn.Module`` (docs/tutorials/own-data.md). A factory that
            can be imported by name is recorded by its path; any other (a lambda, a local function, one of the
            ``__main__`` script) travels to the clients by value, and resuming its run needs it given again.
        save: write a run folder under the config's ``out_dir``.
        on_eval: called with every evaluation record as it is made.
        progress: show the run as ``fdam train`` does (a bar on stderr, a line per evaluation on stdout);
            None (the default) shows it when stderr is a terminal.

    Returns:
        The finished run: its final model, history and summary, and its run folder.

    Raises:
        ValueError: one line naming a bad field or value (a [`ConfigError`][fdam_ray.config.ConfigError]), or
            data that cannot be trained on, before anything is written.
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
    gradients. A run saved with ``save=True`` resumes from Python with the same arrays:
    ``fdam_ray.resume(run_dir, source=ArraysSource(clients, test, client_tests))``
    (``fdam_ray.data.arrays``).

    Args:
        config: the run's fields, as for [`train`][fdam_ray.api.train].
        clients: one ``(X_k, y_k)`` pair of arrays per client.
        test: the pooled test set ``(X, y)``, or None when ``client_tests`` are the test set.
        client_tests: each client's own test split, which adds a per-client AUC to the history.
        model: as for [`train`][fdam_ray.api.train].
        save: write a run folder under the config's ``out_dir`` (off by default).
        on_eval: called with every evaluation record as it is made.
        progress: as for [`train`][fdam_ray.api.train].

    Returns:
        The final ``model_state`` (a ``state_dict``), ``a``, ``b``, ``alpha``, the global
        ``control_variates`` (or None), ``history`` and ``summary``.
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

    Items are ``(x, y)`` with ``x`` a tensor or array and ``y`` 0, 1 or NaN (missing), of shape () or
    (T,) for T tasks; each client reads and checks its labels in one pass over
    its Dataset. Batches are read by a DataLoader with ``data_workers``
    processes; ``batch_size`` 0 (full batch) is not available. ``num_clients``
    is taken from ``len(clients)``. A saved run resumes from Python with the same Datasets:
    ``fdam_ray.resume(run_dir, source=DatasetsSource(clients, test, client_tests))``
    (``fdam_ray.data.datasets``).

    Args:
        config: the run's fields, as for [`train`][fdam_ray.api.train].
        clients: one entry per client: a ``torch.utils.data.Dataset`` or a picklable callable
            ``() -> Dataset`` that builds the client's Dataset where the client runs (under Ray on its own
            actor, so the driver never reads that site's data).
        test: the pooled test set: a Dataset, such a callable, or None.
        client_tests: each client's own test split (a Dataset, a callable, or None), which adds per-client
            AUCs.
        model: as for [`train`][fdam_ray.api.train].
        save: write a run folder, as [`train`][fdam_ray.api.train] does; None (the default) writes one
            when the config names where (``run_name`` or ``out_dir``), else none.
        on_eval: called with every evaluation record as it is made.
        progress: as for [`train`][fdam_ray.api.train].

    Returns:
        The finished run, as [`train_arrays`][fdam_ray.api.train_arrays] returns it.
    """
    cfg = _config(config, **_with_model({"dataset": "datasets", "num_clients": len(clients)}, model))
    source = DatasetsSource(clients, test, client_tests, data_workers=cfg.data_workers)
    return run(cfg, source=source, save=names_a_run_folder(cfg) if save is None else save,
               **_shown(progress, on_eval))


def names_a_run_folder(config: Config) -> bool:
    """Whether ``config`` says where a run folder goes: it names ``run_name`` or ``out_dir`` (given explicitly,
    whatever the value, the default's included), or holds values other than their defaults."""
    return (any(config.names(f) for f in ("run_name", "out_dir")) or config.run_name is not None
            or config.out_dir != FIELD_BY_NAME["out_dir"].default)


def load_model(run_dir: str | Path, *, best: bool = False, model: str | Callable | None = None) -> nn.Module:
    """The network a finished run trained, rebuilt and loaded, on CPU in eval mode: ``net(x)`` gives its (B, T)
    logits, as the run's final global model did.

    The network is built as the run built it: the model fields that ``model.pt`` records (the model's name or
    factory ``module:attr``, ``model_width``, the input shape and task count of the run's data), or, for a
    ``model.pt`` written before that record, those of the run's ``config.yaml`` and its built-in dataset.

    A run folder does not choose code to run: a built-in network (``linear``, ``mlp``, ``cnn``, ``resnet20``,
    ``densenet121``, ``densenet161``) is built by its name; a run's own factory only when you give it as
    ``model``, either the factory itself or its import path ``module:attr`` (which is then imported), and only
    when that is the name the run recorded. A file that records any other name imports and calls nothing. Nor
    does it choose sizes: the record is checked before anything is built (integers; an input of 1 to
    `MAX_INPUT_DIMS` dimensions and at most `MAX_INPUT_VALUES`
    values, ``model_width`` and ``num_tasks`` at most 65536), and a built-in network is first laid out
    without memory (torch's meta device) and must match the file's weights key for key and shape for shape,
    so what is built is never larger than the weights the file holds.

    Args:
        run_dir: the run folder.
        best: load ``best_model.pt`` (the model a validation split selected) instead of ``model.pt``.
        model: the model factory of a run that was given one (the callable, or its import path ``module:attr``;
            it must have the name the run recorded), or the built-in name the run recorded.

    Returns:
        The network, on CPU in eval mode, with the run's weights loaded.

    Raises:
        ValueError: one line naming the folder or file and what is wrong (not a finished run, no best model,
            a file that is not a regular file, a damaged record naming its key, a factory not given or that
            cannot be imported, sizes out of bounds, weights that do not fit the network).
    """
    if not isinstance(run_dir, (str, os.PathLike)):
        raise ValueError(f"load_model: run_dir {short(run_dir)} is not allowed (the path of a run folder)")
    folder = Path(run_dir).expanduser()
    file = _model_file(folder, "best_model.pt" if best else "model.pt")
    payload = _read_model_file(file)
    record, recorded_in = _network_of(folder, file, payload, best=best)
    factory = _chosen_factory(record.model, model, recorded_in, folder)
    state = payload["model"]
    if isinstance(factory, str) and factory in BUILDERS:
        try:
            own = layout(factory, record.input_shape, record.num_tasks, width=record.model_width)
        except ValueError as exc:
            raise ValueError(f"load_model: '{file}': {exc}") from None
        problems = misfits(own, state)
        if problems:
            raise ValueError(f"load_model: '{file}' does not fit the network {record.model!r} it records: "
                             + "; ".join(problems))
    try:
        net = build_model(factory, record.input_shape, record.num_tasks, width=record.model_width,
                          seed=record.seed)
    except ValueError as exc:
        raise ValueError(f"load_model: '{file}': {exc}") from None
    if bad := value_problems(net.state_dict(), state):
        raise ValueError(f"load_model: '{file}' holds entries of the wrong kind or not finite: " + "; ".join(bad[:8])
                         + (f" and {len(bad) - 8} more" if len(bad) > 8 else ""))
    try:
        net.load_state_dict(state)
    except (RuntimeError, KeyError, TypeError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"load_model: '{file}' does not fit the network {record.model!r} it records: "
                         f"{first[:200]}") from None
    return net.eval()


def _model_file(folder: Path, name: str) -> Path:
    """``folder / name`` when it is a regular file (or a link to one); else one line saying what it is."""
    file = folder / name
    try:
        mode = file.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        if file.is_symlink():
            raise ValueError(f"load_model: '{file}' is a broken link, not a model file") from None
        raise ValueError(_missing_model(folder, name)) from None
    except (OSError, ValueError) as exc:  # no permission, a link loop, a name too long, a NUL character
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"load_model: '{short(str(file), 300)}' cannot be read: {short(why, 200)}") from None
    if stat.S_ISREG(mode):
        return file
    kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a device, pipe or socket)"
    raise ValueError(f"load_model: '{file}' is {kind}, not a model file (a run writes {name} as a file, with "
                     "torch.save)")


def _missing_model(folder: Path, name: str) -> str:
    if folder.is_file():
        return f"load_model: '{folder}' is a file, not a run folder (give the folder that holds {name})"
    if not folder.is_dir():
        return f"load_model: '{folder}' is not a run folder"
    if name == "best_model.pt":
        return (f"load_model: '{folder}' has no best_model.pt (a run writes it when it selects on a validation "
                "split); load its final model with best=False")
    return f"load_model: '{folder}' has no model.pt (its run has not finished; resume it to the end first)"


def _read_model_file(file: Path) -> dict[str, Any]:
    """The payload of a model file, its ``model`` (a state_dict) and ``task_names`` (when present) checked."""
    try:
        payload = safe_load(file)
    except Exception as exc:  # torch raises several kinds; all mean "not a model file"
        raise ValueError(f"load_model: '{file}' cannot be read: {torch_load_failure(exc)}") from None
    if not isinstance(payload, dict) or "model" not in payload:
        raise ValueError(f"load_model: '{file}' is not a run's model file (no state_dict under 'model')")
    if not is_state_dict(payload["model"]):
        raise ValueError(f"load_model: '{file}': 'model' is not a state_dict (a non-empty mapping of parameter "
                         f"names to tensors): {not_a_state_dict(payload['model'])}")
    names = payload.get("task_names")
    if names is not None and not (isinstance(names, list) and 1 <= len(names) <= MAX_TASKS
                                  and all(isinstance(n, str) for n in names)):
        shown = " ".join(short(names).split())
        raise ValueError(f"load_model: '{file}': 'task_names' {shown} is not allowed (a list of 1 to {MAX_TASKS} "
                         "task names)")
    return payload


def _network_of(folder: Path, file: Path, payload: Mapping[str, Any], *, best: bool) -> tuple[NetworkRecord, Path]:
    """The network ``file`` records, checked, and the file that records it: for a ``best_model.pt`` without
    one, the run's ``model.pt``; for a model file written before that record, the run's ``config.yaml``."""
    if "network" in payload:
        return read_network_record(payload["network"], f"load_model: '{file}': 'network'", defaults=_OLDER), file
    final = folder / "model.pt"
    if best and (final.exists() or final.is_symlink()):
        final_payload = _read_model_file(_model_file(folder, "model.pt"))
        if "network" in final_payload:
            return read_network_record(final_payload["network"], f"load_model: '{final}': 'network'",
                                       defaults=_OLDER), final
    return _network_of_config(folder, file, payload), folder / "config.yaml"


_OLDER = {"seed": 0}  # what a network record written before it held a key means by its absence


def _network_of_config(folder: Path, file: Path, payload: Mapping[str, Any]) -> NetworkRecord:
    """The network of a model file written before it recorded one: the model fields of the run's
    ``config.yaml``, the input shape of its built-in dataset (a dataset given in Python, or a factory of your own,
    which is not imported on a file's word, has none to read)."""
    config_file = folder / "config.yaml"
    where = f"load_model: '{config_file}'"
    try:
        recorded = read_yaml_file(config_file, "run config")
    except ValueError as exc:
        raise ValueError(f"load_model: '{file}' records no network, and {exc}") from None
    if not isinstance(recorded, dict) or "model" not in recorded:
        raise ValueError(f"{where} is not a run config naming its 'model' (and '{file}' records no network)")
    problem = record_problem("model", recorded["model"])
    if problem:
        raise ValueError(f"{where} key 'model': {short(recorded['model'])} is not allowed ({problem})")
    dataset = recorded.get("dataset", FIELD_BY_NAME["dataset"].default)
    if not isinstance(dataset, str) or dataset not in DATASET_NAMES:
        raise ValueError(f"{where} key 'dataset': {short(dataset)} is not allowed (a built-in dataset, whose input "
                         f"shape '{file}', which records no network, is built for; a dataset factory named in a "
                         "file is not imported)")
    try:
        config = build_config({**recorded, "model": "linear"})  # the model is read as recorded, below
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    try:
        source = make_source(config, executor=config.executor, address=config.address)
        input_shape, num_tasks = source.input_shape, source.num_tasks
    except Exception as exc:  # a data source that cannot be rebuilt here (a dataset given in Python, no data)
        why = short(" ".join(str(exc).split()), 200)
        raise ValueError(f"load_model: '{file}' does not record its network, and the input shape of its dataset "
                         f"{short(dataset)} cannot be read ({type(exc).__name__}: {why})") from None
    network = {"model": recorded["model"], "model_width": config.model_width, "seed": config.seed,
               "input_shape": list(input_shape), "num_tasks": len(payload.get("task_names") or []) or num_tasks}
    return read_network_record(network, where)


def _chosen_factory(recorded: str, model: str | Callable | None, file: Path, folder: Path) -> str | Callable:
    """What builds the network: the caller's ``model`` when it has the recorded name, else a built-in name;
    never code that only the file names."""
    if model is not None:
        if not (callable(model) or (isinstance(model, str) and (model in BUILDERS or is_import_path(model)))):
            raise ValueError(f"load_model('{folder}'): model={short(model)} is not allowed (the run's model "
                             "factory, its import path module:attr, or a built-in model name)")
        given = model_name(model)
        if given != recorded:
            raise ValueError(f"load_model: '{file}' holds model {recorded!r}, not {given!r}")
        return model
    if recorded in BUILDERS:
        return recorded
    if recorded.startswith(PYTHON_PREFIX):
        raise ValueError(f"load_model: '{folder}' was trained with a model factory given in Python ({recorded}), "
                         "which cannot be imported by that name; give it again: "
                         f"fdam_ray.load_model('{folder}', model=<that factory>)")
    raise ValueError(f"load_model: '{file}' records the model factory {recorded!r}, and a model file does not "
                     "choose code to run: give the factory, fdam_ray.load_model("
                     f"'{folder}', model=<that factory>), or model={recorded!r} to have it imported")
