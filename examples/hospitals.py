"""Three hospitals train one breast-cancer classifier without pooling their patients.

The data is scikit-learn's bundled Wisconsin diagnostic breast-cancer set (569
patients, 30 features of a fine-needle aspirate, 212 malignant): real and
imbalanced. It is dealt to three "hospitals" that differ the way sites do:

    general     a large hospital seeing mostly benign findings (about 15% malignant)
    screening   a mid-sized screening centre (about 30% malignant)
    referral    a small referral centre that receives suspicious cases (about 70% malignant)

Each keeps a quarter of its patients as its own test split. CODASCA then
maximises AUC across the three with ``fdam_ray.train_arrays``; the script
prints the pooled test AUC (all sites' test scores pooled, then one AUC) and
each site's own AUC, next to what each site reaches training on its own data
alone.

    python examples/hospitals.py              # about a minute on 2 CPU cores (Ray start-up included)
    python examples/hospitals.py --quick      # a few seconds: fewer iterations, clients in this process
    python examples/hospitals.py --config private.yaml   # the study with fields of your own (privacy, say)
"""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.datasets import load_breast_cancer

import fdam_ray

# (name, share of the benign patients, share of the malignant patients)
SITES = (("general", 0.60, 0.20), ("screening", 0.30, 0.25), ("referral", 0.10, 0.55))


def hospitals(seed: int = 0):
    """Per site: (name, (X_train, y_train), (X_test, y_test)); y = 1 for malignant."""
    data = load_breast_cancer()
    X = data.data.astype(np.float32)
    y = (data.target == 0).astype(np.float32)  # scikit-learn codes malignant as 0
    rng = np.random.default_rng(seed)
    # Features on one scale. Sites would agree on these statistics (a mean and a spread per feature, no
    # patient record) before training; computed here over all patients for brevity.
    X = (X - X.mean(0)) / X.std(0)
    by_class = {c: rng.permutation(np.flatnonzero(y == c)) for c in (0, 1)}
    starts = {0: 0, 1: 0}
    sites = []
    for name, benign_share, malignant_share in SITES:
        idx = []
        for c, share in ((0, benign_share), (1, malignant_share)):
            n = round(share * len(by_class[c]))
            idx.append(by_class[c][starts[c] : starts[c] + n])
            starts[c] += n
        idx = rng.permutation(np.concatenate(idx))
        test = np.zeros(len(idx), bool)
        for c in (0, 1):  # a quarter of each class held out as the site's test split
            of_class = idx[y[idx] == c]
            test[np.isin(idx, of_class[: max(1, len(of_class) // 4)])] = True
        sites.append((name, (X[idx[~test]], y[idx[~test]]), (X[idx[test]], y[idx[test]])))
    return sites


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (the test suite's)")
    parser.add_argument("--executor", choices=("ray", "inline"), default=None,
                        help="where the hospitals' clients run (default: ray; --quick: inline)")
    parser.add_argument("--config", default=None,
                        help="a YAML file of config fields that replace the study's own (dp fields, say)")
    args = parser.parse_args(argv)
    executor = args.executor or ("inline" if args.quick else "ray")
    own = {}
    if args.config:
        from fdam_ray.files.yamlfile import read_yaml_file

        own = read_yaml_file(args.config, "--config") or {}
        if not isinstance(own, dict):
            parser.error(f"--config {args.config}: a mapping of config fields, not {type(own).__name__}")
    sites = hospitals()
    config = {
        "algorithm": "codasca", "model": "mlp", "model_width": 16, "lr": 0.1, "local_steps": 8,
        "batch_size": 16, "iterations": 80 if args.quick else 800, "stage_length": 40 if args.quick else 400,
        "eval_every": 40 if args.quick else 200, "executor": executor, "tensorboard": False,
    }
    print(f"{'site':<10} {'train':>6} {'malignant':>9} {'test':>5}")
    for name, (_, y_train), (_, y_test) in sites:
        print(f"{name:<10} {len(y_train):>6} {y_train.mean():>9.0%} {len(y_test):>5}")

    result = fdam_ray.train_arrays({**config, **own}, [train for _, train, _ in sites], test=None,
                                   client_tests=[test for _, _, test in sites])
    final = result.history[-1]
    alone = []
    for _, train, test in sites:  # each site on its own data only, the same budget of local steps
        own = fdam_ray.train_arrays({**config, "algorithm": "centralized", "executor": "inline"}, [train], test=test)
        alone.append(own.history[-1]["test_auc"])

    print(f"\nCODASCA over 3 hospitals, {final['iteration']} iterations, {final['round']} rounds")
    print(f"pooled test AUC: {final['test_auc']:.4f}")
    if "dp_epsilon" in final:
        print(f"training records: epsilon {final['dp_epsilon']:.3f} (the largest site's), delta {final['dp_delta']:g}")
    if "dp_eval_epsilon" in final:
        print(f"test records: epsilon {final['dp_eval_epsilon']:.3f}, delta {final['dp_eval_delta']:g}")
    print(f"{'site':<10} {'federated AUC':>13} {'site alone':>10}")
    for k, (name, _, _) in enumerate(sites):
        federated = final.get("client_auc", {}).get(str(k))  # not recorded under dp_eval
        shown = "-" if federated is None else f"{federated:.4f}"
        print(f"{name:<10} {shown:>13} {alone[k]:>10.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
