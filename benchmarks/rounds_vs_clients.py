"""Communication rounds against the number of clients K on heterogeneous data (the paper's Thm. 2 vs 3).

The paper proves that CODASCA needs O~(1/mu) communication rounds whatever K,
while CODA+ on heterogeneous data needs O~(K/mu + ...). This script measures,
for K = 2, 4, ..., 128 clients of the synthetic generator with a high
heterogeneity (each client's class centres shifted by as much as the gap
between the classes), the rounds each algorithm needs to bring the primal
objective phi(v) = min_(a,b) max_alpha f of the global model, over the union of
the clients' training data, to within a fraction of its initial gap to phi*:

    phi(v_r) <= phi* + target_fraction * (phi(v_0) - phi*)

phi* comes from a central full-batch L-BFGS fit of the same model to the same
data (no federation). The objective, not the test AUC, is the target: on this
data the objective's optimum is not the AUC optimum (a drifting CODA+ can score
a higher test AUC than the minimiser of its own objective), and the pooled
test set changes with K, so one AUC target would not mean the same at every K.

Both algorithms run the theory's geometric schedule: stage s takes R rounds of
I_s = I_0 rho^(s-1) local steps with eta_s = eta_0 / rho^(s-1) (eta shrinking,
eta I constant). With ``--sqrt-k`` CODASCA uses eta_g = sqrt(K) and
eta_l = eta_0 / sqrt(K) (the theorem's choice: eta_l eta_g I stays the same
for every K). Each (algorithm, K, seed) gets the fewest rounds over the grid of
(I_0, eta_0): the communication cost of the best setting, which is what the
complexity bounds describe. A run that has not reached the target after
``--iterations`` local steps counts as not reached.

Participation: every client in every round (``full``) and, with
``quarter``, S = max(1, K/4) clients sampled per round (``clients_per_round``;
c stays the mean over all K clients, SCAFFOLD's rule). The clients are hosted
``--clients-per-actor`` to a model replica (the inline executor runs them all on
one replica in any case; under ``--executor ray`` it sets the actors). Each
slope comes with a bootstrap 90% interval: the seeds of every K are resampled
with replacement ``--bootstrap`` times and the slope of the resampled means is
taken each time.

    python benchmarks/rounds_vs_clients.py --quick       # committed results, K = 2 .. 128, 5 seeds
    python benchmarks/rounds_vs_clients.py               # larger grid and budget, K up to 256
    python benchmarks/rounds_vs_clients.py --clients 8 16 32 64 --executor ray --clients-per-actor 16

Last line: ``RESULT slope_codasca=... slope_coda_plus=... slope_codasca_quarter=... ...
codasca_interval_has_0=... coda_plus_above_codasca=...`` (least-squares slope of log rounds against log K
of the mean rounds, 0 = flat, 1 = proportional to K; the two flags are 1 or 0, for full participation).
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import _common as C
import numpy as np
from _objective import reference_objective

NAMES = {"coda_plus": "CODA+", "codasca": "CODASCA", "codasca_sqrtk": "CODASCA eta_g=sqrt(K)"}
PARTICIPATION = {"full": "all K clients per round", "quarter": "S = K/4 clients per round"}
QUICK = {"clients": [2, 4, 8, 16, 32, 64, 128], "local_steps": [16, 64, 256], "lrs": [1.0], "iterations": 2048,
         "seeds": [0, 1, 2, 3, 4]}
FULL = {"clients": [2, 4, 8, 16, 32, 64, 128, 256], "local_steps": [1, 4, 16, 64, 256], "lrs": [0.3, 1.0, 3.0],
        "iterations": 8192, "seeds": [0, 1, 2, 3, 4]}


def per_round(k: int, participation: str) -> int | None:
    """S for a participation mode (None: every client)."""
    return None if participation == "full" else max(1, k // 4)


def bootstrap_slope(ks, rounds_by_k, *, resamples: int, seed: int = 0) -> tuple[float, float]:
    """90% percentile interval of the log-log slope of mean rounds, the seeds of every K resampled with
    replacement (a seed that did not reach the target is a NaN and leaves its K's mean out when all its draws
    are NaN)."""
    rng = np.random.default_rng(seed)
    slopes = []
    for _ in range(resamples):
        means = []
        for k in ks:
            vals = np.asarray(rounds_by_k[k], dtype=float)
            draw = vals[rng.integers(0, len(vals), len(vals))]
            finite = draw[np.isfinite(draw)]
            means.append(float(finite.mean()) if finite.size == len(draw) else math.nan)
        slopes.append(C.loglog_slope(ks, means))
    slopes = np.asarray(slopes)
    slopes = slopes[np.isfinite(slopes)]
    if slopes.size < resamples // 2:
        return math.nan, math.nan
    return float(np.quantile(slopes, 0.05)), float(np.quantile(slopes, 0.95))


def parse_args(argv: list[str] | None):
    p = C.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=None, help="the values of K")
    p.add_argument("--heterogeneity", type=float, default=1.0, help="synthetic data: class-centre shift per client")
    p.add_argument("--features", type=int, default=20)
    p.add_argument("--samples", type=int, default=500, help="training samples per client")
    p.add_argument("--imratio", type=float, default=0.1)
    p.add_argument("--model", default="linear", choices=("linear", "mlp"))
    p.add_argument("--objective", default="auc_square", choices=("auc_square", "auc_margin"))
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--local-steps", type=int, nargs="+", default=None, help="grid of I_0")
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="grid of eta_0")
    p.add_argument("--rounds-per-stage", type=int, default=8, help="R")
    p.add_argument("--stage-growth", type=float, default=2.0, help="rho")
    p.add_argument("--iterations", type=int, default=None, help="most local steps a run may take")
    p.add_argument("--target-fraction", type=float, default=0.05,
                   help="target: phi* + this fraction of phi(v_0) - phi*")
    p.add_argument("--sqrt-k", action="store_true",
                   help="also run CODASCA with eta_g = sqrt(K), eta_l = eta_0 / sqrt(K)")
    p.add_argument("--participation", nargs="+", default=["full", "quarter"], choices=tuple(PARTICIPATION),
                   help="full: every client each round; quarter: S = max(1, K/4) sampled per round")
    p.add_argument("--clients-per-actor", type=int, default=16, help="clients hosted by one model replica")
    p.add_argument("--bootstrap", type=int, default=2000, help="resamples of the seeds for each slope interval")
    args = p.parse_args(argv)
    seeds_given = args.seeds is not None
    C.check_args(args)
    mode = QUICK if args.quick else FULL
    for name in ("clients", "local_steps", "lrs", "iterations"):
        if getattr(args, name) is None:
            setattr(args, name, mode[name])
    if not seeds_given:
        args.seeds = mode["seeds"]
    if not 0 < args.target_fraction < 1:
        p.error(f"--target-fraction {args.target_fraction}: must lie in (0, 1)")
    if len(args.clients) < 2:
        p.error("--clients: a slope needs at least two values of K")
    args.variants = ["coda_plus", "codasca"] + (["codasca_sqrtk"] if args.sqrt_k else [])
    return args


def base_spec(args, k: int, seed: int) -> dict:
    return {"dataset": "synthetic", "heterogeneity": args.heterogeneity, "num_features": args.features,
            "samples_per_client": args.samples, "imratio": args.imratio, "num_clients": k, "model": args.model,
            "objective": args.objective, "batch_size": args.batch_size, "iterations": args.iterations,
            "schedule": "geometric", "rounds_per_stage": args.rounds_per_stage,
            "stage_growth": args.stage_growth, "eval_every": 1, "prox_weight": 0.0, "seed": seed,
            "executor": args.executor, "device": args.device, "clients_per_actor": args.clients_per_actor,
            **({"cpus_per_actor": 0.5, "threads_per_actor": 1} if args.executor == "ray" else {})}


def targets(args) -> dict[tuple[int, int], dict]:
    """phi(v_0), phi* and the target per (K, seed), computed on the driver."""
    from fdam_ray.config import build_config
    from fdam_ray.data import make_source

    out = {}
    for k, seed in itertools.product(args.clients, args.seeds):
        cfg = build_config({**C.RUN_DEFAULTS, **base_spec(args, k, seed)})
        start, best = reference_objective(cfg, make_source(cfg))
        out[(k, seed)] = {"phi0": start, "phi_star": best, "target": best + args.target_fraction * (start - best)}
    return out


def run_spec(args, variant: str, part: str, k: int, seed: int, i0: int, lr: float, target: float) -> dict:
    s = {**base_spec(args, k, seed), "algorithm": variant.removesuffix("_sqrtk"), "local_steps": i0, "lr": lr,
         "clients_per_round": per_round(k, part), "_stop_objective_at": target, "_variant": variant,
         "_part": part, "_lr0": lr}
    if variant == "codasca_sqrtk":
        s.update(global_lr=math.sqrt(k), lr=lr / math.sqrt(k))
    return s


def fewest_rounds(results: list[dict]) -> tuple[int | None, dict | None]:
    """The fewest rounds any run reached the target in, and that run's spec (None, None if none did)."""
    reached = [r for r in results if r["reached"]]
    if not reached:
        return None, None
    r = min(reached, key=lambda r: (r["rounds"], r["spec"]["local_steps"]))
    return r["rounds"], r["spec"]


