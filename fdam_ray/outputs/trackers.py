"""Experiment trackers: MLflow and Weights & Biases (config field ``trackers``).

A tracker is an :class:`~fdam_ray.outputs.Observer`. When a run starts it opens
a tracker run named like the run folder and logs the resolved config as
parameters (every field, :func:`tracker_params`); at every evaluation it logs
the record's numbers as metrics at step = iteration, under their ``metrics.csv``
names (:func:`tracker_metrics`: ``test_auc``, ``task_auc.<task>``,
``client_auc.<id>``, ``worst_client_auc``, ``bytes_up``, ``train_loss``, ``lr``,
``test_auc_ci_low``, ``val_pauc``, ... with ``clinical: on``); at the end it logs the
summary (:func:`summary_metrics`) and the final model (``model.pt``) as an artifact.

One naming scheme for every tracker run, of ``fdam train`` and of ``fdam tune``
alike: the names of ``metrics.csv``, which are also what a sweep's trials report
to Ray Tune (and so what Tune's own logger callbacks log), the names ``tune.metric``
takes, the columns of ``sweep_results.csv`` and the keys of ``summary.json``. A
run and a sweep trial are then compared in a tracker under the same name, and a
name read in a tracker is the one to give ``tune.metric``. (TensorBoard keeps its
grouped tags, ``auc/test``, which its dashboard folds into sections.)

Where they log is each tool's own setting: MLflow's tracking URI
(``MLFLOW_TRACKING_URI``, by default ``sqlite:///mlflow.db`` in the working
folder), W&B's login, ``WANDB_MODE`` (``offline`` writes under ``WANDB_DIR``
and syncs later) and entity. The MLflow experiment and the W&B project are
``tracker_project``.

A run resumed from its folder continues the same tracker run: the tracker
run's id is kept in ``<run>/trackers.json``. A tracker that cannot start its run
(MLflow refusing its store, a server that does not answer) stops the run before
its first round, in one line (:class:`TrackerError`; ``fdam train`` exits 2), and
a new run's folder is removed: a run that trains must be tracked. A tracker that
fails while a run goes on (a tracking server that stops answering) logs one
warning and stops logging; the run itself goes on.

A password in the tracking URI (``http://user:pw@host``) or any other credential
is never printed or logged: warnings show the URI as ``http://user:***@host``
(:func:`fdam_ray.settings.redact.redact`), and config values sent as parameters are
redacted the same way.

Ray Tune sweeps do not use these observers: each trial reports to Tune, and
:func:`fdam_ray.tuning.tracker_callbacks` gives Ray's own MLflow and W&B logger callbacks, logging the same
parameters and metric names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import logging
import socket
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from fdam_ray.features.interrupts import RunStopped, interruptible
from fdam_ray.files.extras import extra_hint
from fdam_ray.files.versions import VERSIONS_KEY, run_versions
from fdam_ray.outputs import Observer, OutputSection, RunStart, Snapshot, scalars
from fdam_ray.scores.clinic import SUMMARY_PREFIXES
from fdam_ray.settings.redact import redact
from fdam_ray.settings.sections import SECRET_FIELDS, ConfigError

log = logging.getLogger(__name__)

TRACKERS = ("mlflow", "wandb")
IDS_FILE = "trackers.json"  # tracker run ids of a run folder, for --resume


class TrackerError(ConfigError):
    """A tracker named in ``trackers`` cannot start its run (its store, server or login refuses it): the run stops
    before it trains, since what it would train is not recorded where asked."""


def tracker_params(config_dict: dict[str, Any]) -> dict[str, Any]:
    """Every config field as a tracker records it (credentials of any URI in a text replaced by ``***``), the
    secret ones (:data:`~fdam_ray.settings.sections.SECRET_FIELDS`) left out: they stay in the run folder; the
    same for a run of ``fdam train`` and for a sweep trial (its base config with its searched values)."""
    return {k: _param(v) for k, v in config_dict.items() if k not in SECRET_FIELDS}


def tracker_metrics(record: dict) -> dict[str, float]:
    """An evaluation record's numbers as trackers log them: their ``metrics.csv`` names (``test_auc``,
    ``client_auc.<id>``, ``worst_client_auc``, ...), the step (``iteration``) left out."""
    return {k: v for k, v in scalars(record).items() if k != "iteration"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackedRun:
    """What the trackers know of a run, cut from its config by the caller (the assembly): this module knows no
    config beyond these.

    Attributes:
        outputs: the run's outputs section (``trackers``, ``tracker_project``, ``run_name``).
        algorithm: the run's algorithm (a tag, and part of a run name made here).
        dataset: the run's dataset (the same).
        params: every config field's plain value (``to_dict()`` of the config), the tracker run's parameters.
    """

    outputs: OutputSection
    algorithm: str
    dataset: str
    params: Mapping[str, Any]


def run_tags(algorithm: str, dataset: str) -> dict[str, str]:
    """The tags of a tracker run (MLflow), for runs of ``fdam train`` and sweep trials alike."""
    return {"fdam.algorithm": str(algorithm), "fdam.dataset": str(dataset),
            **{f"fdam.version.{k}": str(v) for k, v in run_versions().items()}}


def check_installed(names: Sequence[str]) -> None:
    """Refuse, in one line naming the extra to install, a tracker whose package is missing."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"trackers: {name} is not installed; {extra_hint(name, name)}; or leave {name} out of "
                              "trackers")


