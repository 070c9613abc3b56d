"""Adaptive clipping (``dp_clip_quantile``) against the best fixed clip of a small sweep, ``dp: client`` at a fixed
sigma.

digits (K = 16 clients, the Dirichlet partition at concentration 10, every client each round), the mlp of
benchmarks/privacy.py, sigma ``--sigma`` (default 1.0) given, not solved, so every run spends the same epsilon (the
accountant counts sigma; the adaptive run's update noise is sigma_z = (sigma^-2 - (2 sigma_b)^-2)^(-1/2) with the
default sigma_b = S / 20). Fixed clips 0.01, 0.03, 0.1, 0.3, 1; adaptive gamma 0.5 from C_1 = 0.1 (eta_C 0.2).
Final test AUC, mean over the seeds (paired: the same seeds and noise seeds in every arm).

    python benchmarks/adaptive_clip.py            # about 2 min on 2 CPU cores, inline

Last line: ``RESULT adaptive_auc=... best_fixed_auc=... best_fixed_clip=...``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _common as C
import numpy as np

DIGITS = {"dataset": "digits", "num_clients": 16, "partition": "dirichlet", "dirichlet_concentration": 10.0,
          "algorithm": "coda_plus", "model": "mlp", "model_width": 32,
          "lr": 0.1, "local_steps": 8, "batch_size": 32, "positive_ratio": 0.1, "executor": "inline",
          "tensorboard": False, "checkpoint_every": 0}
CLIPS = (0.01, 0.03, 0.1, 0.3, 1.0)


def run(config: dict) -> dict:
    import fdam_ray

    result = fdam_ray.train(config, save=False, progress=False)
    return {"auc": result.history[-1]["test_auc"], "clip": result.summary.get("dp_clip_final"),
            "epsilon": result.summary["dp_epsilon"]}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=320, help="local steps in all (rounds x 8)")
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--quantile", type=float, default=0.5)
    parser.add_argument("--out", default="benchmarks/results/adaptive_clip.md", help="none: --out ''")
    args = parser.parse_args(argv)
    base = {**DIGITS, "iterations": args.iterations, "eval_every": args.iterations // 8, "dp": "client",
            "dp_noise_multiplier": args.sigma}
    arms = [(f"fixed {c:g}", {"dp_clip": c}) for c in CLIPS]
    arms.append((f"adaptive gamma {args.quantile:g}", {"dp_clip": 0.1, "dp_clip_quantile": args.quantile}))
    rows, means = [], {}
    for name, extra in arms:
        t0 = time.perf_counter()
        runs = [run({**base, **extra, "seed": s, "dp_noise_seed": 100 + s}) for s in range(args.seeds)]
        aucs = [r["auc"] for r in runs]
        means[name] = float(np.mean(aucs))
        final = "" if runs[0]["clip"] is None else " / ".join(f"{r['clip']:.3g}" for r in runs)
        rows.append((name, f"{means[name]:.4f}", " / ".join(f"{a:.4f}" for a in aucs), final,
                     f"{runs[0]['epsilon']:.3g}", f"{time.perf_counter() - t0:.0f}"))
        print(f"  [{name}] AUC {means[name]:.4f} {final}", file=sys.stderr, flush=True)
    fixed = {c: means[f"fixed {c:g}"] for c in CLIPS}
    best = max(fixed, key=lambda c: fixed[c])
    adaptive = means[arms[-1][0]]
    table = C.table(("clip", "mean test AUC", "per seed", "final C (adaptive)", "epsilon", "seconds"), rows)
    line = C.result_line(adaptive_auc=adaptive, best_fixed_auc=fixed[best], best_fixed_clip=best)
    print(table)
    if args.out:
        C.write_results(Path(args.out), "Adaptive clipping against a fixed-clip sweep (dp: client, digits)",
                        C.command_line("adaptive_clip.py", argv),
                        f"K = S = 16, sigma {args.sigma:g}, {args.iterations // 8} rounds, {args.seeds} seeds.\n\n"
                        f"{table}\n\n{line}")
    print(line)
    return line


if __name__ == "__main__":
    main()