def measure(args) -> dict:
    tg = targets(args)
    specs = [run_spec(args, alg, part, k, seed, i0, lr, tg[(k, seed)]["target"])
             for part in args.participation for alg in args.variants for k in args.clients for seed in args.seeds
             for i0, lr in itertools.product(args.local_steps, args.lrs)]
    results = C.run_grid(specs, workers=args.workers)
    cells: dict[tuple, list[dict]] = {}
    for r in results:
        s = r["spec"]
        cells.setdefault((s["_part"], s["_variant"], s["num_clients"], s["seed"]), []).append(r)
    best = {key: fewest_rounds(rs) for key, rs in cells.items()}
    series = [(part, alg) for part in args.participation for alg in args.variants]
    rounds = {(part, alg, k): C.stats([best[(part, alg, k, seed)][0] for seed in args.seeds])
              for part, alg in series for k in args.clients}
    slopes, intervals = {}, {}
    for part, alg in series:
        means = [rounds[(part, alg, k)].mean if not rounds[(part, alg, k)].failed else math.nan for k in args.clients]
        slopes[(part, alg)] = C.loglog_slope(args.clients, means)
        per_seed = {k: [math.nan if best[(part, alg, k, seed)][0] is None else best[(part, alg, k, seed)][0]
                        for seed in args.seeds] for k in args.clients}
        intervals[(part, alg)] = bootstrap_slope(args.clients, per_seed, resamples=args.bootstrap)
    return {"targets": tg, "results": results, "best": best, "rounds": rounds, "slopes": slopes,
            "intervals": intervals, "series": series, "wall_s": sum(r["wall_s"] for r in results)}