def check_usable(names: Sequence[str]) -> None:
    """Refuse, before anything trains, trackers that would record nothing: a package missing
    (:func:`check_installed`) or broken (it raises when imported), or W&B with no credentials outside offline
    mode (it would warn once and log nothing). One line each, saying what to do."""
    check_installed(names)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a broken install: any error at import, not only ImportError
            why = (str(exc).strip().splitlines() or [""])[0][:200]
            raise ConfigError(f"trackers: {name} is installed but fails to import ({type(exc).__name__}: {why}); "
                              f"reinstall it (pip install --force-reinstall {name}) or leave {name} out of trackers"
                              ) from None
    if "wandb" in names:
        check_wandb_login()
    if "mlflow" in names:
        check_mlflow_store()


def check_mlflow_store() -> None:
    """Refuse, before anything trains, an MLflow tracking store that MLflow refuses (MLflow 3 refuses a file
    store such as ``./mlruns`` unless ``MLFLOW_ALLOW_FILE_STORE=true``; a bad URI scheme; a server that
    answers with an error): one line with MLflow's own first line."""
    import mlflow
    from mlflow.tracking import MlflowClient

    check_server_answers("mlflow", mlflow.get_tracking_uri(), "MLFLOW_TRACKING_URI",
                         "set MLFLOW_TRACKING_URI to a server that answers or to a local store (sqlite:///mlflow.db)")
    with interruptible():  # a tracking server that does not answer: a stop signal ends the wait
        try:
            MlflowClient().search_experiments(max_results=1)
        except Exception as exc:
            raise TrackerError(f"trackers: mlflow cannot use its tracking store "
                               f"'{redact(mlflow.get_tracking_uri())}' ({_first_line(exc)}); set "
                               "MLFLOW_TRACKING_URI to a store MLflow takes (sqlite:///mlflow.db, http://host:5000), "
                               "or leave mlflow out of trackers") from None


PROBE_TIMEOUT_S = 5.0  # longest wait for a tracker's server to accept a connection, before its own retries


def check_server_answers(name: str, uri: str, setting: str, instead: str) -> None:
    """Refuse, in one line and within ``PROBE_TIMEOUT_S``, a tracker whose server (an ``http(s)://`` URI) does
    not accept a connection: the tracker's own library would retry for minutes before failing. ``setting``
    names where the URI comes from, ``instead`` what else to set. A URI that is not ``http(s)``, or one reached
    through a proxy, is left to the tracker."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise TrackerError(f"trackers: {name}'s server URI {redact(uri)} ({setting}) has no valid port; "
                           f"{instead}, or leave {name} out of trackers") from None
    if urllib.request.getproxies() and not urllib.request.proxy_bypass(parts.hostname):
        return  # the connection goes through a proxy, which this probe does not speak
    why: list[str] = []

    def probe() -> None:
        try:
            socket.create_connection((parts.hostname, port), timeout=PROBE_TIMEOUT_S).close()
        except OSError as exc:
            why.append(exc.strerror or type(exc).__name__)
        else:
            why.append("")

    prober = threading.Thread(target=probe, name=f"fdam-{name}-probe", daemon=True)  # a name lookup can hang too
    with interruptible():
        prober.start()
        prober.join(PROBE_TIMEOUT_S + 1.0)
    reason = why[0] if why else f"no answer within {PROBE_TIMEOUT_S:g} s"
    if reason:
        raise TrackerError(f"trackers: {name}'s server at {redact(uri)} ({setting}) cannot be reached "
                           f"({reason}); start it, {instead}, or leave {name} out of trackers")


def _first_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception, credentials redacted and at most 200 characters."""
    line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {redact(line)[:200]}".rstrip(": ")


WANDB_KEYLESS_MODES = ("offline", "dryrun", "disabled")


