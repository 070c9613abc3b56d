"""The consortium's Flower ServerApp: fdam-ray's federation loop, with the sites reached through Flower.

The run config of ``flwr run`` names the config file (``config``), the same
file a Ray simulation of the study reads, plus its ``flower:`` section
(:mod:`.section`); ``result`` optionally names an ``.npz`` file the final
global state and history are written to.
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
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fdam_ray.algorithms import AlgorithmSection
from fdam_ray.config import build_config, load_config_file
from fdam_ray.data import DataSource
from fdam_ray.data.base import Shard, Split, as_labels
from fdam_ray.executors.base import ExecutorSection
from fdam_ray.executors.inline import inline_threads
from fdam_ray.flower import records, secagg
from fdam_ray.flower.executor import FlowerExecutor, SiteShapes
from fdam_ray.flower.section import split_config
from fdam_ray.loop.client import resolve_device
from fdam_ray.loop.federation import Federation, RunResult
from fdam_ray.loop.schedules import ScheduleSection
from fdam_ray.outputs import Observer, Observers, RunFolder
from fdam_ray.privacy.driver import TrainSizesElsewhere

log = logging.getLogger(__name__)

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
                   observers: tuple[Observer, ...] = ()) -> RunResult:
    """Run the federation one config mapping describes (fdam-ray fields plus a ``flower:`` section) over ``grid``."""
    fields, flower = split_config(values)
    config = build_config({**fields, "dataset": "arrays"})
    executor = FlowerExecutor(grid, flower, run_key=str(context.run_id), num_sites=config.num_clients)
    if flower.secagg:
        secagg.enable(executor, context)
    shapes = executor.connect()
    threads = inline_threads(ExecutorSection.of(config))
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    outputs: list[Observer] = [RunFolder(config)] if save else []
    try:
        source = ServerSource(config.num_clients, shapes, flower.test_data,
                              sizes=lambda: executor.train_sizes(records.to_json(config.to_dict())))
        fed = Federation(source=source, executor=executor,
                         config=config, algorithm=AlgorithmSection.of(config), schedule=ScheduleSection.of(config),
                         eval_every=config.eval_every, driver_device=resolve_device(config.device),
                         observer=Observers([*outputs, *observers]))
        result = fed.run()
    finally:
        torch.set_num_threads(before)
    result.config = config
    return result


def write_result(result: RunResult, path: str | Path) -> None:
    """The final global state (its vectors) and the history, for whoever started the run."""
    arrays: dict[str, Any] = {k: v for k, v in result.state.vectors().items() if v is not None}
    arrays["history"] = np.array(json.dumps(result.history, default=str))
    np.savez(path, **arrays)


@app.main()
def main(grid: Grid, context: Context) -> None:
    path = str(context.run_config["config"])
    result = run_federation(grid, context, load_config_file(path))
    log.info("final test AUC %.4f", result.summary["final_test_auc"])
    out = context.run_config.get("result")
    if out:
        write_result(result, str(out))
