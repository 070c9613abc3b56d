"""The run folder as an observer: its config section, when checkpoints are written, and a stop asked for from
outside (SIGTERM) at the next round end."""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

from fdam_ray.core.state import RoundPlan
from fdam_ray.features.interrupts import RunStopped, stop_requested
from fdam_ray.files.locations import output_root
from fdam_ray.files.runlock import RunLock, check_not_in_use
from fdam_ray.files.versions import VERSIONS_KEY, changed_versions, run_versions
from fdam_ray.files.yamlfile import read_yaml_file
from fdam_ray.outputs.observer import Observer, RunStart, Snapshot
from fdam_ray.outputs.writer import RunWriter, tensorboard_installed
from fdam_ray.settings.sections import EACH_ONCE, NONNEGATIVE, Section, setting, shared

log = logging.getLogger(__name__)
MAX_RUN_NAME = 100
# the name of a recipe's pre-training stage: <run_name>-pretrain (fdam_ray.assembly.pretrain)
_DERIVED_SUFFIX = "-pretrain"
RUN_NAME_ALLOWED = (f"one folder name of at most {MAX_RUN_NAME} characters: no '/', '\\', NUL or control "
                    "characters, nor others that do not print (line breaks, non-breaking or zero-width spaces), "
                    "not '.' or '..'")


def is_folder_name(name: str) -> bool:
    """Whether ``name`` is one path component a run folder may take: a run folder stays under ``out_dir``, and a
    huge name is not echoed back in every message."""
    if not name:
        return True  # as null: a time-stamped name
    longest = MAX_RUN_NAME + (len(_DERIVED_SUFFIX) if name.endswith(_DERIVED_SUFFIX) else 0)
    return (len(name) <= longest and name.strip() not in (".", "..")
            and not any(c in "/\\" or not c.isprintable() for c in name))  # control, line breaks, invisible


TENSORBOARD_ALLOWED = "auto, false, or true where the tensorboard package is installed (the 'tensorboard' extra)"


def _tensorboard_allowed(value: bool | str) -> bool:
    """``tensorboard=true`` without the package: refused when the config is built, before anything runs."""
    return value is not True or tensorboard_installed()


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputSection(Section):
    """The config fields of a run folder and of the experiment trackers (:mod:`fdam_ray.outputs.trackers`)."""

    name = "outputs"

    out_dir: str = setting("runs", "Folder under which run folders are made.", resume=True)
    run_name: str | None = setting(None, "Run folder name, one path component of at most 100 characters; null = "
                                   "time stamp, algorithm and dataset.",
                                   check=(lambda v: is_folder_name(v), RUN_NAME_ALLOWED))
    checkpoint_every: int = setting(100, "Write a checkpoint every this many rounds (and at the end); 0 = only at "
                                    "the end.", check=NONNEGATIVE, resume=True)
    tensorboard: bool | str = setting("auto", "Write TensorBoard event files into the run folder: auto = where the "
                                      "tensorboard package is installed (silent where not), true (needs it), "
                                      "false.", check=(_tensorboard_allowed, TENSORBOARD_ALLOWED), resume=True)
    trackers: tuple[str, ...] = setting((), "Experiment trackers that get the config, every evaluation and the "
                                        "final model: mlflow, wandb (a list, or names joined by commas; each needs "
                                        "the extra of its name, or 'trackers' for all); empty = none.",
                                        choices=("mlflow", "wandb"), check=EACH_ONCE, allowed="each tracker once",
                                        resume=True)
    tracker_project: str = setting("fdam-ray", "MLflow experiment and W&B project the trackers log to.", resume=True)
    algorithm: str = shared()
    dataset: str = shared()


