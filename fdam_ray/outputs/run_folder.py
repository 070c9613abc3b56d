"""The run folder as an observer: its config section, when checkpoints are written, and a stop asked for from
outside (SIGTERM) at the next round end."""

from __future__ import annotations

import dataclasses
import logging
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from fdam_ray.locations import output_root
from fdam_ray.outputs.observer import Observer, RunStart, Snapshot
from fdam_ray.outputs.writer import RunWriter
from fdam_ray.runlock import RunLock, check_not_in_use
from fdam_ray.sections import EACH_ONCE, NONNEGATIVE, Section, setting, shared
from fdam_ray.state import RoundPlan


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputSection(Section):
    """The config fields of a run folder and of the experiment trackers (:mod:`fdam_ray.trackers`)."""

    name = "outputs"

    out_dir: str = setting("runs", "Folder under which run folders are made.", resume=True)
    run_name: str | None = setting(None, "Run folder name; null = time stamp, algorithm and dataset.")
    checkpoint_every: int = setting(100, "Write a checkpoint every this many rounds (and at the end); 0 = only at "
                                    "the end.", check=NONNEGATIVE, resume=True)
    tensorboard: bool = setting(True, "Write TensorBoard event files into the run folder (needs tensorboard).",
                                resume=True)
    trackers: tuple[str, ...] = setting((), "Experiment trackers that get the config, every evaluation and the "
                                        "final model: mlflow, wandb (a list, or names joined by commas; each needs "
                                        "its extra, pip install 'fdam-ray[mlflow]'); empty = none.",
                                        choices=("mlflow", "wandb"), check=EACH_ONCE, allowed="each tracker once",
                                        resume=True)
    tracker_project: str = setting("fdam-ray", "MLflow experiment and W&B project the trackers log to.", resume=True)
    algorithm: str = shared()
    dataset: str = shared()


_stop_reason: str | None = None


def request_stop(reason: str) -> None:
    """Ask every run of this process to stop at its next round end, with a checkpoint (safe in a signal handler).

    ``fdam train`` calls it on SIGTERM, what Slurm, Kubernetes and spot-instance reclaim send.
    """
    global _stop_reason
    _stop_reason = reason


def stop_requested() -> str | None:
    """Why a stop was asked for (:func:`request_stop`), or None; waits outside rounds (placement, joining a
    cluster) poll it, so that a stop is acted on while they wait too."""
    return _stop_reason


def clear_stop_request() -> None:
    global _stop_reason
    _stop_reason = None


class RunStopped(Exception):
    """A run stopped at a round end because it was asked to (:func:`request_stop`); its checkpoint is written.

    Attributes:
        run_dir: the run folder, to continue with ``--resume`` (None: stopped before a run folder was made).
    """

    def __init__(self, message: str, run_dir: Path | None) -> None:
        super().__init__(message)
        self.run_dir = run_dir


class RunFolder(Observer):
    """Writes the run folder and decides when checkpoints are written.

    Checkpoints: right after the initial evaluation of a fresh run (so a run
    stopped before its first periodic checkpoint can be resumed), every
    ``checkpoint_every`` rounds, and at the end. Each holds the config.

    Args:
        config: the run's full config (written to ``config.yaml`` and into every checkpoint).
        run_dir: the folder (a resumed run's); None makes a new one under ``out_dir`` when the run starts,
            so bad data found while the clients start never leaves a half-made folder.
        checkpoints: write ``checkpoint.pt`` (a Tune trial's checkpoints are kept by Tune instead).
    """

    def __init__(self, config: Any, *, run_dir: Path | None = None, checkpoints: bool = True) -> None:
        self.config_dict = config.to_dict()
        self.section = OutputSection.of(config)
        self.dir = None if run_dir is None else Path(run_dir)
        self.checkpoints = checkpoints
        self.writer: RunWriter | None = None
        self.lock: RunLock | None = None
        self._last_checkpoint: int | None = None

    def start(self, run: RunStart) -> None:
        if self.dir is None:
            self.dir = make_run_dir(self.section)
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.lock = RunLock(self.dir)  # before anything in the folder is opened for writing
        try:
            self.writer = RunWriter(self.dir, tensorboard=self.section.tensorboard, history=run.history)
            self.writer.write_config(self.config_dict)
        except BaseException:
            self.lock.release()
            raise
        if run.resumed:
            self._last_checkpoint = run.round
            self.writer.event("resumed at round %d, iteration %d", run.round, run.iteration)

    def _checkpoint(self, snapshot: Snapshot, round_: int) -> None:
        if self.checkpoints and self.writer is not None:
            self.writer.checkpoint(snapshot().with_config(self.config_dict))
            self._last_checkpoint = round_

    def record(self, record: dict, snapshot: Snapshot) -> None:
        if self.writer is None:
            return
        self.writer.record(record)
        if self._last_checkpoint is None:  # the initial evaluation of a fresh run
            self._checkpoint(snapshot, record["round"])

    def round_end(self, plan: RoundPlan, record: dict | None, snapshot: Snapshot) -> None:
        every = self.section.checkpoint_every
        if every and plan.round % every == 0:
            self._checkpoint(snapshot, plan.round)
        reason = _stop_reason
        if reason is not None and self.writer is not None and self.dir is not None:  # a round end: the state is whole
            if self._last_checkpoint != plan.round:
                self._checkpoint(snapshot, plan.round)
            raise RunStopped(f"{reason}: stopped after round {plan.round} (iteration {plan.iteration + plan.steps}) "
                             f"with a checkpoint; continue with: fdam train --resume {self.dir}", self.dir)

    def event(self, message: str, *args: Any, level: int = logging.INFO) -> None:
        if self.writer is not None:
            self.writer.event(message, *args, level=level)

    def interrupted(self, round_: int, snapshot: Snapshot) -> Path | None:
        if not self.checkpoints or self.writer is None:
            return None
        self._checkpoint(snapshot, round_)
        return self.dir

    def finish(self, summary: dict, model: dict, snapshot: Snapshot) -> None:
        if self.writer is None:
            return
        if self._last_checkpoint != summary["rounds"]:
            self._checkpoint(snapshot, summary["rounds"])
        summary["run_dir"] = str(self.dir)
        self.writer.finish(model, summary)

    def close(self, error: BaseException | None) -> None:
        try:
            if self.writer is not None:
                if isinstance(error, Exception):
                    self.writer.event("run stopped: %s", error, level=logging.ERROR)
                self.writer.close()
        finally:
            if self.lock is not None:
                self.lock.release()


def make_run_dir(config: OutputSection) -> Path:
    """Create the run folder (refusing to reuse a non-empty one)."""
    root = output_root(config.out_dir, "out_dir")
    if config.run_name:
        path = root / config.run_name
        check_not_in_use(path)
        if path.exists() and any(path.iterdir()):
            raise ValueError(f"run folder '{path}' already exists and is not empty; choose another run_name "
                             "or continue it with --resume")
    else:
        dataset = re.sub(r"[^\w.-]+", "_", str(config.dataset).rpartition(":")[2])  # a factory: its name
        base = f"{datetime.now():%Y%m%d-%H%M%S}-{config.algorithm}-{dataset}"
        path, n = root / base, 1
        while path.exists():
            path, n = root / f"{base}-{n}", n + 1
    path.mkdir(parents=True, exist_ok=True)
    return path