def check_wandb_login() -> None:
    """Refuse W&B without credentials (``WANDB_API_KEY``, ``wandb login``'s netrc entry, W&B's settings) unless
    it runs offline: ``wandb.init`` would then warn once and the run would record nothing."""
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import HostUrl
        from wandb.sdk.lib.wbauth.authenticate import _use_system_auth
    except ImportError:  # another W&B version: wandb.init says what it lacks
        return
    settings = wandb_setup.singleton().settings
    if str(settings.mode) in WANDB_KEYLESS_MODES:
        return
    try:
        found = _use_system_auth(host=HostUrl(settings.base_url), source="fdam", update_session=False)
    except Exception as exc:  # credentials found but malformed: W&B's own words
        raise ConfigError(f"trackers: wandb: {str(exc).strip()[:200]}") from None
    if found is None:
        raise ConfigError("trackers: wandb has no API key, so it would log nothing: log in with `wandb login` (or "
                          "set WANDB_API_KEY), or set WANDB_MODE=offline to log locally and `wandb sync` later")
    check_server_answers("wandb", str(settings.base_url), "WANDB_BASE_URL or `wandb login --host`",
                         "set WANDB_BASE_URL to a W&B server that answers, or WANDB_MODE=offline to log locally and "
                         "`wandb sync` later")


def make_trackers(run: TrackedRun, run_dir_of: Callable[[], Path | None] = lambda: None) -> list[Observer]:
    """The tracker observers ``run.outputs.trackers`` names (checked to be installed).

    Args:
        run_dir_of: gives the run folder once the run has started (None when the run is not saved): the tracker
            run takes its name, keeps its id there for ``--resume`` and logs its ``model.pt``.
    """
    check_installed(run.outputs.trackers)
    kinds = {"mlflow": MLflowTracker, "wandb": WandbTracker}
    return [kinds[name](run, run_dir_of) for name in run.outputs.trackers]


def _run_name(run: TrackedRun, run_dir: Path | None) -> str:
    if run_dir is not None:
        return run_dir.name
    dataset = str(run.dataset).rpartition(":")[2]  # a factory module:attr: its name, as run folders have it
    return run.outputs.run_name or f"{datetime.now():%Y%m%d-%H%M%S}-{run.algorithm}-{dataset}"


def _param(value: Any) -> Any:
    """A config value as the tracker records it: a text without the credentials of any URI in it, a tuple a list."""
    return redact(value) if isinstance(value, str) else list(value) if isinstance(value, tuple) else value


class Tracker(Observer):
    """What both trackers share: names, the run id kept in the run folder, failure handling, the model file."""

    name = "tracker"

    def __init__(self, tracked: TrackedRun, run_dir_of: Callable[[], Path | None]) -> None:
        self.tracked = tracked
        self.run_dir_of = run_dir_of
        self.active = False

    # -- what each tool does -----------------------------------------------------------
    def open(self, run_name: str, params: dict[str, Any], resume_id: str | None) -> str:
        """Start (or, with ``resume_id``, continue) a tracker run; return its id."""
        raise NotImplementedError

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_end(self, summary: dict, model_file: Path) -> None:
        raise NotImplementedError

    def end(self, status: str) -> None:
        """``status``: finished, failed or killed."""
        raise NotImplementedError

    # -- the observer -------------------------------------------------------------------
    def _guard(self, what: str, fn: Callable[[], None]) -> None:
        """``fn()``; a failure makes this tracker log nothing more (one warning), the run goes on."""
        if not self.active:
            return
        try:
            fn()
        except Exception as exc:  # the run goes on without this tracker
            self.active = False
            log.warning("%s tracker: %s failed (%s: %s); it logs nothing more for this run", self.name, what,
                        type(exc).__name__, redact(exc))  # a tracking URI in the error keeps no password

    def start(self, run: RunStart) -> None:
        run_dir = self.run_dir_of()
        ids = _read_ids(run_dir)
        resume_id = ids.get(self.name) if run.resumed else None
        self.active = True

        with interruptible():  # a tracking server that does not answer: a stop signal ends the wait
            try:
                params = tracker_params(dict(self.tracked.params))
                run_id = self.open(_run_name(self.tracked, run_dir), params, resume_id)
            except Exception as exc:  # not tracked as asked: the run stops before its first round
                self.active = False
                raise TrackerError(f"trackers: {self.name} could not start its run ({_first_line(exc)}); fix "
                                   f"{self.name}'s setting or leave {self.name} out of trackers") from None
        if run_dir is not None:
            _write_ids(run_dir, {**ids, self.name: run_id})
        if resume_id is not None:
            self._guard("logging the resume", lambda: self.log_metrics({"resumed_at_iteration": run.iteration},
                                                                       run.iteration))

    def record(self, record: dict, snapshot: Snapshot) -> None:
        self._guard("logging an evaluation", lambda: self.log_metrics(tracker_metrics(record), record["iteration"]))

    def finish(self, summary: dict, model: dict, snapshot: Snapshot) -> None:
        def log_model() -> None:
            run_dir = self.run_dir_of()
            saved = None if run_dir is None else run_dir / "model.pt"
            if saved is not None and saved.is_file():
                self.log_end(summary, saved)
                return
            with tempfile.TemporaryDirectory() as d:
                torch.save(model, Path(d) / "model.pt")
                self.log_end(summary, Path(d) / "model.pt")

        self._guard("logging the final model", log_model)

    def close(self, error: BaseException | None) -> None:
        status = ("finished" if error is None else
                  "killed" if isinstance(error, (RunStopped, KeyboardInterrupt)) else "failed")
        self._guard("ending its run", lambda: self.end(status))
        self.active = False


