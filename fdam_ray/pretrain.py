"""The two-stage recipe of the paper's chest X-ray experiments (Sec. 5, after Yuan et al. 2021's DAM).

Stage 1 trains the network with binary cross-entropy: a ``fedavg`` federation
over every client, or, with ``pretrain_federated: false``, one client's data
alone (client 0; the paper pre-trains on CheXpert, one of its sources). Stage 2
discards the classifier head, re-initialises it, and runs the configured AUC
algorithm from the pre-trained body. Stage 1 is an ordinary federation with the
pre-training settings, assembled by :mod:`fdam_ray.recipe` like any other run,
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
(or continues) stage 2 from its body (:func:`fdam_ray.recipe.resume`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from fdam_ray.checkpoint import CheckpointError, write_atomically
from fdam_ray.data import DataSource
from fdam_ray.models import build_model
from fdam_ray.outputs.observer import Observer, RunStart
from fdam_ray.sections import NONNEGATIVE, POSITIVE, Section, setting
from fdam_ray.weights import head_keys
from fdam_ray.yamlio import read_yaml_file

RECIPE_FILE = "recipe.yaml"  # in stage 1's run folder: the whole run's config, and stage 2's folder


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainSection(Section):
    """The config fields of stage 1 (what :func:`pretrain_config` reads besides the run's own fields)."""

    name = "pretrain"

    pretrain_iterations: int = setting(0, "Two-stage recipe: iterations of BCE pre-training (fedavg) before the AUC "
                                       "run, which keeps the pre-trained body and re-initialises the head; 0 = off.",
                                       check=NONNEGATIVE)
    pretrain_lr: float | None = setting(None, "Step size of pre-training; null = lr.", check=POSITIVE)
    pretrain_batch_size: int | None = setting(None, "Minibatch of pre-training; null = batch_size.", kind="batch",
                                              allowed=">= 0 or 'full'")
    pretrain_optimizer: str = setting("sgd", "Local step of pre-training: sgd (with the run's momentum) or adam "
                                      "(the paper's choice, e.g. with pretrain_lr 1e-5).", choices=("sgd", "adam"))
    pretrain_federated: bool = setting(True, "Pre-train on all clients (fedavg); false = on client 0's data alone "
                                       "(e.g. the first source).")


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
    """The stage-1 config: BCE under fedavg (or centralized on one client), one stage at a constant lr."""
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
