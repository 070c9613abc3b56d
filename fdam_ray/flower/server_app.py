"""The consortium's Flower ServerApp: fdam-ray's federation loop, with the sites reached through Flower.

The run config of ``flwr run`` carries the study:

- ``study``: the config's text (YAML, or JSON), the same config a Ray simulation of the study reads, plus its
  ``flower:`` section (:mod:`.section`); the server checks it with :func:`~fdam_ray.config.build_config` and never
  reads a study from its own disk. (``config``, the path of a config file on the SuperLink host, is the form a
  consortium on one machine may use instead; exactly one of the two.)
- ``run-dir``: the run folder on the SuperLink host (:mod:`.server_folder`): metrics, summary, model,
  checkpoints, trackers. When it holds a checkpoint, the study continues from it. Empty: a new folder under the
  config's ``out_dir`` (named ``run_name`` when set).
- ``result``: optionally an ``.npz`` file the final global state and history are written to.

The study's progress goes to the log Flower shows (``flwr log``, the SuperLink's journal): one line per evaluation
(round, iteration, test AUC, and epsilon under dp) and per stage switch (:class:`FlowerLog`). A study fdam-ray
stops on purpose (a config it refuses, a site refused or silent: one line each) is logged as that line, without
the traceback Flower prints for an app's exception (:func:`quiet_refusals`).
"""

from __future__ import annotations

from fdam_ray.flower import needs_flower  # noqa: F401 (first: without Flower, says what to install)

# isort: split
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fdam_ray.algorithms import AlgorithmSection, build_algorithm
from fdam_ray.assembly.cuts import federation
from fdam_ray.checkpoint import check_fits
from fdam_ray.clients.client import resolve_device
from fdam_ray.config import ConfigError, build_config, load_config_file
from fdam_ray.data import DataSource
from fdam_ray.data.base import Shard, Split, as_labels
from fdam_ray.executors.base import ExecutorSection
from fdam_ray.executors.flower_section import split_config
from fdam_ray.executors.inline import inline_threads
from fdam_ray.flower import records, secagg, server_folder
from fdam_ray.flower.executor import SiteRefused, SiteShapes
from fdam_ray.loop.summary import RunResult
from fdam_ray.outputs import Observer, Observers, RunStart, Snapshot
from fdam_ray.outputs.trackers import check_usable as trackers_usable
from fdam_ray.privacy.driver import TrainSizesElsewhere
from fdam_ray.settings.yamlio import load_yaml

log = logging.getLogger(__name__)
FLOWER_LOG = logging.getLogger("flwr")  # the logger whose lines `flwr log` and the SuperLink's output show
ONE_LINE = (ConfigError, SiteRefused)  # fdam-ray's refusals: their message is the whole story


class FlowerLog(Observer):
    """The study's progress in Flower's log: one line per evaluation and per stage switch."""

    def __init__(self) -> None:
        self.iterations = 0

    def start(self, run: RunStart) -> None:
        self.iterations = run.iterations
        FLOWER_LOG.info("fdam-ray: %s at round %d, iteration %d of %d", "resumed" if run.resumed else "started",
                        run.round, run.iteration, run.iterations)

    def record(self, record: dict, snapshot: Snapshot) -> None:
        dp = record.get("dp_epsilon")
        FLOWER_LOG.info("fdam-ray: round %d, iteration %d of %d: test AUC %.4f%s", record["round"],
                        record["iteration"], self.iterations, record["test_auc"],
                        "" if dp is None else f", epsilon {dp:.4g} (delta {record.get('dp_delta', 0):g})")

    def event(self, message: str, *args: object, level: int = logging.INFO) -> None:
        FLOWER_LOG.log(level, "fdam-ray: " + message, *args)


class _OneLine(logging.Filter):
    """Flower logs an exception that ends a ServerApp with its traceback; one of fdam-ray's refusals keeps its
    line only (the reason is in it; a traceback would bury it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ONE_LINE):
            record.msg, record.args, record.exc_info, record.exc_text = "ServerApp stopped: %s", (str(exc),), None, None
        return True


def quiet_refusals() -> None:
    """Install :class:`_OneLine` on Flower's logger (once)."""
    if not any(isinstance(f, _OneLine) for f in FLOWER_LOG.filters):
        FLOWER_LOG.addFilter(_OneLine())

app = ServerApp()


