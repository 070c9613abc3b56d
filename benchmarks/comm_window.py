"""Communication window: how large I can grow before the test AUC drops (the paper's I_max, Sec. 5.1).

CODA+ and CODASCA train the same IH federation (K class-disjoint clients,
imratio 0.1, the test set untouched and balanced) for the same number of
iterations at every communication window I, over several seeds. I_max of an
algorithm is the largest I whose mean final test AUC is at least the mean at
I = 1 minus a tolerance. The paper reports I_max 4x larger for CODASCA
(ImageNet-IH: 128 vs 32 at K = 16, 512 vs 128 at K = 8).

Hyperparameters are tuned the same way for both algorithms: the best final
test AUC over one grid of (lr, prox_weight, global_lr) on a tuning seed that
is not one of the reported seeds, at every I (default: I_max then compares
each algorithm at its best at every I) or once at I = 1 (``--tune-at 1``).
Tuning at I = 1 picks the largest stable lr, and eta I then grows with I
until both algorithms fail early (see the results file). A run is one stage
of constant lr by default: a stage
switch needs a stage length that is a multiple of every I, and zeroes the
control variates, so at large I a stage would hold few rounds, the first of
them uncorrected; ``--stage-length`` brings back the paper's decay by 3.

    python benchmarks/comm_window.py --quick                       # committed results
    python benchmarks/comm_window.py                               # larger budget, grid up to 1024
    python benchmarks/comm_window.py --dataset cifar100 --data-root DATA --clients 16 --model resnet20 \\
        --iterations 20000 --grid 1 32 64 128 512 1024 --lrs 0.1 0.01 --prox-weights 0.002 0.001 \\
        --stage-length 4096 --executor ray                         # the paper's CIFAR100-IH on a cluster

Last line: ``RESULT imax_codasca=... imax_coda_plus=... ratio=...``.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import _common as C

ALGORITHMS = ("coda_plus", "codasca")
NAMES = {"coda_plus": "CODA+", "codasca": "CODASCA"}
# --quick: 2048 iterations leave 8 rounds at I = 256; the full mode's 8192 leave 8 at I = 1024.
QUICK = {"iterations": 2048, "grid": [1, 4, 16, 64, 256], "lrs": [0.3, 1.0, 3.0], "prox_weights": [0.002]}
FULL = {"iterations": 8192, "grid": [1, 4, 16, 64, 256, 1024], "lrs": [0.1, 0.3, 1.0, 3.0],
        "prox_weights": [0.0, 0.002]}


def parse_args(argv: list[str] | None):
    p = C.base_parser(__doc__.split("\n\n")[0])
    C.add_ih_args(p)
    p.add_argument("--objective", default="auc_margin", choices=("auc_square", "auc_margin"))
    p.add_argument("--iterations", type=int, default=None, help="local steps per client, the same for every I")
    p.add_argument("--grid", type=int, nargs="+", default=None, help="communication windows I (must hold 1)")
    p.add_argument("--stage-length", type=int, default=None, help="T0 of the stagewise decay (default: one stage)")
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="tuning grid of lr")
    p.add_argument("--prox-weights", type=float, nargs="+", default=None, help="tuning grid of prox_weight")
    p.add_argument("--global-lrs", type=float, nargs="+", default=[1.0], help="tuning grid of global_lr")
    p.add_argument("--tune-at", default="each", choices=("1", "each"),
                   help="tune at every I (default), or once at I = 1")
    p.add_argument("--tune-seed", type=int, default=100, help="seed of the tuning runs (not a reported seed)")
    p.add_argument("--tolerance", type=float, default=0.005, help="AUC drop from I = 1 that I_max allows")
    args = p.parse_args(argv)
    C.check_args(args)
    mode = QUICK if args.quick else FULL
    args.base = C.ih_spec(args)
    for name in ("iterations", "grid", "lrs", "prox_weights"):
        if getattr(args, name) is None:
            setattr(args, name, mode[name])
    args.grid = sorted(set(args.grid))
    if 1 not in args.grid:
        p.error("--grid must hold I = 1 (I_max is measured against it)")
    if max(args.grid) > args.iterations:
        p.error(f"--grid: I = {max(args.grid)} is more than --iterations {args.iterations}")
    if args.stage_length is not None and args.stage_length % max(args.grid):
        p.error(f"--stage-length {args.stage_length} must be a multiple of every I in the grid")
    return args


def base_spec(args) -> dict:
    return {**args.base, "objective": args.objective, "iterations": args.iterations, "eval_every": args.iterations,
            "stage_length": args.stage_length or args.iterations}


def tune(args, base: dict) -> tuple[dict, list[dict]]:
    """Best (lr, prox_weight, global_lr) per algorithm (and per I with --tune-at each) on the tuning seed."""
    windows = [1] if args.tune_at == "1" else args.grid
    grid = list(itertools.product(args.lrs, args.prox_weights, args.global_lrs))
    specs = [{**base, "algorithm": alg, "local_steps": i, "lr": lr, "prox_weight": pw, "global_lr": glr,
              "seed": args.tune_seed}
             for alg in ALGORITHMS for i in windows for lr, pw, glr in grid]
    if len(grid) == 1:
        return {(s["algorithm"], s["local_steps"]): s for s in specs}, []
    return C.tune_best(specs, ["algorithm", "local_steps"], workers=args.workers)


def hyper(chosen: dict, alg: str, i: int) -> dict:
    spec = chosen[(alg, i)] if (alg, i) in chosen else chosen[(alg, 1)]
    return {k: spec[k] for k in ("lr", "prox_weight", "global_lr")}


def measure(args) -> dict:
    """Tune, run every (algorithm, I, seed), and derive I_max; returns everything the report needs."""
    base = base_spec(args)
    chosen, tuning = tune(args, base)
    specs = [{**base, "algorithm": alg, "local_steps": i, **hyper(chosen, alg, i), "seed": seed}
             for alg in ALGORITHMS for i in args.grid for seed in args.seeds]
    results = C.run_grid(specs, workers=args.workers, label="main ")
    by = C.group(results, ["algorithm", "local_steps"])
    imax = {alg: C.imax({i: by[(alg, i)].mean for i in args.grid}, args.tolerance) for alg in ALGORITHMS}
    return {"chosen": chosen, "tuning": tuning, "results": results, "by": by, "imax": imax,
            "wall_s": sum(r["wall_s"] for r in results + tuning)}


def report(args, m: dict, out: Path, command: str) -> str:
    by, imax, grid = m["by"], m["imax"], args.grid
    base = {alg: by[(alg, 1)].mean for alg in ALGORITHMS}
    rows = []
    for i in grid:
        row = [i, args.iterations // i]
        for alg in ALGORITHMS:
            s = by[(alg, i)]
            ok = math.isfinite(s.mean) and s.mean >= base[alg] - args.tolerance
            row += [s.fmt(), f"{s.mean - base[alg]:+.4f}", "yes" if ok else "no"]
        rows.append(row)
    headers = ["I", "rounds"]
    for alg in ALGORITHMS:
        headers += [f"{NAMES[alg]} AUC", "vs I=1", "kept"]
    top = max(grid)
    ratio = imax["codasca"] / imax["coda_plus"]
    hyper_rows = []
    for alg in ALGORITHMS:
        for i in ([1] if args.tune_at == "1" else grid):
            h = hyper(m["chosen"], alg, i)
            hyper_rows.append([NAMES[alg], "all" if args.tune_at == "1" else i, h["lr"], h["prox_weight"],
                               h["global_lr"]])
    i1_gap = abs(by[("codasca", 1)].mean - by[("coda_plus", 1)].mean)
    seeds = " ".join(map(str, args.seeds))
    body = f"""
{NAMES['coda_plus']} vs {NAMES['codasca']} on {args.dataset}-IH: K = {args.clients} class-disjoint clients, imratio \
{args.imratio}, model {args.model} (width {args.model_width}), {args.objective}, batch {args.batch_size}, \
{args.iterations} iterations for every I, \
{"one stage of constant lr" if not args.stage_length else f"lr / 3 every {args.stage_length} iterations"}, \
executor {args.executor}. Final test AUC, mean ± sample std over seeds {seeds}; "kept" = within \
{args.tolerance} of the same algorithm's I = 1 mean.

