"""The two-stage recipe of the paper's chest X-ray experiments (Sec. 5, after Yuan et al. 2021's DAM).

Stage 1 trains the network with binary cross-entropy: a ``fedavg`` federation
over every client, or, with ``pretrain_federated: false``, one client's data
alone (client 0; the paper pre-trains on CheXpert, one of its sources). Stage 2
discards the classifier head, re-initialises it, and runs the configured AUC
algorithm from the pre-trained body. Stage 1 is an ordinary federation with the
pre-training settings, assembled by :mod:`fdam_ray.assembly.recipe` like any other run,
so no training loop is duplicated; this module only says what stage 1 is. The
paper pre-trains with Adam (lr 1e-5, 2 epochs); here stage 1 takes the local
SGD steps of every other run (with the run's ``momentum``), or, with
``pretrain_optimizer: adam``, Adam's steps on each client (its moments are the
client's own, kept across rounds and checkpointed like a momentum buffer).

Each stage writes its own run folder (``<run_name>-pretrain``, then
``<run_name>``). Stage 1's folder also holds ``recipe.yaml``: the whole
two-stage run's config and, once stage 2 has made it, stage 2's folder. So
``fdam train --resume`` on stage 1's folder, the command a run stopped during
pre-training prints, continues the whole recipe: it finishes stage 1 and runs
(or continues) stage 2 from its body (:func:`fdam_ray.assembly.recipe.resume`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from fdam_ray.assembly.weights import head_keys
from fdam_ray.checkpoint import CheckpointError, write_atomically
from fdam_ray.core.schedules import ScheduleSection
from fdam_ray.core.state import RoundPlan
from fdam_ray.data import DataSource
from fdam_ray.executors.deadlines import ReplaySection, read_record
from fdam_ray.files.yamlfile import read_yaml_file
from fdam_ray.loop.pretrain_section import PretrainSection as PretrainSection  # the fields of stage 1
from fdam_ray.models import build_model
from fdam_ray.outputs.observer import Observer, RunStart, Snapshot

log = logging.getLogger(__name__)

RECIPE_FILE = "recipe.yaml"  # in stage 1's run folder: the whole run's config, and stage 2's folder
PROGRESS_EVERY_S = 30.0  # stage 1 logs where it is at most this often between its evaluations


class FirstClientSource(DataSource):
    """One client's data as a federation of one (the test set is the whole source's)."""

    def __init__(self, source: DataSource) -> None:
        self.source = source
        self.num_clients = 1
        self.num_tasks = source.num_tasks
        self.input_shape = source.input_shape
        self.task_names = source.task_names

    def client_shard(self, client_id: int):
        return self.source.client_shard(0)

    def test_set(self):
        return self.source.test_set()

    def for_client(self, client_id: int) -> DataSource:
        narrow = self.source.for_client(0)
        return self if narrow is self.source else FirstClientSource(narrow)


def pretrain_config(config):
    """The stage-1 config: BCE under fedavg (or centralized on one client), one stage at a constant lr.

    A ``participation_record`` is the record of one federation, replayed by stage 2 (the AUC run): stage 1 runs
    every client, and the record is checked against stage 2 here, before stage 1 starts.
    """
    if config.participation_record is not None:
        read_record(config.participation_record, ReplaySection.of(config), ScheduleSection.of(config))
    federated = config.pretrain_federated and config.num_clients > 1
    return config.replace(
        algorithm="fedavg" if federated else "centralized",
        objective="bce",
        num_clients=config.num_clients if federated else 1,
        iterations=config.pretrain_iterations,
        lr=config.pretrain_lr if config.pretrain_lr is not None else config.lr,
        batch_size=config.batch_size if config.pretrain_batch_size is None else config.pretrain_batch_size,
        prox_weight=0.0,
        global_lr=1.0,
        positive_ratio=None,
        schedule="stagewise",
        stage_length=config.pretrain_iterations,
        pretrain_iterations=0,
        local_optimizer=config.pretrain_optimizer,
        momentum=config.momentum if config.pretrain_optimizer == "sgd" else 0.0,
        run_name=None if config.run_name is None else f"{config.run_name}-pretrain",
        participation_record=None,
    )


def pretrained_body(model_state: dict[str, torch.Tensor], config, source: DataSource) -> dict[str, torch.Tensor]:
    """Stage 1's network without the classifier head's keys, so stage 2 keeps its own fresh head."""
    head = set(head_keys(build_model(config.model, source.input_shape, source.num_tasks,
                                     width=config.model_width, seed=config.seed)))
    return {k: v for k, v in model_state.items() if k not in head}


def pretrain_source(config, source: DataSource) -> DataSource:
    """The data of stage 1: every client (federated), or client 0 alone."""
    return source if config.num_clients == source.num_clients else FirstClientSource(source)


def _plain(values: dict) -> dict:
    return {k: [dict(x) if isinstance(x, dict) else x for x in v] if isinstance(v, tuple) else v
            for k, v in values.items()}


def recipe_record(config: Any, stage2_dir: Path | None = None) -> dict:
    """What stage 1's ``recipe.yaml`` holds: the two-stage run's config (``Config.to_dict()``) and stage 2's
    folder (None until stage 2 has made it)."""
    return {"stage": 1, "config": _plain(config.to_dict()),
            "stage2_dir": None if stage2_dir is None else str(stage2_dir)}


def read_recipe(run_dir: Path) -> dict | None:
    """Stage 1's ``recipe.yaml`` in ``run_dir``, or None for a folder of an ordinary run (or of stage 2)."""
    path = Path(run_dir) / RECIPE_FILE
    if not path.is_file():
        return None
    data = read_yaml_file(path, "pre-training recipe file")
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict) or not isinstance(
            data.get("stage2_dir"), (str, type(None))):
        raise CheckpointError(f"pre-training recipe file '{path}' is damaged: it holds no 'config' mapping and "
                              "'stage2_dir'")
    return data