class ServerSource(DataSource, TrainSizesElsewhere):
    """What the server knows of the data: the sites' sample shape and tasks, and its own test set if it has one.
    It holds no site's training data; ``sizes`` asks the sites for their n_k (dp: sample with a dp_epsilon target
    solves sigma for them before the start)."""

    def __init__(self, num_clients: int, shapes: SiteShapes, test_data: str | None,
                 sizes: Callable[[], list[int]] | None = None) -> None:
        self.sizes = sizes
        self.num_clients = num_clients
        self.input_shape = shapes.input_shape
        self.num_tasks = shapes.num_tasks
        self.task_names = shapes.task_names
        self.test_data = test_data

    def client_shard(self, client_id: int) -> Shard:
        raise ValueError("the server holds no site's data")

    def train_sizes(self) -> list[int]:
        if self.sizes is None:
            raise ValueError("the server holds no site's data and was given no way to ask the sites' sizes")
        return self.sizes()

    def test_set(self) -> Split | None:
        if self.test_data is None:
            return None
        with np.load(self.test_data, allow_pickle=False) as npz:
            x = torch.from_numpy(np.ascontiguousarray(npz["x"], dtype=np.float32))
            return Split(x, as_labels(npz["y"], what=f"flower.test_data '{self.test_data}'"))


def run_federation(grid: Grid, context: Context, values: Mapping[str, Any], *, save: bool = False,
                   run_dir: str | Path | None = None, observers: tuple[Observer, ...] = ()) -> RunResult:
    """Run the federation one config mapping describes (fdam-ray fields plus a ``flower:`` section) over ``grid``.

    ``save`` writes the run folder (``run_dir``, else a new one under the config's ``out_dir``); a ``run_dir``
    that holds a checkpoint continues its study from it (:mod:`.server_folder`)."""
    fields, flower = split_config(values)
    config = build_config({"dataset": "arrays", **fields})  # the sites hold the data, whatever the study names
    flower.check_sites(config.num_clients)
    folder = None if run_dir in (None, "") else Path(str(run_dir)).expanduser()
    save = save or folder is not None
    resume = None if folder is None else server_folder.resume_point(folder, config)
    if folder is not None and resume is not None:
        done = server_folder.finished_result(folder, resume, config)
        if done is not None:
            return done
    if save:
        trackers_usable(config.trackers)  # before any site is asked anything
    kept = None if resume is None else (resume.loop.transfer or {})[server_folder.SITES_KEY]
    # the sites' bindings to their nodes' keys live in the run folder: a resumed study keeps them
    executor = server_folder.ResumableExecutor(grid, flower, run_key=str(context.run_id),
                                               num_sites=config.num_clients, kept=kept, bindings_dir=folder)
    if flower.secagg:
        secagg.enable(executor, context, build_algorithm(AlgorithmSection.of(config)).drift)
    shapes = executor.connect()
    threads = inline_threads(ExecutorSection.of(config))
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    outputs = server_folder.outputs(config, folder, executor) if save else []
    try:
        source = ServerSource(config.num_clients, shapes, flower.test_data,
                              sizes=lambda: executor.train_sizes(records.to_json(config.to_dict())))
        fed = federation(config, source=source, executor=executor, driver_device=resolve_device(config.device),
                         observer=Observers([*outputs, *observers]))
        if resume is not None and folder is not None:  # an entry of another size or kind: a damaged file
            check_fits(resume, folder / "checkpoint.pt", fed.replica.flat.initial_state())
        result = fed.run(resume=resume)
    finally:
        torch.set_num_threads(before)
    result.config = config
    return result


def study_values(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The study the run config carries: ``study`` (the config's text) or ``config`` (a file's path on this
    host), exactly one; one line (:class:`~fdam_ray.config.ConfigError`) when it is neither or not a mapping."""
    text, path = str(run_config.get("study", "") or ""), str(run_config.get("config", "") or "")
    if bool(text.strip()) == bool(path):
        raise ConfigError("the run config must carry the study: study = its config's text (YAML or JSON), or config "
                          "= the path of a config file on the SuperLink host (one of the two, not "
                          f"{'both' if path else 'neither'})")
    if path:
        return load_config_file(path)
    try:
        values = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"the run config's study is not YAML or JSON ({str(exc).splitlines()[0][:200]})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"the run config's study must hold a mapping of field: value, not {type(values).__name__}")
    return values


def write_result(result: RunResult, path: str | Path) -> None:
    """The final global state (its vectors) and the history, for whoever started the run."""
    arrays: dict[str, Any] = {k: v for k, v in result.state.vectors().items() if v is not None}
    arrays["history"] = np.array(json.dumps(result.history, default=str))
    np.savez(path, **arrays)


@app.main()
def main(grid: Grid, context: Context) -> None:
    quiet_refusals()
    run = context.run_config
    result = run_federation(grid, context, study_values(run), save=True, run_dir=str(run.get("run-dir", "") or ""),
                            observers=(FlowerLog(),))
    FLOWER_LOG.info("fdam-ray: final test AUC %.4f; run folder %s (model.pt there)", result.summary["final_test_auc"],
                    result.run_dir)
    out = run.get("result")
    if out:
        write_result(result, str(out))