def _read_ids(run_dir: Path | None) -> dict[str, str]:
    if run_dir is None or not (run_dir / IDS_FILE).is_file():
        return {}
    try:
        ids = json.loads((run_dir / IDS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


def _write_ids(run_dir: Path, ids: dict[str, str]) -> None:
    (run_dir / IDS_FILE).write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")


# The summary's numbers logged at the end (the rest is in the metrics already).
SUMMARY_KEYS = ("final_test_auc", "best_test_auc", "best_iteration", "best_val_auc", "final_val_auc", "rounds",
                "iterations", "bytes_up", "bytes_down", "wall_s", "samples_per_s")


def summary_metrics(summary: dict) -> dict[str, float]:
    """The summary's numbers a tracker logs at the end: :data:`SUMMARY_KEYS` and the clinical ones
    (:data:`~fdam_ray.scores.clinic.SUMMARY_PREFIXES`: ``final_test_auc_ci_low``, ``best_val_pauc``, ...)."""
    return {k: v for k, v in summary.items() if (k in SUMMARY_KEYS or k.startswith(SUMMARY_PREFIXES))
            and isinstance(v, (int, float)) and not isinstance(v, bool)}


def log_mlflow_params(client: Any, run_id: str, params: dict[str, Any]) -> None:
    """Log ``params`` (:func:`tracker_params`) to an MLflow run in batches: a list as JSON, any other value as
    text."""
    from mlflow.entities import Param

    items = [Param(k, json.dumps(v) if isinstance(v, list) else str(v)) for k, v in params.items()]
    for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per call
        client.log_batch(run_id, params=items[i : i + 100])


class MLflowTracker(Tracker):
    """An MLflow run per federation, through ``MlflowClient`` (the caller's own active run is left alone)."""

    name = "mlflow"

    def open(self, run_name: str, params: dict[str, Any], resume_id: str | None) -> str:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        if resume_id is not None:
            self.client.update_run(resume_id, status="RUNNING")
            self.run_id = resume_id
            return resume_id
        experiment = self.client.get_experiment_by_name(self.tracked.outputs.tracker_project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(self.tracked.outputs.tracker_project))
        tags = run_tags(self.tracked.algorithm, self.tracked.dataset)
        run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        try:
            log_mlflow_params(self.client, self.run_id, params)
        except Exception:  # the run stops: its tracker run is not left RUNNING (where the store still answers)
            with contextlib.suppress(Exception):
                self.client.set_terminated(self.run_id, "FAILED")
            raise
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, int(step)) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_end(self, summary: dict, model_file: Path) -> None:
        self.client.log_artifact(self.run_id, str(model_file))
        step = int(summary.get("iterations") or 0)
        self.log_metrics({f"summary.{k}": v for k, v in summary_metrics(summary).items()}, step)

    def end(self, status: str) -> None:
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "killed": "KILLED"}.get(status, "FAILED"))


class WandbTracker(Tracker):
    """A W&B run per federation (a run object of its own, so other W&B runs in the process are left alone)."""

    name = "wandb"

    def open(self, run_name: str, params: dict[str, Any], resume_id: str | None) -> str:
        import wandb

        kwargs: dict[str, Any] = {"id": resume_id, "resume": "allow"} if resume_id is not None else {}
        self.run = wandb.init(project=self.tracked.outputs.tracker_project, name=run_name,
                              config={**params, VERSIONS_KEY: run_versions()},
                              reinit="create_new", **kwargs)
        return self.run.id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=int(step))

    def log_end(self, summary: dict, model_file: Path) -> None:
        import wandb

        artifact = wandb.Artifact(f"model-{self.run.id}", type="model")
        artifact.add_file(str(model_file), name="model.pt")
        self.run.log_artifact(artifact)
        self.run.summary.update(summary_metrics(summary))

    def end(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)
