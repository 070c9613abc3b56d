"""How far the histogram AUC (``test_scores: histogram``) is from the exact pooled AUC, at every evaluation.

Each evaluation of a ``test_scores: histogram`` run also scores the clients' test splits exactly (the same global
state) and records |AUC_hist - AUC_exact| per task with the reported bound and the passes asked; one training run
per job, the inline executor.

    python benchmarks/histogram_error.py                 # the default job (digits) and the hospitals study
    python benchmarks/histogram_error.py --job digits    # one of them

Last line: ``RESULT digits_max_err=... digits_eval0_err=... hospitals_max_err=... hospitals_eval0_err=...``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _common as C
import numpy as np

from fdam_ray.loop import evaluation
from fdam_ray.metrics import task_aucs
from fdam_ray.scores import histogram
from fdam_ray.scores.histogram import score_histograms

HOSPITALS = {"algorithm": "codasca", "model": "mlp", "model_width": 16, "lr": 0.1, "local_steps": 8,
             "batch_size": 16, "iterations": 800, "stage_length": 400, "eval_every": 200, "positive_ratio": 0.37}
RUN = {"executor": "inline", "tensorboard": False, "checkpoint_every": 0, "test_scores": "histogram"}


def measured(train) -> list[dict]:
    """Per test evaluation: the histogram AUC, the exact AUC (per task), its error and the passes it took. Where the
    driver scores a global test set itself (the default job), its scores are read through the same passes as
    the sites' would be (counts add: one site holding them all sends the same sums)."""
    rows: list[dict] = []
    original, passes = evaluation.Evaluator._pooled, evaluation.refined_aucs
    asked = {"n": 0}

    def counting(total, bins, ask, *args, **kwargs):
        def counted(binning):
            asked["n"] += 1
            return ask(binning)
        return passes(total, bins, counted, *args, **kwargs)

    def pooled(self, own, parts, state, split):
        asked["n"] = 1
        aucs, samples, counts = original(self, own, parts, state, split)
        if split != "test" or self.bins is None:
            return aucs, samples, counts
        if own is not None:  # the driver's own test set: exact above, through the histogram passes here
            s, y = own.scores, own.labels
            hist, _ = counting(score_histograms(s, y, self.bins), self.bins, lambda b: score_histograms(s, y, b))
            exact = np.asarray(aucs)
        else:
            hist = np.asarray(aucs)
            parts = [p for p in self.executor.evaluate(state) if p is not None]
            exact = task_aucs(np.concatenate([p.scores.reshape(len(p.scores), -1) for p in parts]),
                              np.concatenate([np.asarray(p.labels, np.float64).reshape(len(p.labels), -1)
                                              for p in parts]))
        rows.append({"hist": hist, "exact": exact, "passes": asked["n"],
                     "err": float(np.nanmax(np.abs(hist - exact)))})
        return aucs, samples, counts

    evaluation.Evaluator._pooled = pooled
    evaluation.refined_aucs = counting
    try:
        train()
    finally:
        evaluation.Evaluator._pooled, evaluation.refined_aucs = original, passes
    return rows


def digits(config: dict) -> list[dict]:
    import fdam_ray

    return measured(lambda: fdam_ray.train({**RUN, **config}, save=False, progress=False))


def hospitals(config: dict) -> list[dict]:
    import fdam_ray

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from hospitals import hospitals as sites

    data = sites()
    clients, tests = [train for _, train, _ in data], [test for _, _, test in data]
    return measured(lambda: fdam_ray.train_arrays({**RUN, **HOSPITALS, **config}, clients, None,
                                                  client_tests=tests, progress=False))


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", choices=("digits", "hospitals", "both"), default="both")
    parser.add_argument("--iterations", type=int, default=None, help="shorter runs (default: each job's own)")
    parser.add_argument("--out", default="benchmarks/results/histogram_error.md",
                        help="where the table is written (none: --out '')")
    args = parser.parse_args(argv)
    extra = {} if args.iterations is None else {"iterations": args.iterations,
                                                "eval_every": max(1, args.iterations // 4)}
    result = {}
    table = ["| job | evaluation | exact AUC | histogram AUC | abs error | passes |", "|---|---|---|---|---|---|"]
    for name, job in (("digits", digits), ("hospitals", hospitals)):
        if args.job not in (name, "both"):
            continue
        rows = job(extra)
        for i, r in enumerate(rows):
            print(f"{name} eval {i:2d}: exact {np.nanmean(r['exact']):.6f} hist {np.nanmean(r['hist']):.6f} "
                  f"|err| {r['err']:.2e} passes {r['passes']}")
            table.append(f"| {name} | {i} | {np.nanmean(r['exact']):.6f} | {np.nanmean(r['hist']):.6f} | "
                         f"{r['err']:.2e} | {r['passes']} |")
        result[f"{name}_max_err"] = max(r["err"] for r in rows)
        result[f"{name}_eval0_err"] = rows[0]["err"]
    line = "RESULT " + " ".join(f"{k}={v:.2e}" for k, v in result.items())
    print(f"tolerance {histogram.REFINE_TOLERANCE:g}, passes at most {histogram.MAX_PASSES}")
    if args.out:
        command = "python benchmarks/histogram_error.py " + " ".join(argv if argv is not None else sys.argv[1:])
        C.write_results(Path(args.out), "Histogram AUC against the exact pooled AUC, every evaluation",
                        command.strip(), f"Tolerance {histogram.REFINE_TOLERANCE:g}, at most {histogram.MAX_PASSES} "
                        f"passes, B = {histogram.DEFAULT_BINS} bins.\n\n" + "\n".join(table) + f"\n\n{line}")
    print(line)
    return line


if __name__ == "__main__":
    main()