{C.table(headers, rows)}

**I_max: CODASCA {imax['codasca']}{'+' if imax['codasca'] == top else ''}, CODA+ {imax['coda_plus']}\
{'+' if imax['coda_plus'] == top else ''}; ratio {ratio:g}** (paper: 4, i.e. 128 vs 32 at K = 16 and 512 vs 128 \
at K = 8 on ImageNet-IH; "+" = the largest I of the grid, so I_max may be larger).

At I = 1 with global_lr 1 the two algorithms are the same computation (the control variates cancel); their \
means differ here by {i1_gap:.4f}.

Hyperparameters (best final test AUC on tuning seed {args.tune_seed} over lr {args.lrs} x prox_weight \
{args.prox_weights} x global_lr {args.global_lrs}, {"at I = 1" if args.tune_at == "1" else "at every I"}, the \
same grid for both algorithms):

{C.table(["algorithm", "I", "lr", "prox_weight", "global_lr"], hyper_rows)}

{len(m['results']) + len(m['tuning'])} runs, {m['wall_s'] / 60:.1f} min of run time. Figure: \
`{out.with_suffix('.png').name}`.
"""
    C.write_results(out, "Communication window: I_max of CODA+ and CODASCA", command, body)
    series = {NAMES[a]: (grid, [by[(a, i)].mean for i in grid], [by[(a, i)].std for i in grid]) for a in ALGORITHMS}
    C.figure(out.with_suffix(".png"), series, xlabel="communication window I", ylabel="final test AUC",
             title=f"{args.dataset}-IH, K={args.clients}, {args.iterations} iterations; "
                   f"dotted: CODASCA I=1 - {args.tolerance}",
             hline=base["codasca"] - args.tolerance)
    print(body)
    return C.result_line(imax_codasca=imax["codasca"], imax_coda_plus=imax["coda_plus"], ratio=float(ratio))


def main(argv: list[str] | None = None) -> str:
    return C.run_script("comm_window.py", argv, parse_args, measure, report)


if __name__ == "__main__":
    main(sys.argv[1:])
