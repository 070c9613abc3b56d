"""The clinical read-out's DeLong SE and 95 % interval from histograms against exact DeLong and a bootstrap (a);
partial AUC of models trained for it (b).

Each test evaluation of a ``test_scores: histogram``, ``clinical: on`` run is read three ways on the same global
state: the histogram figures (the finest cells the refinement passes resolve, what the record reports; where the
driver scores a global test set itself, the default job, its scores are read through the same passes as the sites'
would be), exact DeLong on the pooled scores (this file's own implementation, by midranks, Sun & Xu 2014, not the
library's bins), and a stratified bootstrap of the pooled scores (the SE and the 2.5/97.5 % percentiles). One
training run per job, the inline executor.

(b) pAUC(FPR <= 0.1), normalised by 0.1 (in [0, 1]), of the final model of three trainings with paired seeds on
each study: AUC-M federated (``objective: auc_margin``), the federated pAUC objective (``pauc_one_way``, its
normaliser from the sites' summed training-score counts) and the same objective on the pooled data (``algorithm:
centralized``, K = 1 holding every site's training data: the central reference). The read-out is the clinical
record's (pooled test counts); a figure draws each model's ROC curve from the same counts with the pAUC region
shaded (``benchmarks/results/clinic_pauc.png``).

    python benchmarks/clinic.py            # the default job (digits) and the hospitals study
    python benchmarks/clinic.py --quick    # shorter runs (a quarter of the iterations), 200 resamples, one seed

Last line: ``RESULT delong_se_rel_err=... delong_ci_abs_err=... pauc_gain_over_aucm=... pauc_gap_to_central=...
pauc_study=...`` (a: the largest over evaluations and tasks of |SE_hist / SE_exact - 1| and of the Wald endpoints'
|hist - exact|, targets 2 % and 1e-3; b: the mean over seeds of federated pAUC - AUC-M's and of central - federated
on the study with the larger gain, targets >= 0.01 and |gap| <= 0.005).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _common as C
import numpy as np
from _clinic_pauc import pauc_part
from histogram_error import HOSPITALS
from scipy.stats import rankdata
from sklearn.metrics import roc_auc_score

from fdam_ray.loop import evaluation
from fdam_ray.scores import clinic
from fdam_ray.scores.histogram import score_histograms
from fdam_ray.scores.histogram_passes import Pooled

RUN = {"executor": "inline", "tensorboard": False, "checkpoint_every": 0, "test_scores": "histogram",
       "clinical": "on"}
Z = 1.959963984540054


def exact_delong(scores: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """AUC and DeLong's SE by midranks: V10 = (rank among all - rank among positives) / n, V01 = 1 - (rank among
    all - rank among negatives) / m."""
    x, y = scores[labels == 1], scores[labels == 0]
    m, n = len(x), len(y)
    tz = rankdata(np.concatenate([x, y]))
    v10 = (tz[:m] - rankdata(x)) / n
    v01 = 1 - (tz[m:] - rankdata(y)) / m
    return float(v10.mean()), float(np.sqrt(v10.var(ddof=1) / m + v01.var(ddof=1) / n))


def bootstrap(scores: np.ndarray, labels: np.ndarray, draws: int, seed: int) -> tuple[float, float, float]:
    """The SE and the 2.5 / 97.5 % percentiles of the AUC over ``draws`` resamples within each class."""
    rng = np.random.default_rng(seed)
    x, y = scores[labels == 1], scores[labels == 0]
    lab = np.r_[np.ones(len(x)), np.zeros(len(y))]
    aucs = np.array([roc_auc_score(lab, np.r_[rng.choice(x, len(x)), rng.choice(y, len(y))]) for _ in range(draws)])
    return float(aucs.std(ddof=1)), *map(float, np.percentile(aucs, [2.5, 97.5]))


def replayed(s: np.ndarray, y: np.ndarray, bins: int) -> np.ndarray:
    """The driver's own test scores read through the refinement passes, as the sites' counts would be."""
    pooled = Pooled.first(score_histograms(s, y, bins), bins)
    for _ in range(7):
        again = pooled.refinement()
        if again is None:
            break
        pooled = pooled.add(score_histograms(s, y, again), again)
    return clinic.padded([c.counts for c in pooled.tasks])


def measured(train, draws: int) -> list[dict]:
    """Per test evaluation and task: the histogram and exact AUC, SE and Wald interval, and the bootstrap's."""
    rows: list[dict] = []
    original = evaluation.Evaluator._pooled

    def pooled(self, own, parts, state, split):
        out = original(self, own, parts, state, split)
        if split != "test":
            return out
        if own is not None:
            s, y = own.scores, own.labels
            counts = replayed(s, y, self.bins)
        else:
            counts = self._counts
            got = [p for p in self.executor.evaluate(state) if p is not None]
            s = np.concatenate([p.scores.reshape(len(p.scores), -1) for p in got])
            y = np.concatenate([np.asarray(p.labels, np.float64).reshape(len(p.labels), -1) for p in got])
        s, y = s.reshape(len(s), -1).astype(np.float64), np.asarray(y, np.float64).reshape(len(s), -1)
        auc, var = clinic.delong(counts)
        low, high = clinic.interval(auc, var)
        for t in range(s.shape[1]):
            keep = ~np.isnan(y[:, t])
            e_auc, e_se = exact_delong(s[keep, t], y[keep, t])
            b_se, b_low, b_high = bootstrap(s[keep, t], y[keep, t], draws, seed=len(rows))
            rows.append({"task": t, "auc": auc[t], "se": float(np.sqrt(var[t])), "low": low[t], "high": high[t],
                         "e_auc": e_auc, "e_se": e_se, "e_low": e_auc - Z * e_se, "e_high": e_auc + Z * e_se,
                         "b_se": b_se, "b_low": b_low, "b_high": b_high, "n": int(keep.sum())})
        return out

    evaluation.Evaluator._pooled = pooled
    try:
        train()
    finally:
        evaluation.Evaluator._pooled = original
    return rows


