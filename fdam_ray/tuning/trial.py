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
from fdam_ray.outputs import Observer, Snapshot
from fdam_ray.tuning.space import REPORTED

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


class TuneReport(Observer):
    """Reports every evaluation to Tune with a checkpoint of that moment (Tune keeps the checkpoints)."""

    def __init__(self, config: Config) -> None:
        self.config_dict = config.to_dict()

    def record(self, record: dict, snapshot: Snapshot) -> None:
        from ray import tune

        from fdam_ray.checkpoint import save_checkpoint

        metrics = {k: record[k] for k in REPORTED if record.get(k) is not None}
        with tempfile.TemporaryDirectory() as d:
            save_checkpoint(Path(d) / CHECKPOINT_FILE, {"config": self.config_dict, **snapshot()})
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))


def federation_trial(params: dict, base: dict) -> None:
    """One Tune trial: the federation of ``base`` with ``params``, through :func:`fdam_ray.recipe.federate`.

    Initial weights (``model_weights``) and pre-training (``pretrain_iterations``)
    apply as in ``fdam train``; a trial continued from a Tune checkpoint resumes
    from it instead.
    """
    from ray import tune

    from fdam_ray.checkpoint import load_checkpoint
    from fdam_ray.recipe import federate

    trial_dir = Path(tune.get_context().get_trial_dir())
    config = build_config({**base, **params, "out_dir": str(trial_dir), "run_name": "run"})
    resume = None
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            resume = load_checkpoint(Path(d) / CHECKPOINT_FILE)
    federate(config, resume=resume, run_dir=trial_dir / "run", checkpoints=False, observers=[TuneReport(config)])