def verdicts(m: dict, part: str) -> tuple[bool | None, bool | None]:
    """(CODASCA's slope interval holds 0, CODA+'s interval lies above CODASCA's) for a participation mode."""
    sca, plus = m["intervals"].get((part, "codasca")), m["intervals"].get((part, "coda_plus"))
    flat = None if sca is None or not all(map(math.isfinite, sca)) else sca[0] <= 0 <= sca[1]
    above = (None if sca is None or plus is None or not all(map(math.isfinite, (*sca, *plus)))
             else plus[0] > sca[1])
    return flat, above


def _yes(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "no"


def report(args, m: dict, out: Path, command: str) -> str:
    rounds, best, tg, series = m["rounds"], m["best"], m["targets"], m["series"]
    rows = []
    for k in args.clients:
        phi_star = sum(tg[(k, s)]["phi_star"] for s in args.seeds) / len(args.seeds)
        row = [k, f"{phi_star:.5f}"]
        for part, alg in series:
            st = rounds[(part, alg, k)]
            if st.failed:
                row.append(f"not reached ({st.failed} of {len(args.seeds)} seeds)")
            else:
                row.append(f"{st.mean:.1f} ± {st.std:.1f}")
            picked = [best[(part, alg, k, s)][1] for s in args.seeds if best[(part, alg, k, s)][1] is not None]
            row.append(", ".join(sorted({f"{p['local_steps']}/{p['_lr0']:g}" for p in picked})) or "-")
        rows.append(row)
    headers = ["K", "phi* (central)"]
    for part, alg in series:
        headers += [f"{NAMES[alg]} {part} rounds", "I_0/eta_0 used"]
    slope_rows = []
    for part, alg in series:
        lo, hi = m["intervals"][(part, alg)]
        slope_rows.append([PARTICIPATION[part], NAMES[alg], f"{m['slopes'][(part, alg)]:.2f}", f"[{lo:.2f}, {hi:.2f}]"])
    verdict_rows = [[PARTICIPATION[part], *map(_yes, verdicts(m, part))] for part in args.participation]
    body = f"""
Synthetic data: K clients x {args.samples} samples, {args.features} features, heterogeneity {args.heterogeneity}, \
imratio {args.imratio}; model {args.model}, {args.objective}, batch {args.batch_size}; geometric schedule \
(R = {args.rounds_per_stage} rounds per stage, rho = {args.stage_growth}); CODA+ and CODASCA with eta_g = 1\
{"; CODASCA eta_g=sqrt(K) with eta_l = eta_0 / sqrt(K)" if args.sqrt_k else ""}; at most \
{args.iterations} local steps per run; executor {args.executor}, {args.clients_per_actor} clients per host \
(the inline executor runs every client on one model replica). Participation: \
{"; ".join(PARTICIPATION[p] for p in args.participation)} (S = max(1, K/4), drawn per round from (seed, round)). \
Target: phi <= phi* + {args.target_fraction} (phi(v_0) - phi*). Rounds = the fewest over the grid I_0 \
{args.local_steps} x eta_0 {args.lrs}, mean ± sample std over seeds {' '.join(map(str, args.seeds))}.

{C.table(headers, rows)}

Slope of log(mean rounds) against log K, with a bootstrap 90% interval ({args.bootstrap} resamples of the seeds \
within each K; the paper's theory: 0 for CODASCA, growing for CODA+; nan = some K not reached):

{C.table(["participation", "algorithm", "slope", "90% interval"], slope_rows)}

{C.table(["participation", "CODASCA's interval contains 0", "CODA+'s interval lies above CODASCA's"], verdict_rows)}

{len(m['results'])} runs, {m['wall_s'] / 60:.1f} min of run time. Figure: `{out.with_suffix('.png').name}`.
"""
    C.write_results(out, "Communication rounds vs number of clients", command, body)
    lines = {}
    for part, alg in series:
        ks = [k for k in args.clients if not rounds[(part, alg, k)].failed]
        lines[f"{NAMES[alg]} {part} (slope {m['slopes'][(part, alg)]:.2f})"] = (
            ks, [rounds[(part, alg, k)].mean for k in ks], [rounds[(part, alg, k)].std for k in ks])
    C.figure(out.with_suffix(".png"), lines, xlabel="clients K", ylabel="rounds to target", logy=True,
             title=f"synthetic, heterogeneity {args.heterogeneity}: rounds to phi* + "
                   f"{args.target_fraction} (phi0 - phi*)")
    print(body)
    values = {f"slope_{alg}" + ("" if part == "full" else f"_{part}"): m["slopes"][(part, alg)]
              for part, alg in series}
    first = args.participation[0]
    flat, above = verdicts(m, first)
    values.update(codasca_interval_has_0=math.nan if flat is None else int(flat),
                  coda_plus_above_codasca=math.nan if above is None else int(above))
    return C.result_line(**values)


def main(argv: list[str] | None = None) -> str:
    return C.run_script("rounds_vs_clients.py", argv, parse_args, measure, report)


if __name__ == "__main__":
    main(sys.argv[1:])