class RunFolder(Observer):
    """Writes the run folder and decides when checkpoints are written.

    Checkpoints: right after the initial evaluation of a fresh run (so a run
    stopped before its first periodic checkpoint can be resumed), every
    ``checkpoint_every`` rounds, and at the end. Each holds the config.

    ``config.yaml`` always repeats the run its folder holds: a fresh run writes it when it starts, a resumed
    one with its first checkpoint (a resume that fails before it leaves the folder's record as it was). A
    fresh run that stops before its first round ends leaves no folder behind (the folder it made is removed),
    so its ``run_name`` can be run again at once.

    Args:
        config: the run's full config (written to ``config.yaml`` and into every checkpoint).
        run_dir: the folder (a resumed run's); None makes a new one under ``out_dir`` when the run starts,
            so bad data found while the clients start never leaves a half-made folder.
        checkpoints: write ``checkpoint.pt`` (a Tune trial's checkpoints are kept by Tune instead).
        files: more YAML files to write into the folder when a fresh run starts (name -> mapping).
    """

    def __init__(self, config: Any, *, run_dir: Path | None = None, checkpoints: bool = True,
                 files: dict[str, dict] | None = None) -> None:
        self.config_dict = config.to_dict()
        self.section = OutputSection.of(config)
        self.dir = None if run_dir is None else Path(run_dir)
        self.checkpoints = checkpoints
        self.files = dict(files or {})
        self.writer: RunWriter | None = None
        self.lock: RunLock | None = None
        self._last_checkpoint: int | None = None
        self._config_written = False
        self._made: Path | None = None  # the new run's folder (None: a folder given, or a resumed run's)
        self._created = False  # whether this run created it (else it was there, empty)
        self._trained = False

    def start(self, run: RunStart) -> None:
        if self.dir is None:
            self.dir, self._created = make_new_run_dir(self.section)
            self._made = self.dir
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.lock = RunLock(self.dir)  # before anything in the folder is opened for writing
        try:
            self.writer = RunWriter(self.dir, tensorboard=self.section.tensorboard, history=run.history)
            if run.resumed:
                _say_changed_versions(self.dir / "config.yaml")
            if not run.resumed or not (self.dir / "config.yaml").exists():  # (a resumed Tune trial's new folder)
                self._write_config()
            if not run.resumed:
                for name, values in self.files.items():
                    self.writer.write_yaml(name, values, name)
        except BaseException:
            self.lock.release()
            raise
        if run.resumed:
            self._last_checkpoint = run.round
            self._trained = True  # the folder holds earlier sessions: never removed
            self.writer.event("resumed at round %d, iteration %d", run.round, run.iteration)

    def _write_config(self) -> None:
        if self.writer is not None and not self._config_written:
            self.writer.write_config({**self.config_dict, VERSIONS_KEY: run_versions()})
            self._config_written = True

    def _checkpoint(self, snapshot: Snapshot, round_: int) -> None:
        if self.checkpoints and self.writer is not None:
            self.writer.checkpoint(snapshot().with_config(self.config_dict))
            self._last_checkpoint = round_
            self._write_config()  # a resumed run's config, now that its checkpoint holds it

    def record(self, record: dict, snapshot: Snapshot) -> None:
        if self.writer is None:
            return
        self.writer.record(record)
        if self._last_checkpoint is None:  # the initial evaluation of a fresh run
            self._checkpoint(snapshot, record["round"])

    def needs_state(self, round_: int) -> bool:
        every = self.section.checkpoint_every
        return bool(every and round_ % every == 0)

    def round_end(self, plan: RoundPlan, record: dict | None, snapshot: Snapshot | None) -> None:
        self._trained = True
        if snapshot is None:  # inside a run of rounds: a stop asked for is honoured at the run's end
            return
        if self.needs_state(plan.round):
            self._checkpoint(snapshot, plan.round)
        reason = stop_requested()
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

    def best_model(self, model: dict, record: dict) -> None:
        if self.writer is not None:
            self.writer.best_model(model, record)

    def finish(self, summary: dict, model: dict, snapshot: Snapshot) -> None:
        if self.writer is None:
            return
        if self._last_checkpoint != summary["rounds"]:
            self._checkpoint(snapshot, summary["rounds"])
        summary["run_dir"] = str(self.dir)
        summary[VERSIONS_KEY] = run_versions()
        self._write_config()
        self.writer.finish(model, summary)

    def close(self, error: BaseException | None) -> None:
        try:
            if self.writer is not None:
                if isinstance(error, RunStopped):  # a stop asked for (SIGTERM), its checkpoint written: planned
                    self.writer.event("run stopped: %s", error, level=logging.INFO)
                elif isinstance(error, Exception):
                    self.writer.event("run stopped: %s", error, level=logging.ERROR)
                self.writer.close()
        finally:
            if self.lock is not None:
                self.lock.release()
            if error is not None and self._made is not None and not self._trained:
                self._remove_untrained()

    def _remove_untrained(self) -> None:
        """The run stopped before its first round ended: remove the folder it made (nothing in it is worth
        resuming), so the same ``run_name`` runs again."""
        made, self._made = self._made, None
        if made is None:
            return
        for entry in [made] if self._created else list(made.iterdir()):  # a folder that was there stays
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        log.info("removed the run folder '%s': the run stopped before its first round", made)


def _say_changed_versions(config_file: Path) -> None:
    """One line when a resumed run continues under other versions than its ``config.yaml`` records (a run
    folder of before versions were recorded, or a damaged one, says nothing)."""
    try:
        recorded = read_yaml_file(config_file, "run config") if config_file.is_file() else None
    except ValueError:
        return
    before = recorded.get(VERSIONS_KEY) if isinstance(recorded, dict) else None
    changed = changed_versions(before, run_versions()) if isinstance(before, dict) else ""
    if changed:
        log.warning("the run is resumed under other versions than it ran under before: %s", changed)


def check_new_run_dir(config: OutputSection) -> Path | None:
    """The folder a new run named ``run_name`` will make (None without a name); refused, with the command that
    continues it, when it is in use or holds a run already."""
    if not config.run_name:
        return None
    path = output_root(config.out_dir, "out_dir") / config.run_name
    check_not_in_use(path)
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"run folder '{path}' already exists and is not empty; choose another run_name "
                         f"or continue it with: fdam train --resume {path}")
    return path


def make_new_run_dir(config: OutputSection) -> tuple[Path, bool]:
    """Create the run folder (refusing to reuse a non-empty one); (the folder, whether this call made it)."""
    path = check_new_run_dir(config)
    if path is None:
        root = output_root(config.out_dir, "out_dir")
        dataset = re.sub(r"[^\w.-]+", "_", str(config.dataset).rpartition(":")[2])  # a factory: its name
        base = f"{datetime.now():%Y%m%d-%H%M%S}-{config.algorithm}-{dataset}"
        path, n = root / base, 1
        while path.exists():
            path, n = root / f"{base}-{n}", n + 1
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    return path, created


def make_run_dir(config: OutputSection) -> Path:
    """Create the run folder (refusing to reuse a non-empty one)."""
    return make_new_run_dir(config)[0]
