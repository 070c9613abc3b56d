"""Your own Ray Tune Tuner over whole federations: your search space, ASHA, and a callback of your own.

``fdam tune`` is one way to sweep; this is the other: ``fdam_ray.tuning.trainable``
turns a base config into a Ray Tune trainable (each trial a whole federation in
its own placement group, reporting every evaluation with a checkpoint), and the
rest is plain Ray Tune: any searcher, scheduler, stopper or callback. Here ASHA
stops weak settings of CODASCA's lr at the first evaluations, and a callback
prints each trial's AUC as it is reported.

    python examples/own_tuner.py                    # 6 trials, a few minutes on 2 CPU cores
    python examples/own_tuner.py --quick            # 2 short trials (the test suite's)
    python examples/own_tuner.py --out my_sweeps    # where Tune's experiment folder goes (default: tune_results)
    python examples/own_tuner.py --trackers mlflow  # every trial to MLflow too (or wandb, or mlflow,wandb)
    python examples/own_tuner.py --address HOST:6379  # the trials on a Ray cluster

Ray is started as ``fdam train`` and ``fdam tune`` start it (README, "Trust"):
the cluster ``--address`` (or ``RAY_ADDRESS``) names, else this user's ``ray
start`` cluster of this machine, else a private instance whose every process
listens on 127.0.0.1 only, with token authentication. Left to itself, Ray Tune
would start one listening on every interface of the machine.

Each trial's run folder (``metrics.csv``, ``train.log``, ``config.yaml``,
``model.pt``) is ``run/`` in its trial folder, so ``fdam plot`` takes the
experiment folder as it takes ``fdam tune``'s.
"""

from __future__ import annotations

import argparse
import os
from datetime import datetime

from ray import tune
from ray.tune.schedulers import ASHAScheduler

from fdam_ray.executors.ray.session import ensure_ray
from fdam_ray.tuning import tracker_callbacks, trainable


class PrintAUC(tune.Callback):
    """A callback of your own: one line per report (Ray Tune calls it in the driver)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def on_trial_result(self, iteration, trials, trial, result, **info):
        line = f"trial lr={trial.config['lr']}: iteration {result['iteration']}, test AUC {result['test_auc']:.4f}"
        self.lines.append(line)
        print(line, flush=True)


def base_config(quick: bool, trackers: str = "") -> dict:
    return {
        "algorithm": "codasca", "dataset": "synthetic", "num_clients": 3, "heterogeneity": 1.5,
        "samples_per_client": 200, "model": "mlp", "model_width": 16, "batch_size": 32, "local_steps": 5,
        "iterations": 60 if quick else 400, "stage_length": 30 if quick else 200, "eval_every": 20 if quick else 50,
        "executor": "inline", "threads_per_actor": 1, "tensorboard": False, "trackers": trackers,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two short trials (the test suite's)")
    parser.add_argument("--out", default="tune_results", help="folder for Tune's experiment folder")
    parser.add_argument("--trackers", default="", help="experiment trackers: mlflow, wandb or mlflow,wandb")
    parser.add_argument("--address", default=None,
                        help="a Ray cluster to join (host:port); default: RAY_ADDRESS, else your `ray start` cluster "
                             "of this machine, else a private Ray on 127.0.0.1")
    args = parser.parse_args(argv)
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")  # a local disk
    ensure_ray(address=args.address, cpus_needed=1)  # before the Tuner, which would start Ray on every interface

    base = base_config(args.quick, args.trackers)
    lrs = [0.1, 0.01] if args.quick else [0.3, 0.1, 0.03, 0.01, 0.003, 0.001]
    printer = PrintAUC()
    tuner = tune.Tuner(
        trainable(base, metric="test_auc", driver_cpus=1),
        param_space={"lr": tune.grid_search(lrs)},
        tune_config=tune.TuneConfig(
            metric="test_auc", mode="max",
            scheduler=ASHAScheduler(time_attr="iteration", max_t=base["iterations"],
                                    grace_period=base["eval_every"], reduction_factor=2)),
        run_config=tune.RunConfig(
            name=f"own-tuner-{datetime.now():%Y%m%d-%H%M%S}", storage_path=os.path.abspath(args.out),
            callbacks=[printer, *tracker_callbacks(base)]),
    )
    results = tuner.fit()
    best = results.get_best_result()
    print(f"\nexperiment folder: {results.experiment_path}")
    print(f"best lr: {best.config['lr']} (test AUC {best.metrics['test_auc']:.4f}, trial {best.path})")
    print(f"its run folder: {os.path.join(best.path, 'run')}")
    return 0 if not results.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
