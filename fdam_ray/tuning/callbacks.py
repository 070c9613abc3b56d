"""Ray Tune's own logger callbacks for the experiment trackers a sweep names (MLflow, W&B).

A sweep's trials report to Tune, not to :mod:`fdam_ray.trackers`' observers; Tune's callbacks then log every
trial as a tracker run of its own.
"""

from __future__ import annotations

import os
from typing import Any

from fdam_ray.config import Config
from fdam_ray.trackers import check_usable


def tune_callbacks(config: Config) -> list:
    """Ray Tune's own logger callbacks for the trackers a sweep's base config names: every trial's config and
    reports (test_auc, per-task and per-client AUCs, bytes, ...) to MLflow (with the trial folder, its run and
    checkpoints, as artifacts) and to W&B."""
    check_usable(config.trackers)
    callbacks: list[Any] = []
    if "mlflow" in config.trackers:
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        callbacks.append(MLflowLoggerCallback(experiment_name=config.tracker_project, save_artifact=True))
    if "wandb" in config.trackers:
        from ray.air.integrations.wandb import WandbLoggerCallback

        # W&B runs each trial's logger in an actor that sees the cluster's environment, not this process's: pass
        # WANDB_MODE (offline) and WANDB_DIR on as wandb.init arguments
        settings: dict[str, Any] = {key: os.environ[var] for key, var in (("mode", "WANDB_MODE"), ("dir", "WANDB_DIR"))
                    if os.environ.get(var)}
        callbacks.append(WandbLoggerCallback(project=config.tracker_project, **settings))
    return callbacks
