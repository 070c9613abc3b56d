"""AUC maximization against the standard federated baselines: CODASCA vs FedAvg and SCAFFOLD with BCE.

The paper's motivation (Sec. 1): on imbalanced, heterogeneous data, optimising
an AUC surrogate beats optimising cross-entropy, and drift correction matters.
All algorithms train the same IH federation (K class-disjoint clients, imratio
0.1) with the same communication window I, iterations and batch; CODA+ (AUC
without drift correction) is run too, so the two effects can be told apart.
Each algorithm gets the best lr (and prox_weight) of one shared grid on a
tuning seed that is not a reported seed; the table reports the final test AUC
over the seeds.

    python benchmarks/vs_fedavg.py --quick         # committed results
    python benchmarks/vs_fedavg.py                 # larger budget and grid
    python benchmarks/vs_fedavg.py --dataset cifar100 --data-root DATA --clients 16 --iterations 20000 \\
        --local-steps 64 --executor ray            # on a cluster

Last line: ``RESULT codasca=... fedavg=... scaffold=... coda_plus=... gain_vs_fedavg=... gain_vs_scaffold=...``.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import _common as C

ALGORITHMS = {"codasca": "CODASCA", "coda_plus": "CODA+", "fedavg": "FedAvg", "scaffold": "SCAFFOLD"}
QUICK = {"iterations": 2048, "lrs": [0.1, 0.3, 1.0, 3.0], "prox_weights": [0.0, 0.002]}
FULL = {"iterations": 8192, "lrs": [0.03, 0.1, 0.3, 1.0, 3.0], "prox_weights": [0.0, 0.002]}


def parse_args(argv: list[str] | None):
    p = C.base_parser(__doc__.split("\n\n")[0])
    C.add_ih_args(p)
    p.add_argument("--auc-objective", default="auc_margin", choices=("auc_square", "auc_margin"),
                   help="objective of CODASCA and CODA+ (FedAvg and SCAFFOLD use bce)")
    p.add_argument("--local-steps", type=int, default=16, help="communication window I, the same for all")
    p.add_argument("--iterations", type=int, default=None)
    p.add_argument("--stage-length", type=int, default=None,
                   help="T0: lr / 3 every T0 iterations (a multiple of I; default: one stage of constant lr)")
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="tuning grid of lr (all algorithms)")
    p.add_argument("--prox-weights", type=float, nargs="+", default=None, help="tuning grid of prox_weight")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--tune-seed", type=int, default=100)
    args = p.parse_args(argv)
    C.check_args(args)
    mode = QUICK if args.quick else FULL
    for name in ("iterations", "lrs", "prox_weights"):
        if getattr(args, name) is None:
            setattr(args, name, mode[name])
    if args.stage_length is not None and args.stage_length % args.local_steps:
        p.error(f"--stage-length {args.stage_length} must be a multiple of --local-steps {args.local_steps}")
    if "codasca" not in args.algorithms or "fedavg" not in args.algorithms:
        p.error("--algorithms must include codasca and fedavg (the comparison this script reports)")
    args.base = C.ih_spec(args)
    return args


def spec(args, algorithm: str, **fields) -> dict:
    objective = "bce" if algorithm in ("fedavg", "scaffold") else args.auc_objective
    return {**args.base, "algorithm": algorithm, "objective": objective, "local_steps": args.local_steps,
            "iterations": args.iterations, "eval_every": max(1, args.iterations // 8),
            "stage_length": args.stage_length or args.iterations, **fields}


def measure(args) -> dict:
    grid = list(itertools.product(args.lrs, args.prox_weights))
    tuning_specs = [spec(args, a, lr=lr, prox_weight=pw, seed=args.tune_seed) for a in args.algorithms
                    for lr, pw in grid]
    if len(grid) > 1:
        chosen, tuning = C.tune_best(tuning_specs, ["algorithm"], workers=args.workers)
    else:
        chosen, tuning = {(s["algorithm"],): s for s in tuning_specs}, []
    specs = [{**chosen[(a,)], "seed": seed} for a in args.algorithms for seed in args.seeds]
    results = C.run_grid(specs, workers=args.workers, label="main ")
    return {"chosen": chosen, "tuning": tuning, "results": results,
            "final": C.group(results, ["algorithm"]), "best": C.group(results, ["algorithm"], "best_auc"),
            "wall_s": sum(r["wall_s"] for r in results + tuning)}


def report(args, m: dict, out: Path, command: str) -> str:
    final, best = m["final"], m["best"]
    rows = []
    for a in sorted(args.algorithms, key=lambda a: -final[(a,)].mean):
        s = m["chosen"][(a,)]
        rows.append([ALGORITHMS[a], s["objective"], s["lr"], s["prox_weight"], final[(a,)].fmt(), best[(a,)].fmt(),
                     f"{final[(a,)].lo:.4f} .. {final[(a,)].hi:.4f}"])
    gain = {b: final[("codasca",)].mean - final[(b,)].mean for b in args.algorithms if b != "codasca"}
    body = f"""
{args.dataset}-IH: K = {args.clients} class-disjoint clients, imratio {args.imratio}, model {args.model} (width \
{args.model_width}), batch {args.batch_size}, I = {args.local_steps}, {args.iterations} iterations \
({f"lr / 3 every {args.stage_length}" if args.stage_length else "one stage of constant lr"}), executor \
{args.executor}. Final test AUC, mean ± sample std over seeds \
{' '.join(map(str, args.seeds))}; "best" is the best of a run's evaluations (every \
{max(1, args.iterations // 8)} iterations), a measure of how much the last iterate lost.

{C.table(["algorithm", "objective", "lr", "prox_weight", "final test AUC", "best test AUC", "range"], rows)}

CODASCA minus each baseline (final AUC means): \
{", ".join(f"{ALGORITHMS[b]} {g:+.4f}" for b, g in gain.items())}.

lr and prox_weight: best final test AUC on tuning seed {args.tune_seed} over lr {args.lrs} x prox_weight \
{args.prox_weights}, per algorithm (the same grid for all). {len(m['results']) + len(m['tuning'])} runs, \
{m['wall_s'] / 60:.1f} min of run time.
"""
    C.write_results(out, "CODASCA (AUC) vs FedAvg and SCAFFOLD (BCE)", command, body)
    print(body)
    values = {a: final[(a,)].mean for a in args.algorithms}
    return C.result_line(**values, **{f"gain_vs_{b}": g for b, g in gain.items() if b in ("fedavg", "scaffold")})


def main(argv: list[str] | None = None) -> str:
    return C.run_script("vs_fedavg.py", argv, parse_args, measure, report)


if __name__ == "__main__":
    main(sys.argv[1:])
