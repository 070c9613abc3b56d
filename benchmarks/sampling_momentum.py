"""Balanced positive sampling and local momentum, each against the plain client step, on paired seeds.

On an IH federation (K class-disjoint clients, imratio positives on each) a
natural batch of 32 at 10 % positives holds about 3 positives and often fewer;
``positive_sampling: balanced`` fills each batch with ``positive_share``
positives (the few repeat, LibAUC's DualSampler). ``momentum`` adds a heavy-ball
buffer to each client's local step. Three variants share everything else (the
algorithm, I, iterations and, per seed, the data, the initial network and the
seed of the batch draws): the plain step (natural batches, momentum 0),
balanced batches (whose objective takes p = the positive share), and momentum.
Momentum runs at lr (1 - mu) by default, so its steady step lr (1 - mu) / (1 -
mu) is the plain step's (at the plain lr of 0.3 and mu 0.9, a step ten times
larger, every momentum run diverged). Each variant's difference from the plain
step is taken seed by seed (paired), with its 90 % t-interval.

    python benchmarks/sampling_momentum.py --quick     # committed results
    python benchmarks/sampling_momentum.py             # longer runs

Last line: ``RESULT plain=... balanced=... momentum=... balanced_gain=... momentum_gain=...``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import _common as C
from _stats import t_interval

VARIANTS = ("plain", "balanced", "momentum")
QUICK = {"iterations": 768}
FULL = {"iterations": 3072}


def parse_args(argv: list[str] | None):
    p = C.base_parser(__doc__.split("\n\n")[0])
    C.add_ih_args(p)
    p.set_defaults(dataset="digits")
    p.add_argument("--algorithm", default="codasca", choices=("codasca", "coda_plus"))
    p.add_argument("--objective", default="auc_margin", choices=("auc_square", "auc_margin"))
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--local-steps", type=int, default=16, help="communication window I")
    p.add_argument("--iterations", type=int, default=None)
    p.add_argument("--momentum", type=float, default=0.9, help="mu of the momentum variant")
    p.add_argument("--momentum-lr", type=float, default=None, help="lr of the momentum variant (default lr (1 - mu))")
    p.add_argument("--positive-share", type=float, default=0.5, help="positive share of the balanced variant")
    args = p.parse_args(argv)
    C.check_args(args)
    if args.iterations is None:
        args.iterations = (QUICK if args.quick else FULL)["iterations"]
    if not 0 < args.momentum < 1 or not 0 < args.positive_share < 1:
        p.error("--momentum and --positive-share must lie in (0, 1)")
    if args.momentum_lr is None:
        args.momentum_lr = args.lr * (1 - args.momentum)
    args.base = C.ih_spec(args)
    return args


def spec(args, variant: str, seed: int) -> dict:
    fields = {"positive_sampling": "balanced", "positive_share": args.positive_share} if variant == "balanced" \
        else {"momentum": args.momentum, "lr": args.momentum_lr} if variant == "momentum" else {}
    return {**args.base, "algorithm": args.algorithm, "objective": args.objective, "lr": args.lr,
            "local_steps": args.local_steps, "iterations": args.iterations, "stage_length": args.iterations,
            "eval_every": max(1, args.iterations // 4), "seed": seed, "_variant": variant, **fields}


def measure(args) -> dict:
    specs = [spec(args, v, seed) for v in VARIANTS for seed in args.seeds]
    results = C.run_grid(specs, workers=args.workers, label="")
    final = {v: {r["spec"]["seed"]: r["final_auc"] for r in results if r["spec"]["_variant"] == v}
             for v in VARIANTS}
    return {"results": results, "final": final, "wall_s": sum(r["wall_s"] for r in results)}


def paired(final: dict, variant: str, seeds: list[int]) -> tuple[list[float], tuple[float, float, float]]:
    """Per-seed differences variant - plain (seeds where both ran finite) and their 90 % t-interval."""
    diffs = [final[variant][s] - final["plain"][s] for s in seeds
             if math.isfinite(final[variant][s]) and math.isfinite(final["plain"][s])]
    return diffs, (t_interval(diffs) if diffs else (math.nan, math.nan, math.nan))


def report(args, m: dict, out: Path, command: str) -> str:
    final = m["final"]
    label = {"plain": "natural, momentum 0", "balanced": f"balanced (share {args.positive_share:g}), momentum 0",
             "momentum": f"natural, momentum {args.momentum:g}, lr {args.momentum_lr:g}"}
    rows, gains = [], {}
    for v in VARIANTS:
        s = C.stats([final[v][seed] for seed in args.seeds])
        per_seed = " ".join(f"{final[v][seed]:.4f}" for seed in args.seeds)
        if v == "plain":
            rows.append([label[v], s.fmt(), per_seed, "", ""])
            continue
        diffs, (mean, lo, hi) = paired(final, v, args.seeds)
        gains[v] = mean
        rows.append([label[v], s.fmt(), per_seed, " ".join(f"{d:+.4f}" for d in diffs),
                     f"{mean:+.4f} [{lo:+.4f}, {hi:+.4f}]"])
    body = f"""
{args.dataset}-IH: K = {args.clients} class-disjoint clients, imratio {args.imratio}, model {args.model} (width \
{args.model_width}), batch {args.batch_size}, {args.algorithm} with {args.objective}, lr {args.lr:g} (momentum: \
{args.momentum_lr:g}), I = \
{args.local_steps}, {args.iterations} iterations (one stage), executor {args.executor}. Final test AUC, mean ± \
sample std over seeds {' '.join(map(str, args.seeds))}; each seed fixes the data, the initial network and the \
batch draws of all three variants (paired). The last column is the mean of the per-seed differences from the \
plain step with its 90 % t-interval.

{C.table(["client step", "final test AUC", "per seed", "minus plain, per seed", "mean difference [90 % CI]"],
         rows)}

{len(m['results'])} runs, {m['wall_s'] / 60:.1f} min of run time.
"""
    C.write_results(out, "Balanced positive sampling and local momentum vs the plain client step", command, body)
    print(body)
    means = {v: C.stats(list(final[v].values())).mean for v in VARIANTS}
    return C.result_line(**means, balanced_gain=gains["balanced"], momentum_gain=gains["momentum"])


def main(argv: list[str] | None = None) -> str:
    return C.run_script("sampling_momentum.py", argv, parse_args, measure, report)


if __name__ == "__main__":
    main(sys.argv[1:])
