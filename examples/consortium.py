"""Three hospitals that share no cluster run the study they simulated: CODASCA over Flower's deployment engine.

The three sites of ``hospitals.py`` (scikit-learn's breast-cancer data dealt to
a general hospital, a screening centre and a referral centre) first run the
study as a simulation (``fdam_ray.train_arrays``: on Ray, or in this process
with ``--quick``). Then the same config file, plus its ``flower:`` section, runs
as a consortium on this machine: a SuperLink and one SuperNode per site, each a
process of its own listening on 127.0.0.1 only, every connection TLS with
certificates this script makes, only registered SuperNodes admitted. ``flwr
run`` submits the study (its config's text travels in the run config) and the
server writes its run folder (metrics, summary, a checkpoint after every round)
in ``server-run/``, the guide's layout (docs/how-to/consortium.md). Each site
reads only its own ``.npz`` file and keeps its state (c^k, sampler position) in
a file of its own. The script prints both runs' test AUC and the largest
difference between their final global states (0 without SecAgg+, about 1e-6
with it: its fixed-point quantisation).

    python examples/consortium.py --quick            # a few minutes on 2 CPU cores (each message starts a process)
    python examples/consortium.py --secagg           # the server sees only the sums of the sites' updates
    python examples/consortium.py --folder runs/consortium   # keep the logs, certificates and site states
    python examples/consortium.py --quick --timeout 1800     # a busy machine: wait longer for the consortium
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

import fdam_ray
from fdam_ray.config import load_config_file
from fdam_ray.flower.deployment import Consortium, write_app

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hospitals import hospitals  # the sites of hospitals.py

STUDY = dict(algorithm="codasca", objective="auc_margin", model="linear", batch_size=32, seed=0, lr=0.1,
             global_lr=1.1, prox_weight=0.002, local_steps=20, iterations=400, stage_length=200, eval_every=100)
QUICK = dict(local_steps=5, iterations=15, stage_length=10, eval_every=15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds over 2 stages; the simulation in-process")
    parser.add_argument("--secagg", action="store_true", help="combine the updates with SecAgg+")
    parser.add_argument("--folder", help="where the consortium writes (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds the consortium may take to start and to run the study (default 900)")
    args = parser.parse_args()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run(Path(args.folder or tmp), quick=args.quick, secagg=args.secagg, timeout=args.timeout)
    except (TimeoutError, RuntimeError, ValueError) as exc:  # each is one line naming what to do; no traceback
        sys.exit(f"consortium.py: {exc}")


def run(folder: Path, *, quick: bool, secagg: bool, timeout: float = 900.0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    sites = hospitals()
    # the study's config file, with its flower section; the simulation reads the same file (and ignores that section)
    config = folder / "study.yaml"
    config.write_text(yaml.safe_dump({**STUDY, **(QUICK if quick else {}), "num_clients": len(sites),
                                      # on Ray, updates folded in site order, as the consortium folds them
                                      **({"executor": "inline"} if quick else
                                         {"executor": "ray", "fold_order": "client"}),
                                      "flower": {"secagg": secagg, "round_timeout_s": 600}}), encoding="utf-8")
    print("1. the study as a simulation (" + ("in this process" if quick else "on Ray") + ")")
    simulated = fdam_ray.train_arrays(load_config_file(str(config)), [train for _, train, _ in sites], None,
                                      client_tests=[test for _, _, test in sites])
    print(f"   test AUC {simulated.summary['final_test_auc']:.4f}")

    # 2. each site's data in a file only that site reads
    nodes = []
    for k, (name, (x, y), (x_test, y_test)) in enumerate(sites):
        np.savez(folder / f"{name}.npz", x=x, y=y, x_test=x_test, y_test=y_test)
        nodes.append({"site": k, "data": str(folder / f"{name}.npz"), "state-dir": str(folder / f"{name}-state")})
    print("2. the consortium: a SuperLink and 3 SuperNodes on 127.0.0.1 with TLS" + (", SecAgg+" if secagg else ""))
    start = time.perf_counter()
    with Consortium(folder / "consortium", nodes, timeout=timeout) as consortium:
        # the study travels in the run config (its text); the server writes its run folder on its own host
        consortium.run(write_app(folder / "app"), config, folder / "result.npz", run_dir=folder / "server-run")
    result = np.load(folder / "result.npz")
    history = yaml.safe_load(str(result["history"]))
    gap = max(float(np.abs(result[name].astype(np.float64) - getattr(simulated.state, name)).max())
              for name in ("v", "alpha") if result[name].size)
    print(f"   test AUC {history[-1]['test_auc']:.4f} in {time.perf_counter() - start:.0f} s")
    print(f"   largest difference from the simulation's final state: {gap:.2e}")
    print(f"   the server's run folder (metrics, summary, checkpoint): {folder / 'server-run'}")


if __name__ == "__main__":
    main()
