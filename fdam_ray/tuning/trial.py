"""One Ray Tune trial: a whole federation, assembled like any run, reporting every evaluation.

Each trial reserves one placement group: a driver bundle plus, with the Ray
executor, one bundle per actor (``cpus_per_actor``, ``gpus_per_actor``; an
actor hosts ``clients_per_actor`` clients), so its actors run inside the
trial's reservation and concurrent trials
cannot deadlock waiting for each other's CPUs. Every evaluation is reported to
Tune with a checkpoint of the federation (global state, control variates,
schedule position), so a stopped sweep resumes (``fdam tune --resume DIR``)
and a paused trial continues where it was.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from fdam_ray.config import Config, build_config
from fdam_ray.outputs import Observer, Snapshot, scalars
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
    """One Tune trial: the federation of ``base`` with ``params``, through :func:`fdam_ray.recipe.federate`.

    Initial weights (``model_weights``) and pre-training (``pretrain_iterations``)
    apply as in ``fdam train``; a trial continued from a Tune checkpoint resumes
    from it instead. The sweep's ``trackers`` are Ray Tune's logger callbacks
    (:func:`fdam_ray.tuning.callbacks.tune_callbacks`), so a trial opens no tracker run of its own.
    """
    from ray import tune

    from fdam_ray.checkpoint import load_checkpoint, scratch_folder
    from fdam_ray.data.base import set_host_cpus
    from fdam_ray.executors.ray.session import assigned_cpus
    from fdam_ray.recipe import federate

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
