"""Communication window: how large I can grow before the test AUC drops (the paper's I_max, Sec. 5.1).

CODA+ and CODASCA train the same IH federation (K class-disjoint clients,
imratio 0.1, the test set untouched and balanced) for the same number of
iterations at every communication window I, over 5 seeds (0..4) by default.
The paper reports I_max 4x larger for CODASCA (ImageNet-IH: 128 vs 32 at K = 16,
512 vs 128 at K = 8): "the largest value of I such that the performance does
not degenerate too much compared with I = 1".

Runs are paired across I: a seed fixes every client's training samples (the
partition), the initial weights and every client's sequence of minibatches (a
client draws one batch per local step, and every I runs the same number of
steps), so the runs of one seed differ only in I and in the hyperparameters
tuned for it. The script checks this on the clients it would build for every
run (digests of their data, initial weights and minibatch indices) before
training. I_max is then read from the paired differences
d_s = AUC(I, s) - AUC(1, s), not from two means:

* the interval: a two-sided 90% interval of the mean of d_s over the seeds,
  Student's t (default) or a percentile bootstrap over seeds with a fixed RNG
  seed (``--interval bootstrap``);
* the tolerance, per algorithm: max(0.005, the half-width of the same 90%
  interval of that algorithm's I = 1 mean AUC), i.e. a drop counts only if it
  is larger than the uncertainty that the seeds leave in the I = 1 figure
  itself; ``--tolerance`` fixes one value for both instead;
* the rule: I is *lost* when the whole interval lies below -tolerance (the
  seeds show a drop larger than the tolerance), or when a run at I diverged;
  otherwise it is *kept*: "yes" when the whole interval lies at or above
  -tolerance (shown within the tolerance), "yes*" when the interval reaches
  across -tolerance (within the tolerance is consistent with the seeds but
  not shown). I_max is the largest kept I; the stricter "shown" I_max, the
  largest I marked "yes", is reported beside it. One noisy seed widens the
  interval rather than moving a mean across a line, so it cannot decide I_max
  alone. With a single seed there is no interval: I is kept when d >= -tolerance.
A seed whose I = 1 run diverged is left out of every difference.

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

Last line: ``RESULT imax_codasca=... imax_coda_plus=... ratio=... imax_shown_codasca=...
imax_shown_coda_plus=... tolerance_codasca=... tolerance_coda_plus=... seeds=...``.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import sys
from pathlib import Path

import _common as C
import _stats
import numpy as np

ALGORITHMS = ("coda_plus", "codasca")
NAMES = {"coda_plus": "CODA+", "codasca": "CODASCA"}
SEEDS = [0, 1, 2, 3, 4]
LEVEL = 0.9  # two-sided level of every interval
TOLERANCE_FLOOR = 0.005
BOOTSTRAP = {"resamples": 10000, "seed": 0}  # fixed, so the table is reproducible
# --quick: 2048 iterations leave 8 rounds at I = 256; the full mode's 8192 leave 8 at I = 1024.
QUICK = {"iterations": 2048, "grid": [1, 4, 16, 64, 256], "lrs": [0.3, 1.0, 3.0], "prox_weights": [0.002]}
FULL = {"iterations": 8192, "grid": [1, 4, 16, 64, 256, 1024], "lrs": [0.1, 0.3, 1.0, 3.0],
        "prox_weights": [0.0, 0.002]}


def parse_args(argv: list[str] | None):
    p = C.base_parser(__doc__.split("\n\n")[0])
    p.set_defaults(seeds=SEEDS)
    for action in p._actions:
        if action.dest == "seeds":
            action.help = f"run seeds, paired across I (default {' '.join(map(str, SEEDS))})"
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
    p.add_argument("--interval", default="t", choices=("t", "bootstrap"),
                   help=f"the {LEVEL:.0%} interval over seeds: Student's t (default) or a percentile bootstrap "
                        f"(RNG seed {BOOTSTRAP['seed']}, {BOOTSTRAP['resamples']} resamples)")
    p.add_argument("--tolerance", type=float, default=None,
                   help=f"AUC drop from I = 1 that I_max allows (default: max({TOLERANCE_FLOOR}, the half-width of "
                        f"the {LEVEL:.0%} interval of each algorithm's I = 1 mean AUC measured in the run)")
    args = p.parse_args(argv)
    C.check_args(args)
    mode = QUICK if args.quick else FULL
    args.base = C.ih_spec(args)
    for name in ("iterations", "grid", "lrs", "prox_weights"):
        if getattr(args, name) is None:
            setattr(args, name, mode[name])
    args.grid = sorted(set(args.grid))
    args.seeds = sorted(set(args.seeds))
    if 1 not in args.grid:
        p.error("--grid must hold I = 1 (I_max is measured against it)")
    if max(args.grid) > args.iterations:
        p.error(f"--grid: I = {max(args.grid)} is more than --iterations {args.iterations}")
    if args.stage_length is not None and args.stage_length % max(args.grid):
        p.error(f"--stage-length {args.stage_length} must be a multiple of every I in the grid")
    if args.tolerance is not None and not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        p.error(f"--tolerance {args.tolerance}: must be a finite number >= 0")
    if args.tune_seed in args.seeds:
        p.error(f"--tune-seed {args.tune_seed} is one of --seeds {args.seeds}: tuning must not see a reported seed")
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


# -- pairing ----------------------------------------------------------------------------------------
PAIRED = ("data", "init", "batches")


def pairing_fingerprint(spec: dict) -> dict[str, str]:
    """SHA-256 digests of what a run's seed fixes, taken from the clients the run itself builds.

    ``data``: every client's training samples and labels (the partition; labels only for a dataset read
    from disk); ``init``: the initial flat state (weights, a, b, alpha; the driver builds the same from
    the same seed); ``batches``: every client's minibatch indices for all ``iterations`` local steps.
    Two specs whose digests agree train from the same data, the same start and the same batches.
    """
    import torch

    from fdam_ray.clients.client import Client, ClientSection
    from fdam_ray.config import build_config
    from fdam_ray.data.base import Split

    cfg = build_config({**C.RUN_DEFAULTS, **{k: v for k, v in spec.items() if not k.startswith("_")}})
    source = C._cached_source(cfg)
    section = ClientSection.of(cfg)
    h = {name: hashlib.sha256() for name in PAIRED}

    def add(name: str, array) -> None:
        arr = np.ascontiguousarray(array.numpy() if isinstance(array, torch.Tensor) else np.asarray(array))
        h[name].update(str((arr.dtype, arr.shape)).encode())
        h[name].update(arr.tobytes())

    for k in range(cfg.num_clients):
        client = Client(section, source, k, device=torch.device("cpu"))
        if isinstance(client.train, Split):
            add("data", client.train.x)
        add("data", client.train.y)
        if k == 0:
            for part in client.flat.export():
                add("init", part)
        stream = client.sampler.stream
        add("batches", np.concatenate([stream.next().numpy() for _ in range(cfg.iterations)]))
    return {name: d.hexdigest() for name, d in h.items()}


def check_pairing(specs: list[dict]) -> dict:
    """Check that every run of a seed shares data, initial weights and minibatches (raises if not), and
    count how many distinct digests the seeds give (one per seed when the seeds differ)."""
    by_seed: dict[int, dict[str, str]] = {}
    for spec in specs:
        digest = pairing_fingerprint(spec)
        first = by_seed.setdefault(spec["seed"], digest)
        differ = [name for name in PAIRED if digest[name] != first[name]]
        if differ:
            raise RuntimeError(f"seed {spec['seed']}: the run {C._short(spec)} does not share its "
                               f"{', '.join(differ)} with the seed's other runs, so runs are not paired across I")
    distinct = {name: len({d[name] for d in by_seed.values()}) for name in PAIRED}
    return {"seeds": len(by_seed), "runs": len(specs), "distinct": distinct}


# -- paired differences -----------------------------------------------------------------------------
def interval(values: list[float], method: str) -> tuple[float, float, float]:
    """(mean, low, high) of the ``LEVEL`` interval of the mean of ``values``; NaN bounds under 2 values."""
    if len(values) < 2:
        return float(np.mean(values)), math.nan, math.nan
    if method == "bootstrap":
        return _stats.bootstrap_interval(values, LEVEL, **BOOTSTRAP)
    return _stats.t_interval(values, LEVEL)


def noise_tolerance(baseline: list[float], method: str) -> tuple[float, float]:
    """(tolerance, half-width): max(``TOLERANCE_FLOOR``, the half-width of the interval of the mean of one
    algorithm's I = 1 AUCs ``baseline``); the half-width is NaN, and the tolerance the floor, under 2 seeds."""
    _, lo, hi = interval(baseline, method)
    half = (hi - lo) / 2
    return max(TOLERANCE_FLOOR, half) if math.isfinite(half) else TOLERANCE_FLOOR, half


def verdict(diffs: list[float], diverged: int, tolerance: float, method: str) -> dict:
    """The paired differences of one (algorithm, I) and whether I is kept (see the module docstring)."""
    if not diffs:
        return {"n": 0, "mean": math.nan, "lo": math.nan, "hi": math.nan, "kept": False, "mark": "no (diverged)"}
    mean, lo, hi = interval(diffs, method)
    if diverged:
        kept, mark = False, f"no ({diverged} diverged)"
    elif not math.isfinite(lo):  # one seed: the difference alone
        kept = mean >= -tolerance
        mark = "yes" if kept else "no"
    elif hi < -tolerance:
        kept, mark = False, "no"
    else:
        kept, mark = True, "yes" if lo >= -tolerance else "yes*"
    return {"n": len(diffs), "mean": mean, "lo": lo, "hi": hi, "kept": kept, "mark": mark}


def paired(args, results: list[dict], tolerance: float | None) -> dict:
    """Per (algorithm, I): the paired differences to I = 1 over the seeds, their interval and verdict."""
    auc = {(r["spec"]["algorithm"], r["spec"]["local_steps"], r["spec"]["seed"]): r["final_auc"] for r in results}
    ok = {alg: [s for s in args.seeds if math.isfinite(auc[(alg, 1, s)])] for alg in ALGORITHMS}
    for alg in ALGORITHMS:
        if not ok[alg]:
            raise SystemExit(f"every I = 1 run of {NAMES[alg]} diverged: no baseline to compare against")
    baseline = {alg: [auc[(alg, 1, s)] for s in ok[alg]] for alg in ALGORITHMS}
    measured = {alg: noise_tolerance(baseline[alg], args.interval) for alg in ALGORITHMS}
    tol = {alg: measured[alg][0] if tolerance is None else tolerance for alg in ALGORITHMS}
    rows = {}
    for alg in ALGORITHMS:
        for i in args.grid:
            values = [auc[(alg, i, s)] for s in ok[alg]]
            diffs = [v - b for v, b in zip(values, baseline[alg], strict=True) if math.isfinite(v)]
            rows[(alg, i)] = verdict(diffs, len(values) - len(diffs), tol[alg], args.interval)
    imax = {alg: max(i for i in args.grid if rows[(alg, i)]["kept"]) for alg in ALGORITHMS}
    shown = {alg: max(i for i in args.grid if rows[(alg, i)]["mark"] == "yes") for alg in ALGORITHMS}
    return {"rows": rows, "tolerance": tol, "measured": measured, "imax": imax,
            "imax_shown": shown, "dropped": {alg: sorted(set(args.seeds) - set(ok[alg])) for alg in ALGORITHMS}}


def measure(args) -> dict:
    """Tune, check the pairing, run every (algorithm, I, seed), and derive I_max from paired differences."""
    base = base_spec(args)
    chosen, tuning = tune(args, base)
    specs = [{**base, "algorithm": alg, "local_steps": i, **hyper(chosen, alg, i), "seed": seed}
             for alg in ALGORITHMS for i in args.grid for seed in args.seeds]
    pairing = check_pairing(specs)
    results = C.run_grid(specs, workers=args.workers, label="main ")
    by = C.group(results, ["algorithm", "local_steps"])
    return {"chosen": chosen, "tuning": tuning, "results": results, "by": by, "pairing": pairing,
            "paired": paired(args, results, args.tolerance),
            "wall_s": sum(r["wall_s"] for r in results + tuning)}


# -- report -----------------------------------------------------------------------------------------
def _interval_text(row: dict) -> str:
    if not math.isfinite(row["mean"]):
        return "-"
    if not math.isfinite(row["lo"]):
        return f"{row['mean']:+.4f}"
    return f"{row['mean']:+.4f} [{row['lo']:+.4f}, {row['hi']:+.4f}]"


def report(args, m: dict, out: Path, command: str) -> str:
    by, grid, pr = m["by"], args.grid, m["paired"]
    rows_p, tol, imax, shown = pr["rows"], pr["tolerance"], pr["imax"], pr["imax_shown"]
    rows = []
    for i in grid:
        row = [i, args.iterations // i]
        for alg in ALGORITHMS:
            row += [by[(alg, i)].fmt(), _interval_text(rows_p[(alg, i)]), rows_p[(alg, i)]["mark"]]
        rows.append(row)
    headers = ["I", "rounds"]
    for alg in ALGORITHMS:
        headers += [f"{NAMES[alg]} AUC", f"d = AUC - AUC(I=1) [{LEVEL:.0%}]", "kept"]
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
    n = len(args.seeds)
    method = ("Student's t interval, t_0.95,n-1 s / sqrt(n)" if args.interval == "t" else
              f"percentile bootstrap over seeds, {BOOTSTRAP['resamples']} resamples, RNG seed {BOOTSTRAP['seed']}")
    halves = ", ".join(f"{NAMES[a]} {pr['measured'][a][1]:.4f}" for a in ALGORITHMS)
    tols = ", ".join(f"{NAMES[a]} **{tol[a]:.4f}**" for a in ALGORITHMS)
    if args.tolerance is None:
        tol_text = (f"per algorithm, max({TOLERANCE_FLOOR}, the half-width of the {LEVEL:.0%} interval of its I = 1 "
                    + (f"mean AUC: {halves}) = {tols}" if n > 1 else "mean AUC, not measurable with one seed) = "
                       + tols))
    else:
        default = ", ".join(f"{NAMES[a]} {pr['measured'][a][0]:.4f}" for a in ALGORITHMS)
        tol_text = (f"**{args.tolerance:.4f}** for both, fixed by --tolerance (the default from this run's I = 1 "
                    f"spread would be {default})")
    pc = m["pairing"]
    distinct = ", ".join(f"{pc['distinct'][k]} {k}" for k in PAIRED)
    dropped = "; ".join(f"{NAMES[a]} seed(s) {' '.join(map(str, s))} left out (the I = 1 run diverged)"
                        for a, s in pr["dropped"].items() if s)

    def mark(alg: str, table: dict) -> str:
        return f"{table[alg]}{'+' if table[alg] == top else ''}"

    body = f"""
{NAMES['coda_plus']} vs {NAMES['codasca']} on {args.dataset}-IH: K = {args.clients} class-disjoint clients, imratio \
{args.imratio}, model {args.model} (width {args.model_width}), {args.objective}, batch {args.batch_size}, \
{args.iterations} iterations for every I, \
{"one stage of constant lr" if not args.stage_length else f"lr / 3 every {args.stage_length} iterations"}, \
executor {args.executor}. Final test AUC, mean ± sample std over {n} seeds ({seeds}).

**Paired across I.** A seed fixes every client's training samples (the partition), the initial weights and \
every client's minibatch order (one batch per local step, the same {args.iterations} steps at every I); the test \
set is the same for every seed. Checked in this run on the clients each of the {pc['runs']} runs builds: within \
each seed all runs (both algorithms, every I) share the SHA-256 digests of the clients' data, the initial state \
and the minibatch indices, and the {pc['seeds']} seeds give {distinct} digests. Not shared across I: I itself, the \
hyperparameters tuned for it (below), and float rounding.

**Rule.** d = AUC(I, seed) - AUC(I = 1, seed) per seed; the column gives the mean of d and its {LEVEL:.0%} interval \
({method}). Tolerance: {tol_text}. "no": the whole interval lies below -tolerance (a drop larger than the \
tolerance is shown), or a run diverged; "yes": the whole interval lies at or above -tolerance; "yes*": the interval \
reaches across -tolerance (consistent with the tolerance, not shown). I_max = the largest I marked "yes" or "yes*"; \
"shown" I_max = the largest I marked "yes".{(' ' + dropped + '.') if dropped else ''}

{C.table(headers, rows)}

**I_max: CODASCA {mark('codasca', imax)}, CODA+ {mark('coda_plus', imax)}; ratio {ratio:g}** (shown: CODASCA \
{mark('codasca', shown)}, CODA+ {mark('coda_plus', shown)}; paper: 4, i.e. 128 vs 32 at K = 16 and 512 vs 128 \
at K = 8 on ImageNet-IH; "+" = the largest I of the grid, so I_max may be larger).

At I = 1 with global_lr 1 the two algorithms are the same computation (the control variates cancel); their \
means differ here by {i1_gap:.4f}.

Hyperparameters (best final test AUC on tuning seed {args.tune_seed} over lr {args.lrs} x prox_weight \
{args.prox_weights} x global_lr {args.global_lrs}, {"at I = 1" if args.tune_at == "1" else "at every I"}, the \
same grid for both algorithms):

{C.table(["algorithm", "I", "lr", "prox_weight", "global_lr"], hyper_rows)}

{len(m['results']) + len(m['tuning'])} runs, {m['wall_s'] / 60:.1f} min of run time. Figure: \
`{out.with_suffix('.png').name}` (mean d with its {LEVEL:.0%} interval; dotted: -tolerance of each algorithm).
"""
    C.write_results(out, "Communication window: I_max of CODA+ and CODASCA", command, body)
    figure(out.with_suffix(".png"), args, rows_p, tol)
    print(body)
    return C.result_line(imax_codasca=imax["codasca"], imax_coda_plus=imax["coda_plus"], ratio=float(ratio),
                         imax_shown_codasca=shown["codasca"], imax_shown_coda_plus=shown["coda_plus"],
                         tolerance_codasca=float(tol["codasca"]), tolerance_coda_plus=float(tol["coda_plus"]),
                         seeds=n)


def figure(path: Path, args, rows: dict, tol: dict) -> None:
    """Mean paired drop d against I with its interval, and each algorithm's -tolerance as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    for alg in ALGORITHMS:
        pts = [rows[(alg, i)] for i in args.grid]
        err = None
        if all(math.isfinite(p["lo"]) for p in pts):
            err = np.array([[p["mean"] - p["lo"] for p in pts], [p["hi"] - p["mean"] for p in pts]])
        line = ax.errorbar(args.grid, [p["mean"] for p in pts], yerr=err, marker="o", capsize=3, label=NAMES[alg])
        ax.axhline(-tol[alg], color=line[0].get_color(), linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("communication window I")
    ax.set_ylabel("AUC(I) - AUC(I=1), paired over seeds")
    ax.set_title(f"{args.dataset}-IH, K={args.clients}, {args.iterations} iterations, {len(args.seeds)} seeds; "
                 f"bars: {LEVEL:.0%} interval, dotted: -tolerance", fontsize=8)
    C.save_figure(fig, ax, path)


def main(argv: list[str] | None = None) -> str:
    return C.run_script("comm_window.py", argv, parse_args, measure, report)


if __name__ == "__main__":
    main(sys.argv[1:])