class Stage2Folder(Observer):
    """Records stage 2's run folder in stage 1's ``recipe.yaml`` when stage 2 starts, so that resuming stage 1's
    folder continues stage 2 there."""

    def __init__(self, stage1_dir: Path, config: Any, stage2_dir: Callable[[], Path | None]) -> None:
        self.stage1_dir = Path(stage1_dir)
        self.config = config
        self.stage2_dir = stage2_dir

    def start(self, run: RunStart) -> None:
        folder = self.stage2_dir()
        if folder is None:
            return
        text = yaml.safe_dump(recipe_record(self.config, folder), sort_keys=False).encode("utf-8")
        write_atomically(self.stage1_dir / RECIPE_FILE, lambda fh: fh.write(text), "the pre-training recipe")


class PretrainProgress(Observer):
    """Stage 1's progress in the log between its evaluations (which the loop logs): at most every ``every_s``
    seconds, where it is, so a pre-training of thousands of iterations is not silent until stage 2 begins."""

    def __init__(self, every_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.clock = clock
        self.iterations = 0
        self.started = self.said = 0.0

    def start(self, run: RunStart) -> None:
        self.iterations = run.iterations
        self.started = self.said = self.clock()
        log.info("pre-training: stage 1 of %d iterations begins (a line at least every %.0f s)", self.iterations,
                 self.every_s)

    def record(self, record: dict, snapshot: Snapshot) -> None:
        self.said = self.clock()  # the loop has just logged this evaluation

    def round_end(self, plan: RoundPlan, record: dict | None, snapshot: Snapshot | None) -> None:
        now = self.clock()
        if now - self.said < self.every_s:
            return
        self.said = now
        done = plan.iteration + plan.steps
        log.info("pre-training: iteration %d of %d (%.0f%%), round %d, %.0f s so far", done, self.iterations,
                 100.0 * done / max(1, self.iterations), plan.round, now - self.started)
