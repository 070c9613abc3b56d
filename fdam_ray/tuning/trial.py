"""One Ray Tune trial: a whole federation, assembled like any run, reporting every evaluation.

Each trial reserves one placement group: a driver bundle plus, with the Ray
executor, one bundle per actor (``cpus_per_actor``, ``gpus_per_actor``; an
actor hosts ``clients_per_actor`` clients), so its actors run inside the
trial's reservation and concurrent trials
cannot deadlock waiting for each other's CPUs. Every evaluation is reported to
Tune with a checkpoint of the federation (global state, control variates,
schedule position), so a stopped sweep resumes (``fdam tune --resume DIR``)
and a paused trial continues where it was.

:func:`trainable` is the same trial for a ``ray.tune.Tuner`` of your own: any
searcher, scheduler (ASHA, PBT, ...), stopper or callback of Ray Tune, with each
trial in its own placement group as in ``fdam tune``.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fdam_ray.config import Config, ConfigError, build_config
from fdam_ray.outputs import Observer, Snapshot, scalars
from fdam_ray.settings.redact import short
from fdam_ray.tuning.space import REPORTED, is_reported

CHECKPOINT_FILE = "checkpoint.pt"


def trial_bundles(config: Config, driver_cpus: float) -> list[dict[str, float]]:
    """Bundle 0 for the trial's driver, then one per actor (ceil(K / clients_per_actor)) with the Ray executor."""
    bundles = [{"CPU": driver_cpus}]
    if config.executor == "ray":
        actor = {"CPU": float(config.cpus_per_actor)}
        if config.gpus_per_actor:
            actor["GPU"] = float(config.gpus_per_actor)
        num_actors = -(-config.num_clients // config.clients_per_actor)
        bundles += [dict(actor) for _ in range(num_actors)]
    return bundles


def trainable(base: Mapping[str, Any] | Config, *, metric: str | None = None, driver_cpus: float = 0.5) -> Any:
    """A Ray Tune trainable whose trials are whole federations: ``base`` with each trial's values (its
    ``param_space`` entries, keyed by config field names), for a ``ray.tune.Tuner`` of your own::

        from ray import tune
        from fdam_ray.tuning import trainable

        tuner = tune.Tuner(
            trainable({"dataset": "synthetic", "model": "mlp", "iterations": 200}, metric="test_auc"),
            param_space={"lr": tune.loguniform(1e-3, 0.3), "local_steps": tune.choice([4, 16])},
            tune_config=tune.TuneConfig(metric="test_auc", mode="max", num_samples=8,
                                        scheduler=tune.schedulers.ASHAScheduler()))
        results = tuner.fit()

    Every evaluation is reported under the ``metrics.csv`` names (``test_auc``, ``train_loss``, ``bytes_up``,
    ``client_auc.<id>``, ``worst_client_auc``, ...: `fdam_ray.tuning.space.REPORTED`) with ``iteration``,
    and with a checkpoint, so schedulers that pause or stop trials (ASHA, PBT) and ``Tuner.restore`` work. Each
    trial writes its run folder (``metrics.csv``, ``train.log``, ``config.yaml``, ``model.pt``) as ``run`` in its
    trial folder, and reserves a placement group: ``driver_cpus`` for its driver and, with ``executor: ray``, one
    bundle per actor, so concurrent trials never wait on each other's CPUs. The trackers ``base`` names are not
    opened by the trials: give the Tuner [`fdam_ray.tuning.tracker_callbacks`][fdam_ray.tuning.tracker_callbacks]
    ``(base)``.

    Args:
        base: the config fields every trial shares (a mapping, as a YAML config file holds, or a Config).
        metric: the metric your ``TuneConfig`` selects on; given, a trial whose federation does not report it
            fails at its first evaluation, naming what it reports.
        driver_cpus: CPUs reserved for each trial's driver (inline clients run on them).

    Raises:
        ConfigError: a field of ``base``, ``metric`` or ``driver_cpus`` is not allowed (one line, before any trial).
    """
    from ray import tune

    fields = base.to_dict() if isinstance(base, Config) else dict(base)
    build_config(fields)  # a bad field: one line now, not once per trial
    if metric is not None and not (isinstance(metric, str) and is_reported(metric)):
        raise ConfigError(f"metric: {short(metric)} is not reported (one of {', '.join(REPORTED)}, task_auc.<task>, "
                          "client_auc.<client id>, worst_task_auc, worst_client_auc)")
    if isinstance(driver_cpus, bool) or not isinstance(driver_cpus, (int, float)) or not (
            math.isfinite(driver_cpus) and driver_cpus > 0):
        raise ConfigError(f"driver_cpus: {short(driver_cpus)} is not allowed (a number of CPUs > 0)")

    def resources(params: dict):
        # per trial: a searched num_clients, clients_per_actor, cpus_per_actor, gpus_per_actor or executor changes
        # its bundles
        config = build_config({**fields, **params})
        return tune.PlacementGroupFactory(trial_bundles(config, float(driver_cpus)),
                                          strategy=config.placement_strategy)

    return tune.with_resources(tune.with_parameters(federation_trial, base=fields, metric=metric), resources)


def reported_metrics(record: dict) -> dict[str, float]:
    """What a trial reports to Tune of one evaluation: every number of the record under its ``metrics.csv`` name
    (test_auc, train_loss, bytes_up, ..., ``task_auc.<task>``, ``client_auc.<id>``), ``worst_task_auc`` and
    ``worst_client_auc`` where the run has per-task or per-client AUCs, and ``done`` left to Tune."""
    metrics = {k: v for k, v in scalars(record).items() if is_reported(k)}
    return {k: metrics[k] for k in (*[k for k in REPORTED if k in metrics], *sorted(set(metrics) - set(REPORTED)))}


class TuneReport(Observer):
    """Reports every evaluation to Tune with a checkpoint of that moment (Tune keeps the checkpoints).

    Args:
        metric: the sweep's metric; a run whose first evaluation lacks it fails at once, naming what it reports
            (Tune itself would stop the whole sweep).
    """

    def __init__(self, config: Config, metric: str | None = None) -> None:
        self.config_dict = config.to_dict()
        self.metric = metric

    def record(self, record: dict, snapshot: Snapshot) -> None:
        from ray import tune

        from fdam_ray.checkpoint import save_checkpoint

        metrics = reported_metrics(record)
        if self.metric is not None and self.metric not in metrics:
            raise ValueError(f"tune option 'metric': this federation does not report {self.metric!r} (it reports "
                             f"{', '.join(metrics)}); per-client AUCs need clients with test splits of their own, "
                             "per-task AUCs a multi-task dataset")
        with tempfile.TemporaryDirectory() as d:
            save_checkpoint(Path(d) / CHECKPOINT_FILE, snapshot().with_config(self.config_dict))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))


