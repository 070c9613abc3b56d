"""Running a sweep (``fdam tune``): Ray Tune over whole federations, then the results report."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import stat
import threading
from datetime import datetime
from pathlib import Path

import yaml

from fdam_ray.config import ConfigError, build_config
from fdam_ray.features import interrupts
from fdam_ray.files.extras import extra_hint
from fdam_ray.files.locations import RemoteFolder, is_uri, join_uri, local_path_of, output_root
from fdam_ray.files.runlock import RunLock
from fdam_ray.outputs.trackers import check_usable as check_trackers
from fdam_ray.settings.redact import redact
from fdam_ray.tuning.callbacks import tracker_callbacks
from fdam_ray.tuning.report import SweepOutcome, cell, write_sweep_outputs
from fdam_ray.tuning.space import SPACE_FILE, Space, param_space
from fdam_ray.tuning.trial import trainable

SWEEP_FOLDER = "sweep folder"  # what a lock refusal calls the folder


def _trial_name(trial) -> str:
    params = "_".join(f"{k}={cell(v)}" for k, v in sorted(trial.config.items()))
    return re.sub(r"[^\w.=,+-]", "_", f"trial_{trial.trial_id}_{params}")[:120]  # a searched path has '/'s


def _scheduler(space: Space, config):
    if space.options.scheduler != "asha":
        return None
    from ray.tune.schedulers import ASHAScheduler

    grace = space.options.grace_period or 2 * config.eval_every
    return ASHAScheduler(time_attr="iteration", max_t=config.iterations, grace_period=grace,
                         reduction_factor=space.options.reduction_factor)


def _searcher(space: Space):
    if space.options.searcher != "optuna":
        return None
    import importlib.util

    if importlib.util.find_spec("optuna") is None:
        raise ConfigError(f"tune option 'searcher': optuna needs the optuna package: {extra_hint('optuna', 'optuna')}")
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch()


def check_resume_trusted(sweep_dir: str | Path, *, trust_storage: bool = False) -> None:
    """Refuse to resume from a sweep folder another user could have written to.

    Ray Tune's restore unpickles ``tuner.pkl`` and the experiment state in the
    folder, and unpickling runs whatever code the file names. So, as ssh does with
    keys, the folder and every file directly in it must belong to this user (or
    root) and be writable by no one else. Who can write to a storage URI (a bucket)
    cannot be checked from here: such a sweep resumes only with ``trust_storage``.
    """
    local = local_path_of(sweep_dir)
    if local is None:
        if not trust_storage:
            raise ConfigError(
                f"--resume: '{redact(sweep_dir)}' is remote storage; resuming unpickles the sweep's state, which runs "
                "any code put in it, and who can write there cannot be checked from here: add --trust-storage if only "
                "you (or people you trust) can write to it")
        return
    folder = local
    uid = os.getuid()
    for path in [folder, *sorted(folder.iterdir())]:
        st = path.stat()
        what = "folder" if path.is_dir() else "file"
        problem = None
        if st.st_uid not in (uid, 0):
            problem = f"belongs to another user (uid {st.st_uid})"
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (path.is_dir() and path != folder):
            problem = f"can be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
        if problem:
            raise ConfigError(
                f"--resume: the sweep {what} '{path}' {problem}; resuming unpickles the sweep's state, which runs "
                "any code put in it, so fdam tune resumes only from a folder and files that you own and only you "
                f"can write (check who changed it, then chmod go-w or chown it)")


def storage_of(storage_path: str) -> str:
    """``tune.storage_path`` as Ray Tune gets it: a URI untouched, a local path made absolute (see
    :func:`fdam_ray.files.locations.output_root` for a relative path inside a Ray job)."""
    if is_uri(storage_path):
        return storage_path
    return str(output_root(storage_path, "tune.storage_path").resolve())


def run_sweep(space: Space, *, resume_dir: str | None = None, address: str | None = None,
              trust_storage: bool = False) -> SweepOutcome:
    """Run (or resume) a sweep and write its tables, best config and figure; returns how it ended.

    ``tune.storage_path`` may be a local folder or a storage URI (``s3://...``), passed to Ray Tune untouched;
    with a URI the trials' run folders are synced there too, and the tables and best config are written both
    there and to a local copy (`fdam_ray.tuning.report.LOCAL_COPY`).
    """
    if resume_dir:
        check_resume_trusted(resume_dir, trust_storage=trust_storage)

    base_config = build_config(space.base)
    check_trackers(base_config.trackers)
    storage = storage_of(space.options.storage_path)
    # Every report carries a checkpoint and only the last two are kept, so Tune snapshots the sweep's state
    # whenever a trial has saved two (what lets --resume find the checkpoints it names): on a short sweep every
    # few seconds, and each time Tune warns that snapshots "may become a bottleneck". On a local disk a snapshot
    # is a small file written, so there the warning is off unless the user sets the variable; remote storage
    # (a URI) keeps it.
    if not is_uri(storage):
        os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    lock = _resumed_sweep_lock(resume_dir) if resume_dir else _new_sweep_folder(space, storage)
    try:
        return _run(space, base_config, storage, resume_dir=resume_dir, address=address)
    finally:
        if lock is not None:
            lock.release()


def _resumed_sweep_lock(resume_dir: str) -> RunLock | None:
    """The lock of a local sweep folder being resumed, taken before Tune reads or writes anything in it: a
    second driver on a live sweep would restore its trials while they run (see :mod:`fdam_ray.files.runlock`).
    Who else writes a storage URI cannot be checked from here: None."""
    local = local_path_of(resume_dir)
    return None if local is None else RunLock(local, SWEEP_FOLDER)


def _new_sweep_folder(space: Space, storage: str) -> RunLock | None:
    """Make the sweep's folder (refusing an existing one) with its space file; a local one locked for as long
    as this driver runs the sweep."""
    if space.options.name is None:
        space.options.name = f"sweep-{datetime.now():%Y%m%d-%H%M%S}"
    text = yaml.safe_dump({"base": space.base, "search": space.search, "tune": dataclasses.asdict(space.options)},
                          sort_keys=False)
    if is_uri(storage):
        folder = RemoteFolder(join_uri(storage, space.options.name))
        if folder.exists():
            raise ConfigError(f"sweep folder '{redact(folder.uri)}' exists; choose another tune.name or use --resume")
        folder.write_text(SPACE_FILE, text)
        return None
    exp_dir = Path(storage) / space.options.name
    if exp_dir.exists():
        raise ConfigError(f"sweep folder '{exp_dir}' exists; choose another tune.name or use --resume")
    exp_dir.mkdir(parents=True)
    lock = RunLock(exp_dir, SWEEP_FOLDER)
    (exp_dir / SPACE_FILE).write_text(text, encoding="utf-8")
    return lock


def _run(space: Space, base_config, storage: str, *, resume_dir: str | None, address: str | None) -> SweepOutcome:
    """Start (or join) Ray, fit the sweep and write its outputs."""
    from ray import tune

    from fdam_ray.executors.ray.session import ensure_ray

    ensure_ray(address=address, cpus_needed=1)
    trial = trainable(space.base, metric=space.options.metric, driver_cpus=space.options.driver_cpus)
    if resume_dir:
        where = resume_dir if is_uri(resume_dir) else str(Path(resume_dir).resolve())
        tuner = tune.Tuner.restore(where, trainable=trial, resume_unfinished=True, resume_errored=True)
    else:
        opts = space.options
        tuner = tune.Tuner(
            trial,
            param_space=param_space(space.search, opts.searcher),
            tune_config=tune.TuneConfig(
                metric=opts.metric, mode=opts.mode, num_samples=opts.num_samples,
                scheduler=_scheduler(space, base_config), search_alg=_searcher(space),
                max_concurrent_trials=opts.max_concurrent_trials,
                trial_name_creator=_trial_name, trial_dirname_creator=_trial_name,
            ),
            run_config=tune.RunConfig(name=opts.name, storage_path=storage,
                                      checkpoint_config=tune.CheckpointConfig(num_to_keep=2), verbose=1,
                                      # remote storage: each trial's run folder (metrics, train.log) goes there too
                                      sync_config=tune.SyncConfig(sync_artifacts=is_uri(storage)),
                                      callbacks=tracker_callbacks(space.base)),
        )
    grid = _fit(tuner)
    return write_sweep_outputs(grid, space)


def _fit(tuner):
    """``tuner.fit()``, stopped on a first SIGTERM or Ctrl+C the way Ray Tune stops on Ctrl+C: the trials
    stopped, the experiment state saved, ``fit`` returning what it has (the caller then prints how to resume).
    A second signal exits at once (:mod:`fdam_ray.features.interrupts`); Tune's own SIGINT handler is left out, which
    would otherwise take the first Ctrl+C and hand the second back as a first."""
    if not interrupts.active() or threading.current_thread() is not threading.main_thread():
        return tuner.fit()
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # Tune's stop handler, once fit() has set it up

    def stop_sweep(signum: int) -> None:
        tune_stop = signal.getsignal(signal.SIGUSR1)
        if not callable(tune_stop):  # fit() has not reached its loop: nothing of the sweep to save yet
            raise interrupts.Interrupted(signum)
        tune_stop(signum, None)

    with interrupts.first_signal_does(stop_sweep):
        return tuner.fit()