def digits(config: dict, draws: int) -> list[dict]:
    import fdam_ray

    return measured(lambda: fdam_ray.train({**RUN, **config}, save=False, progress=False), draws)


def hospitals(config: dict, draws: int) -> list[dict]:
    import fdam_ray

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from hospitals import hospitals as sites

    data = sites()
    clients, tests = [train for _, train, _ in data], [test for _, _, test in data]
    return measured(lambda: fdam_ray.train_arrays({**RUN, **HOSPITALS, **config}, clients, None,
                                                  client_tests=tests, progress=False), draws)


def digits_run(config: dict):
    """One training of the default job (part b), clinical read-out on."""
    import fdam_ray

    return fdam_ray.train({**RUN, **config}, save=False, progress=False)


def hospitals_run(config: dict):
    """One training of the hospitals study (part b); ``config["num_clients"] == 1``: every site's training data
    pooled into one client (the test splits stay per site; the read-out pools them)."""
    import fdam_ray

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from hospitals import hospitals as sites

    data = sites()
    clients, tests = [train for _, train, _ in data], [test for _, _, test in data]
    if config.get("algorithm") == "centralized":
        clients, tests = ([(np.concatenate([x for x, _ in part]), np.concatenate([y for _, y in part]))]
                          for part in (clients, tests))
    return fdam_ray.train_arrays({**RUN, **HOSPITALS, **config}, clients, None, client_tests=tests, progress=False)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", choices=("digits", "hospitals", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="a quarter of each job's iterations, 200 resamples")
    parser.add_argument("--draws", type=int, default=None, help="bootstrap resamples (default 500, --quick 200)")
    parser.add_argument("--out", default="benchmarks/results/clinic.md",
                        help="where the table is written (none: --out '')")
    parser.add_argument("--seeds", type=int, default=None, help="paired seeds of part (b) (default 3, --quick 1)")
    parser.add_argument("--skip-a", action="store_true", help="part (b) only")
    args = parser.parse_args(argv)
    draws = args.draws or (200 if args.quick else 500)
    table = ["| job | eval | task | n | AUC exact | SE exact | SE hist | SE bootstrap | Wald CI exact | "
             "Wald CI hist | bootstrap 95 % |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    se_err, ci_err, boot = 0.0, 0.0, []
    started = time.perf_counter()
    for name, job in (("digits", digits), ("hospitals", hospitals)):
        if args.job not in (name, "both") or args.skip_a:
            continue
        extra = {}
        if args.quick:
            iterations = 1000 if name == "digits" else HOSPITALS["iterations"] // 4
            extra = {"iterations": iterations, "eval_every": max(1, iterations // 4)}
        for i, r in enumerate(job(extra, draws)):
            se_err = max(se_err, abs(r["se"] / r["e_se"] - 1))
            ci_err = max(ci_err, abs(r["low"] - r["e_low"]), abs(r["high"] - r["e_high"]))
            boot.append(r["b_se"] / r["e_se"])
            print(f"{name} eval {i:2d} task {r['task']}: AUC {r['e_auc']:.6f} SE exact {r['e_se']:.6f} hist "
                  f"{r['se']:.6f} boot {r['b_se']:.6f}")
            table.append(f"| {name} | {i} | {r['task']} | {r['n']} | {r['e_auc']:.6f} | {r['e_se']:.3e} | "
                         f"{r['se']:.3e} | {r['b_se']:.3e} | [{r['e_low']:.5f}, {r['e_high']:.5f}] | "
                         f"[{r['low']:.5f}, {r['high']:.5f}] | [{r['b_low']:.5f}, {r['b_high']:.5f}] |")
    note = ("" if not boot else f"Bootstrap ({draws} stratified resamples) SE / exact DeLong SE: median "
            f"{np.median(boot):.3f}, range [{min(boot):.3f}, {max(boot):.3f}]. ")
    studies = [n for n in ("digits", "hospitals") if args.job in (n, "both")]
    b_text, b_result = pauc_part(studies, args.quick, args.seeds or (1 if args.quick else 3), args.out,
                                 {"digits": digits_run, "hospitals": hospitals_run})
    line = f"RESULT delong_se_rel_err={se_err:.2e} delong_ci_abs_err={ci_err:.2e} {b_result}"
    note += f"Wall {time.perf_counter() - started:.0f} s."
    print(note)
    if args.out:
        command = "python benchmarks/clinic.py " + " ".join(argv if argv is not None else sys.argv[1:])
        C.write_results(Path(args.out), "DeLong SE and 95 % interval from histograms, exact and bootstrapped",
                        command.strip(), "B = 4096 bins, the refined cells of every evaluation.\n\n"
                        + "\n".join(table) + f"\n\n{note}\n\n{b_text}\n\n{line}")
    print(line)
    return line


if __name__ == "__main__":
    main()
