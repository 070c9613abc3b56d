"""A run folder and what goes into it.

    config.yaml      the resolved config (reloads to the same run)
    metrics.jsonl    one JSON record per evaluation
    metrics.csv      the same, flattened (task_auc.<task>, client_auc.<id> columns)
    train.log        one line per evaluation, plus events (stage switches, why a run stopped) and the package's
                     warnings while the run writes (client actors replaced or dropped)
    events/          TensorBoard event files (when the tensorboard package is installed)
    checkpoint.pt    the latest checkpoint (atomic; see fdam_ray.checkpoint)
    model.pt         the final model: {"model": state_dict, "a", "b", "alpha", "task_names"}
    summary.json     best and final test AUC, rounds, bytes moved, wall time, samples/s
    .lock            who writes the folder now (pid, host, start); see :mod:`fdam_ray.runlock`

Everything a run writes, shows or reports hangs off one :class:`Observer`
interface: the run folder (:class:`RunFolder`, which also decides when a
checkpoint is written), the progress bar (:class:`Progress`), a per-evaluation
callback (:class:`EvalCallback`) and a Ray Tune trial's reports
(:mod:`fdam_ray.tuning.trial`). The driver loop calls the hooks; it holds no
output flags of its own.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import yaml

from fdam_ray.checkpoint import save_checkpoint
from fdam_ray.locations import output_root
from fdam_ray.runlock import RunLock, check_not_in_use
from fdam_ray.sections import EACH_ONCE, NONNEGATIVE, Section, setting, shared
from fdam_ray.state import RoundPlan

log = logging.getLogger(__name__)
_notice_given = False


def flatten_record(rec: dict) -> dict:
    out = {}
    for key, value in rec.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                out[f"{key}.{sub}"] = v
        else:
            out[key] = value
    return out


def scalars(rec: dict) -> dict[str, float]:
    """Every number of an evaluation record under its flat name (``task_auc.<task>``, ``client_auc.<id>``, as in
    ``metrics.csv``), plus ``worst_task_auc`` and ``worst_client_auc`` (the lowest defined AUC) where the record has
    per-task or per-client AUCs. What Tune and the experiment trackers receive."""
    out: dict[str, float] = {}
    for key, value in flatten_record(rec).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
    for part, name in (("task_auc", "worst_task_auc"), ("client_auc", "worst_client_auc")):
        defined = [v for v in (rec.get(part) or {}).values()
                   if isinstance(v, (int, float)) and not math.isnan(v)]
        if defined:
            out[name] = min(defined)
    return out


# Groups of the grouped metric names (TensorBoard tags, tracker metrics): AUCs, communication, training.
_AUC_NAMES = {"test_auc": "auc/test", "worst_task_auc": "auc/worst_task", "worst_client_auc": "auc/worst_client",
              "test_samples": "auc/test_samples"}
_COMM_NAMES = {"bytes_up": "comm/bytes_up", "bytes_down": "comm/bytes_down"}
_TRAIN_NAMES = {"train_loss": "train/loss"}


def grouped_name(key: str) -> str:
    """The grouped name of a flat metric name: ``test_auc`` -> ``auc/test``, ``task_auc.Edema`` ->
    ``auc/task/Edema``, ``client_auc.3`` -> ``auc/client/3``, ``bytes_up`` -> ``comm/bytes_up``, ``train_loss`` ->
    ``train/loss``, and any other (lr, stage, round, wall_s, samples_per_s) ``train/<key>``."""
    for prefix, group in (("task_auc.", "auc/task/"), ("client_auc.", "auc/client/")):
        if key.startswith(prefix):
            return group + key[len(prefix):]
    return _AUC_NAMES.get(key) or _COMM_NAMES.get(key) or _TRAIN_NAMES.get(key) or f"train/{key}"


def grouped_scalars(rec: dict) -> dict[str, float]:
    """:func:`scalars` under their grouped names, without the step (``iteration``)."""
    return {grouped_name(k): v for k, v in scalars(rec).items() if k != "iteration"}


def _tensorboard_writer(path: Path):
    global _notice_given
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if not _notice_given:
            log.warning("TensorBoard files are not written: the 'tensorboard' package is not installed "
                        "(pip install tensorboard)")
            _notice_given = True
        return None
    return SummaryWriter(log_dir=str(path))


class RunWriter:
    """Writes a run's files as the run goes; on resume, rewrites the metric files from the checkpoint's history."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, history: list[dict] | None = None) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.dir / "metrics.jsonl", "w", encoding="utf-8")
        self._csv_file = open(self.dir / "metrics.csv", "w", encoding="utf-8", newline="")
        self._csv: csv.DictWriter | None = None
        self.log = logging.getLogger(f"fdam_ray.run.{id(self)}")
        self.log.propagate = False
        self.log.setLevel(logging.INFO)
        self._handler = logging.FileHandler(self.dir / "train.log", encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.log.addHandler(self._handler)
        # the package's warnings while the run writes here (a client replaced or dropped, a late stage switch)
        self._warnings = logging.FileHandler(self.dir / "train.log", encoding="utf-8")
        self._warnings.setLevel(logging.WARNING)
        self._warnings.setFormatter(self._handler.formatter)
        logging.getLogger("fdam_ray").addHandler(self._warnings)
        self._tb = _tensorboard_writer(self.dir / "events") if tensorboard else None
        for rec in history or []:
            self._write_metrics(rec)

    def write_config(self, config_dict: dict) -> None:
        plain = {k: list(v) if isinstance(v, tuple) else v for k, v in config_dict.items()}
        (self.dir / "config.yaml").write_text(yaml.safe_dump(plain, sort_keys=False), encoding="utf-8")

    def _write_metrics(self, rec: dict) -> None:
        self._jsonl.write(json.dumps(rec) + "\n")
        self._jsonl.flush()
        flat = flatten_record(rec)
        if self._csv is None:
            self._csv = csv.DictWriter(self._csv_file, fieldnames=list(flat), extrasaction="ignore")
            self._csv.writeheader()
        self._csv.writerow(flat)
        self._csv_file.flush()

    def record(self, rec: dict) -> None:
        """Write one evaluation record to every output."""
        self._write_metrics(rec)
        self.log.info(
            "iteration %d round %d stage %d lr %.4g loss %s test_auc %.6f bytes %d wall_s %.1f",
            rec["iteration"], rec["round"], rec["stage"], rec["lr"],
            "-" if rec.get("train_loss") is None else f"{rec['train_loss']:.6f}", rec["test_auc"],
            rec["bytes_up"] + rec["bytes_down"], rec["wall_s"],
        )
        if self._tb is not None:
            step = rec["iteration"]
            for tag, value in grouped_scalars(rec).items():  # auc/..., comm/..., train/...
                self._tb.add_scalar(tag, value, step)
            self._tb.flush()

    def event(self, message: str, *args, level: int = logging.INFO) -> None:
        self.log.log(level, message, *args)

    def checkpoint(self, payload: dict) -> None:
        save_checkpoint(self.dir / "checkpoint.pt", payload)

    def finish(self, model_payload: dict, summary: dict) -> None:
        torch.save(model_payload, self.dir / "model.pt")
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()
        self.log.removeHandler(self._handler)
        self._handler.close()
        logging.getLogger("fdam_ray").removeHandler(self._warnings)
        self._warnings.close()
        if self._tb is not None:
            self._tb.close()


# A function that returns the checkpoint payload of the moment it is called (without the config).
Snapshot = Callable[[], dict]


@dataclasses.dataclass
class RunStart:
    """What an observer learns when a run starts (after its clients have started)."""

    resumed: bool
    history: list[dict]  # the records of earlier sessions of a resumed run
    round: int  # rounds done so far
    iteration: int  # iterations done so far
    iterations: int  # the run's total


class Observer:
    """Hooks the driver loop calls; each does nothing unless overridden.

    Order within one run: ``start``, then for the initial evaluation of a fresh
    run ``record``, then per round ``record`` (when it was evaluated) and
    ``round_end``; ``event`` for stage switches; ``finish`` after the last
    round; ``close`` always, with the exception that stopped the run, if any.
    """

    def start(self, run: RunStart) -> None:
        """The clients have started; the run begins (or continues)."""

    def record(self, record: dict, snapshot: Snapshot) -> None:
        """An evaluation record (``snapshot()`` gives the checkpoint payload of this moment)."""

    def round_end(self, plan: RoundPlan, record: dict | None, snapshot: Snapshot) -> None:
        """A round is done (``record`` is its evaluation, if it had one)."""

    def event(self, message: str, *args: Any, level: int = logging.INFO) -> None:
        """Something worth a line in the run's log (a stage switch)."""

    def interrupted(self, round_: int, snapshot: Snapshot) -> Path | None:
        """The next round cannot finish and the run stops (clients that cannot be placed): an observer that
        saves the run writes a checkpoint of ``snapshot()`` (the state after round ``round_``) and returns the
        folder to resume; the others return None."""
        return None

    def finish(self, summary: dict, model: dict, snapshot: Snapshot) -> None:
        """The last round is done: the run's summary and final model. An observer that saves the run
        sets ``summary["run_dir"]``."""

    def close(self, error: BaseException | None) -> None:
        """The run is over (``error``: what stopped it, or None)."""


class Observers(Observer):
    """Several observers as one, called in the order given."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = list(observers)

    def start(self, run: RunStart) -> None:
        for o in self.observers:
            o.start(run)

    def record(self, record: dict, snapshot: Snapshot) -> None:
        for o in self.observers:
            o.record(record, snapshot)

    def round_end(self, plan: RoundPlan, record: dict | None, snapshot: Snapshot) -> None:
        for o in self.observers:
            o.round_end(plan, record, snapshot)

    def event(self, message: str, *args: Any, level: int = logging.INFO) -> None:
        for o in self.observers:
            o.event(message, *args, level=level)

    def interrupted(self, round_: int, snapshot: Snapshot) -> Path | None:
        saved = [o.interrupted(round_, snapshot) for o in self.observers]
        return next((d for d in saved if d is not None), None)

    def finish(self, summary: dict, model: dict, snapshot: Snapshot) -> None:
        for o in self.observers:
            o.finish(summary, model, snapshot)

    def close(self, error: BaseException | None) -> None:
        first: BaseException | None = None
        for o in self.observers:  # every observer closes, even if one fails
            try:
                o.close(error)
            except Exception as exc:
                first = first or exc
        if first is not None and error is None:
            raise first


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


def clear_stop_request() -> None:
    global _stop_reason
    _stop_reason = None


class RunStopped(Exception):
    """A run stopped at a round end because it was asked to (:func:`request_stop`); its checkpoint is written.

    Attributes:
        run_dir: the run folder, to continue with ``--resume``.
    """

    def __init__(self, message: str, run_dir: Path) -> None:
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
            self.writer.checkpoint({"config": self.config_dict, **snapshot()})
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
        if reason is not None and self.writer is not None:  # a round boundary: the state is whole
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


class EvalCallback(Observer):
    """Calls ``fn(record)`` at every evaluation (``fdam_ray.train(..., on_eval=fn)``)."""

    def __init__(self, fn: Callable[[dict], None]) -> None:
        self.fn = fn

    def record(self, record: dict, snapshot: Snapshot) -> None:
        self.fn(record)


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


def terminal_size(fp: Any) -> tuple[int, int]:
    """Columns and lines of the terminal ``fp`` writes to; where it reports none or zero (``script``, some CI
    runners and containers), ``COLUMNS`` and ``LINES``, else 80 x 24."""
    try:
        size = os.get_terminal_size(fp.fileno())
    except (AttributeError, ValueError, OSError):
        size = os.terminal_size((0, 0))
    fallback = shutil.get_terminal_size((80, 24))  # COLUMNS / LINES, else stdout's size, else 80 x 24
    columns = size.columns if size.columns > 0 else fallback.columns if fallback.columns > 0 else 80
    lines = size.lines if size.lines > 0 else fallback.lines if fallback.lines > 0 else 24
    return columns, lines


class Progress(Observer):
    """A progress bar over iterations (tqdm) with round, stage, lr, last test AUC and rate.

    Args:
        file: where the bar is drawn (default: stderr).
    """

    def __init__(self, file: Any = None) -> None:
        self.bar = None
        self.auc = float("nan")
        self.file = file

    def start(self, run: RunStart) -> None:
        from tqdm.auto import tqdm

        if run.history:  # a resumed run: its last evaluation until the next one
            self.auc = run.history[-1]["test_auc"]
        # tqdm's own size query gives 0 x 0 where the terminal reports no size, and then it draws nothing
        file = self.file if self.file is not None else sys.stderr
        columns, lines = terminal_size(file)
        self.bar = tqdm(total=run.iterations, initial=run.iteration, unit="it", leave=True, file=file,
                        ncols=columns, nrows=lines)
        self.bar.dynamic_ncols = terminal_size  # follows a resized terminal

    def record(self, record: dict, snapshot: Snapshot) -> None:
        self.auc = record["test_auc"]  # the initial evaluation too, before the first round ends

    def round_end(self, plan: RoundPlan, record: dict | None, snapshot: Snapshot) -> None:
        if self.bar is None:
            return
        if record is not None:
            self.auc = record["test_auc"]
        self.bar.set_postfix(round=plan.round, stage=plan.stage, lr=f"{plan.lr:.3g}", auc=f"{self.auc:.4f}",
                             refresh=False)
        self.bar.update(plan.steps)

    def close(self, error: BaseException | None) -> None:
        if self.bar is not None:
            self.bar.close()