def federation_trial(params: dict, base: dict, metric: str | None = None) -> None:
    """One Tune trial: the federation of ``base`` with ``params``, through :func:`fdam_ray.assembly.recipe.federate`
    (:func:`trainable` wraps it with its placement resources: use that in a Tuner of your own).

    Initial weights (``model_weights``) and pre-training (``pretrain_iterations``)
    apply as in ``fdam train``; a trial continued from a Tune checkpoint resumes
    from it instead. The sweep's ``trackers`` are Ray Tune's logger callbacks
    (:func:`fdam_ray.tuning.tracker_callbacks`), so a trial opens no tracker run of its own.
    """
    from ray import tune

    from fdam_ray.assembly.recipe import federate
    from fdam_ray.checkpoint import load_checkpoint, scratch_folder
    from fdam_ray.data.base import set_host_cpus
    from fdam_ray.executors.ray.session import assigned_cpus

    set_host_cpus(assigned_cpus())  # inline clients in this trial use the CPUs of its driver bundle
    trial_dir = Path(tune.get_context().get_trial_dir())
    config = build_config({**base, **params, "out_dir": str(trial_dir), "run_name": "run", "trackers": ()})
    resume = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            resume = load_checkpoint(Path(d) / CHECKPOINT_FILE)
    with scratch_folder(trial_scratch(trial_dir)):
        federate(config, resume=resume, run_dir=trial_dir / "run", checkpoints=False,
                 observers=[TuneReport(config, metric)])


def trial_scratch(trial_dir: Path) -> Path:
    """Where a trial's atomic writes keep their temporary files: beside the experiment's ``driver_artifacts``
    (which holds ``trial_dir`` and which Ray Tune copies to the storage path while trials write), on the same
    filesystem but outside what is copied."""
    return trial_dir.parent.parent / ".fdam-scratch" / trial_dir.name
