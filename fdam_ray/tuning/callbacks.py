"""Ray Tune's own logger callbacks for the experiment trackers a sweep names (MLflow, W&B).

A sweep's trials report to Tune, not to :mod:`fdam_ray.outputs.trackers`' observers; Tune's callbacks then log every
trial as a tracker run of its own, in the driver (where the tracker's settings and login are). Tune's callbacks
log a trial's ``config``, which holds only the searched values: the ones here log every field of the trial's
config instead (the base with the searched values), as ``fdam train`` does, and the reports carry the
``metrics.csv`` names (:func:`fdam_ray.outputs.trackers.tracker_metrics`), so a sweep trial and a run are logged alike.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from fdam_ray.config import build_config
from fdam_ray.outputs.trackers import check_usable, log_mlflow_params, run_tags, tracker_params
from fdam_ray.settings.sections import SECRET_FIELDS

log = logging.getLogger(__name__)


def trial_params(base: Mapping[str, Any], searched: Mapping[str, Any]) -> dict[str, Any]:
    """Every field of a trial's config as trackers record it: ``base`` with the trial's ``searched`` values,
    resolved as the trial resolves it."""
    return tracker_params(build_config({**base, **searched}).to_dict())


def tracker_callbacks(base: Mapping[str, Any]) -> list:
    """Ray Tune's logger callbacks for the trackers ``base`` names (its ``trackers`` field; none: an empty list),
    checked usable first: for a Tuner of your own, ``tune.RunConfig(callbacks=[*tracker_callbacks(base), ...])``
    logs each trial's full config and reports to MLflow (with the trial folder, its run and checkpoints, as
    artifacts) and to W&B, as ``fdam tune`` does."""
    config = build_config(dict(base))
    check_usable(config.trackers)
    callbacks: list[Any] = []
    if "mlflow" in config.trackers:
        callbacks.append(_mlflow_callback(dict(base), config))
    if "wandb" in config.trackers:
        callbacks.append(_wandb_callback(dict(base), config.tracker_project))
    return callbacks


def _mlflow_callback(base: dict[str, Any], config) -> Any:
    from ray.air.integrations.mlflow import MLflowLoggerCallback

    class FullConfigMLflow(MLflowLoggerCallback):
        """Tune's MLflow callback, logging every field of a trial's config (Tune logs the searched ones)."""

        def log_trial_start(self, trial) -> None:
            super().log_trial_start(trial)
            searched = dict(trial.config)
            rest = {k: v for k, v in trial_params(base, searched).items() if k not in searched}
            from mlflow.tracking import MlflowClient

            log_mlflow_params(MlflowClient(), self._trial_runs[trial], rest)  # Tune's util: one call per field

    # the trial folder holds config.yaml: with a secret field set, it stays on this machine
    secret = sorted(k for k in SECRET_FIELDS if config.to_dict().get(k) is not None)
    if secret:
        log.warning("mlflow: the trial folders are not uploaded as artifacts (their config.yaml holds %s, which "
                    "stays in the run folder)", ", ".join(secret))
    return FullConfigMLflow(experiment_name=config.tracker_project, save_artifact=not secret,
                            tags=run_tags(config.algorithm, config.dataset))


def _wandb_callback(base: dict[str, Any], project: str) -> Any:
    from ray.air.integrations.wandb import WandbLoggerCallback

    class FullConfigWandb(WandbLoggerCallback):
        """Tune's W&B callback, with every field of a trial's config as the W&B run's config."""

        def log_trial_start(self, trial) -> None:
            # Tune's callback passes its own keyword arguments to wandb.init after the trial's config: the trial's
            # full config goes in through them (one trial at a time: the callbacks run in the driver's loop)
            self.kwargs["config"] = trial_params(base, dict(trial.config))
            try:
                super().log_trial_start(trial)
            finally:
                self.kwargs.pop("config", None)

    # W&B runs each trial's logger in an actor that sees the cluster's environment, not this process's: pass
    # WANDB_MODE (offline) and WANDB_DIR on as wandb.init arguments
    settings: dict[str, Any] = {key: os.environ[var] for key, var in (("mode", "WANDB_MODE"), ("dir", "WANDB_DIR"))
                                if os.environ.get(var)}
    return FullConfigWandb(project=project, **settings)
