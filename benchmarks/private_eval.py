"""What private evaluation (``dp_eval: on``) costs in the pooled AUC: |AUC_released - AUC_exact| against the test
records' epsilon over a run's evaluations.

Fixed scores, hospitals-like: three sites of 300, 500 and 900 test records (positive shares 0.3, 0.2, 0.1), scores
the sigmoid of a binormal model whose exact pooled AUC is about 0.84. For each target epsilon (at delta 1e-5, over E
evaluations of one task) sigma_e is solved as a run solves it (:func:`fdam_ray.privacy.evaluation.solve_eval_noise`),
then many releases are drawn: the summed histogram of B bins plus N(0, sigma_e^2) per count, clipped at 0, the AUC
read off it (:func:`fdam_ray.scores.histogram.auc_of_counts`), as the driver does. The error is against the exact
AUC of the scores (the binning error of B bins included; it is below 1e-3 here). Mean and 95th percentile per point.

    python benchmarks/private_eval.py                    # table, plot, RESULT line
    python benchmarks/private_eval.py --draws 200        # quicker

Last line: ``RESULT eval_auc_err_eps1=... eval_auc_err_eps10=...`` (mean error at B = 32, the layout advised under
dp_eval).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _common as C
import numpy as np

from fdam_ray.metrics import task_aucs
from fdam_ray.privacy.evaluation import solve_eval_noise
from fdam_ray.scores.histogram import auc_of_counts, score_histograms

EPSILONS = (0.1, 0.3, 1.0, 3.0, 10.0)
BINS = (16, 32, 64, 256, 4096)
DEFAULT_BINS = 32  # the RESULT line's: the layout the docs advise under dp_eval
SITES = ((300, 0.3), (500, 0.2), (900, 0.1))
DELTA = 1e-5


def scores(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The pooled test scores and labels of the three sites (a site's histogram sums into the pooled one)."""
    rng = np.random.default_rng(seed)
    s, y = [], []
    for n, share in SITES:
        labels = (rng.random(n) < share).astype(np.float64)
        logits = rng.normal(-1.0 + 1.4 * labels, 1.0)
        s.append(1 / (1 + np.exp(-logits)))
        y.append(labels)
    return np.concatenate(s)[:, None], np.concatenate(y)[:, None]


def errors(hist: np.ndarray, exact: float, sigma: float, draws: int, rng: np.random.Generator) -> np.ndarray:
    """|AUC - exact| of ``draws`` releases of ``hist`` (1, 2, B) with noise std ``sigma`` (draws as tasks)."""
    out = []
    for start in range(0, draws, 100):
        k = min(100, draws - start)
        noised = np.maximum(hist + rng.normal(0.0, sigma, (k, *hist.shape[1:])), 0.0)
        out.append(np.abs(auc_of_counts(noised) - exact))
    return np.concatenate(out)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=2000, help="releases drawn per point")
    parser.add_argument("--evaluations", type=int, default=21, help="E, the run's evaluations epsilon covers")
    parser.add_argument("--out", default="benchmarks/results/private_eval.md", help="the table ('' : none)")
    args = parser.parse_args(argv)
    s, y = scores()
    exact = float(task_aucs(s, y)[0])
    rng = np.random.default_rng(1)
    rows, series, mean_at = [], {}, {}
    for bins in BINS:
        hist = score_histograms(s, y, bins).astype(np.float64)
        binned = float(auc_of_counts(hist)[0])
        xs, ys, spread = [], [], []
        for eps in EPSILONS:
            sigma = solve_eval_noise(eps, DELTA, tasks=1, releases=args.evaluations)
            err = errors(hist, exact, sigma, args.draws, rng)
            mean, p95 = float(err.mean()), float(np.percentile(err, 95))
            rows.append((bins, eps, f"{sigma:.3g}", f"{abs(binned - exact):.1e}", f"{mean:.4f}", f"{p95:.4f}"))
            print(f"B {bins:5d} eps {eps:5.1f}: sigma_e {sigma:8.3g}  |err| mean {mean:.4f} p95 {p95:.4f}")
            xs.append(eps)
            ys.append(mean)
            spread.append(None)
            if bins == DEFAULT_BINS:
                mean_at[eps] = mean
        series[f"B = {bins} (mean)"] = (xs, ys, None)
    line = C.result_line(eval_auc_err_eps1=mean_at[1.0], eval_auc_err_eps10=mean_at[10.0])
    if args.out:
        out = Path(args.out)
        plot = out.with_suffix(".png")
        C.figure(plot, series, xlabel="epsilon of the test records (over the run's evaluations)",
                 ylabel="|AUC released - AUC exact|", title=f"dp_eval: pooled AUC error, E = {args.evaluations}, "
                 f"n = {len(y)}", logx=True, logy=True)
        body = (f"n = {len(y)} test records at 3 sites (positives {int(y.sum())}), exact pooled AUC {exact:.4f}; E = "
                f"{args.evaluations} evaluations, delta {DELTA:g}, one task; {args.draws} releases per point.\n\n"
                + C.table(("B", "epsilon", "sigma_e", "binning error", "mean abs error", "95th pct"), rows)
                + f"\n\n![error against epsilon]({plot.name})\n\n{line}")
        C.write_results(out, "Private evaluation: the pooled AUC's error against the test records' epsilon",
                        C.command_line("private_eval.py", argv), body)
    print(line)
    return line


if __name__ == "__main__":
    main()
