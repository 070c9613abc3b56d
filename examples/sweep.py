"""A Ray Tune sweep from Python: pick CODASCA's lr and communication window I for the worst-off client.

Every trial is a whole federation (here K = 3 clients on synthetic data whose
clients are shifted apart). The sweep selects on ``worst_client_auc``, the
lowest of the clients' own test AUCs at each evaluation, rather than on the
pooled AUC, so a setting that serves two clients well and the third badly
loses. At the end the sweep folder holds the table of trials and
``best_config.yaml``, a ready ``fdam train --config`` file, whose settings the
script prints.

    python examples/sweep.py                    # 6 trials, about a minute on 2 CPU cores
    python examples/sweep.py --quick            # 2 short trials (the test suite's)
    python examples/sweep.py --out my_sweeps    # where the sweep folder goes (default: tune_results)
    python examples/sweep.py --trackers mlflow  # every trial to MLflow too (or wandb, or mlflow,wandb)

``--trackers`` sets the config field ``trackers`` of ``base``: every trial's
config and reports go to the experiment tracker through Ray Tune's own logger
callbacks (the ``mlflow`` or ``wandb`` extra: ``pip install -e ".[mlflow]"`` in the checkout).
"""

from __future__ import annotations

import argparse
from datetime import datetime

import yaml

from fdam_ray.tuning import make_space, run_sweep


def space(quick: bool, out: str, trackers: str = "") -> dict:
    base = {
        "algorithm": "codasca", "dataset": "synthetic", "num_clients": 3, "heterogeneity": 1.5,
        "samples_per_client": 200, "model": "mlp", "model_width": 16, "batch_size": 32,
        "iterations": 60 if quick else 400, "stage_length": 30 if quick else 200, "eval_every": 30 if quick else 100,
        "tensorboard": False, "threads_per_actor": 1,
        # each trial's clients run in its own process here; with executor: ray each is a Ray actor and a trial
        # reserves driver_cpus + one bundle of cpus_per_actor per actor (clients_per_actor clients each)
        "executor": "inline",
        "trackers": trackers,
    }
    search = {"lr": {"grid": [0.1, 0.01]}} if quick else {"lr": {"grid": [0.3, 0.1, 0.01]},
                                                          "local_steps": {"grid": [4, 32]}}
    if quick:
        base["local_steps"] = 5
    tune = {"metric": "worst_client_auc", "mode": "max", "searcher": "grid", "driver_cpus": 1,
            "storage_path": out, "name": f"worst-client-{datetime.now():%Y%m%d-%H%M%S}"}
    return {"base": base, "search": search, "tune": tune}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two short trials (the test suite's)")
    parser.add_argument("--out", default="tune_results", help="folder for the sweep folder")
    parser.add_argument("--trackers", default="", help="experiment trackers: mlflow, wandb or mlflow,wandb")
    args = parser.parse_args(argv)

    outcome = run_sweep(make_space(space(args.quick, args.out, args.trackers)))
    print(f"\nsweep folder: {outcome.path}")
    print((outcome.path / "sweep_results.md").read_text())
    if outcome.best_config is None:
        print("no trial finished without an error: see", outcome.errors_file)
        return 1
    best = yaml.safe_load(outcome.best_config.read_text())
    print(f"best config: {outcome.best_config}")
    print("  " + ", ".join(f"{k}={best[k]}" for k in ("lr", "local_steps", "iterations")))
    print(f"train it: fdam train --config {outcome.best_config}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
