"""Compressed transfers: does rounding what crosses the object store to bf16 cost test AUC?

comm_window.py's quick setting (mnist5k-IH, K = 5 class-disjoint clients,
imratio 0.1, mlp of width 32, auc_margin, batch 32, 2048 iterations, one stage
of constant lr, the lr, prox_weight and global_lr comm_window tuned at each I)
is trained with ``transfer_precision`` fp32, bf16 and bf16 with
``error_feedback``, on paired seeds: a seed fixes the partition, the initial
weights and every minibatch, so the runs of one seed differ only in the
rounding of the transfers. The inline executor applies the rounding a Ray run's
transfers take (fdam_ray/executors/transfer.py), so the AUCs are those of a Ray run.
Reported: the final test AUC per variant, and the paired differences
d_s = AUC(variant, s) - AUC(fp32, s) with their mean, spread (sample std), root mean square and
largest |d_s|; the bar is |d_s| <= 0.003 on every seed.

Two references say how far paired runs drift apart without bf16's rounding:
``exact`` sends float32 differences through the same path (bf16's
transfers, nothing rounded: the runs differ from fp32 only in the order of
float32 additions), and ``fp16`` rounds 8 times more finely than bf16. At
lr 1.0 and 128 rounds a constant-lr run's final AUC moves with any such
change, so the bar is read against the ``exact`` row.

    python benchmarks/transfer_precision.py --quick --workers 2 --algorithms codasca --seeds 0 1 2 3 4 5 6 7

With ``--stage-length 512`` the lr is divided by 3 every 512 iterations (the
paper's stagewise schedule): the runs settle, the ``exact`` row stays close to
fp32, and d measures the rounding itself
(benchmarks/results/transfer_precision_staged.md):

    python benchmarks/transfer_precision.py --quick --workers 2 --stage-length 512 --seeds 0 1 2 3 4 5 6 7 \
        --out benchmarks/results/transfer_precision_staged.md

Last line: ``RESULT max_abs_d_bf16=... max_abs_d_bf16_ef=... max_abs_d_fp16=... max_abs_d_exact=... mean_d_bf16=...
mean_d_bf16_ef=... rms_d_bf16=... rms_d_bf16_ef=... rms_d_fp16=... rms_d_exact=... bytes_ratio=... seeds=...``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import _common as C
import comm_window as W

VARIANTS = {"fp32": {"transfer_precision": "fp32"},
            "bf16": {"transfer_precision": "bf16"},
            "bf16_ef": {"transfer_precision": "bf16", "error_feedback": True},
            # the same scheme with 8 times finer rounding: how far paired runs drift apart for a much smaller
            # perturbation (the noise floor the bar is read against)
            "fp16": {"transfer_precision": "fp16"},
            # bf16's path with nothing rounded (see run_variant): the drift of float32 arithmetic alone
            "exact": {"transfer_precision": "bf16"}}
COMPARED = ("bf16", "bf16_ef", "fp16", "exact")
NAMES = {"bf16": "bf16", "bf16_ef": "bf16 + error feedback", "fp16": "fp16 (8x finer rounding)",
         "exact": "exact (bf16's path, float32 values: nothing rounded)"}
# comm_window --quick's tuned hyperparameters (benchmarks/results/comm_window.md), at the windows run here
HYPER = {("coda_plus", 4): (1.0, 0.002, 1.0), ("coda_plus", 16): (1.0, 0.002, 1.0),
         ("codasca", 4): (1.0, 0.002, 1.0), ("codasca", 16): (1.0, 0.002, 1.0), ("codasca", 64): (1.0, 0.002, 1.0)}
BAR = 0.003


def parse_args(argv: list[str] | None):
    p = C.base_parser(__doc__.split("\n\n")[0])
    C.add_ih_args(p)
    p.add_argument("--windows", type=int, nargs="+", default=[16], help="communication windows I (default 16)")
    p.add_argument("--algorithms", nargs="+", default=list(W.ALGORITHMS), choices=W.ALGORITHMS)
    p.add_argument("--iterations", type=int, default=None, help="iterations of a run (default comm_window "
                   f"--quick's {W.QUICK['iterations']})")
    p.add_argument("--stage-length", type=int, default=None, help="T0: lr / 3 (and a new reference point) every "
                   "this many iterations, as in comm_window --stage-length (default: one stage of constant lr)")
    args = p.parse_args(argv)
    C.check_args(args)
    for alg in args.algorithms:
        for i in args.windows:
            if (alg, i) not in HYPER:
                p.error(f"--windows {i}: no tuned hyperparameters of {alg} at I = {i} (known: "
                        f"{sorted(k[1] for k in HYPER if k[0] == alg)})")
    args.base = C.ih_spec(args)
    args.iterations = args.iterations or W.QUICK["iterations"]
    if args.stage_length is not None:
        bad = [i for i in args.windows if args.stage_length < 1 or args.stage_length % i]
        if bad or args.stage_length > args.iterations:
            p.error(f"--stage-length {args.stage_length}: must be a multiple of every --windows I "
                    f"({bad or args.windows}) and at most --iterations {args.iterations}")
    return args


def _float32_bits(x: Any, precision: str) -> Any:
    import numpy as np

    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).copy()


def _from_float32_bits(bits: Any, precision: str) -> Any:
    import numpy as np

    return np.ascontiguousarray(bits).view(np.float32).copy()


def run_variant(spec: dict, make_source: Any = None) -> dict:
    """One run (:func:`_common.run_one`); the ``exact`` variant with transfer.encode/decode passing float32
    values through whole, so its transfers take bf16's path (differences from the masters, sums shifted by
    W M) with nothing rounded."""
    from fdam_ray.executors import transfer

    if spec["_variant"] != "exact":
        return C.run_one(spec, make_source)
    saved = transfer.encode, transfer.decode
    transfer.encode, transfer.decode = _float32_bits, _from_float32_bits
    try:
        return C.run_one(spec, make_source)
    finally:
        transfer.encode, transfer.decode = saved


def spec_for(args, alg: str, i: int, seed: int, variant: str) -> dict:
    """The run of ``variant`` (a key of VARIANTS) for algorithm ``alg`` at window ``i`` and ``seed``."""
    lr, pw, glr = HYPER[(alg, i)]
    return {**args.base, "objective": "auc_margin", "iterations": args.iterations, "eval_every": args.iterations,
            "stage_length": args.stage_length or args.iterations, "algorithm": alg, "local_steps": i, "lr": lr,
            "prox_weight": pw, "global_lr": glr, "seed": seed, **VARIANTS[variant], "_variant": variant}


def measure(args) -> dict:
    specs = [spec_for(args, alg, i, seed, variant) for alg in args.algorithms for i in args.windows
             for variant in VARIANTS for seed in args.seeds]
    results = C.run_grid(specs, workers=args.workers, label="main ", runner=run_variant)
    return {"results": results, "wall_s": sum(r["wall_s"] for r in results)}


def _auc(results: list[dict], alg: str, i: int, variant: str) -> dict[int, float]:
    return {r["spec"]["seed"]: r["final_auc"] for r in results if r["spec"]["algorithm"] == alg
            and r["spec"]["local_steps"] == i and r["spec"]["_variant"] == variant}


def _bytes(results: list[dict], variant: str) -> float:
    return sum(r["last"]["bytes_up"] + r["last"]["bytes_down"] for r in results
               if r["spec"]["_variant"] == variant and r["last"])


def _schedule(args) -> str:
    if not args.stage_length or args.stage_length >= args.iterations:
        return "one stage of constant lr"
    return f"lr / 3 every {args.stage_length} iterations ({args.iterations // args.stage_length} stages)"


def _rms(d: list[float]) -> float:
    return math.sqrt(sum(x * x for x in d) / len(d))


def report(args, m: dict, out: Path, command: str) -> str:
    results, tables = m["results"], []
    d_all: dict[str, list[float]] = {v: [] for v in COMPARED}
    means: dict[str, list[float]] = {v: [] for v in COMPARED}
    headers = ["variant", "final AUC (mean ± std)", "d (mean ± std)", "rms d", "max abs d",
               f"seeds with abs d > {BAR}", "d per seed"]
    for alg in args.algorithms:
        for i in args.windows:
            fp32 = _auc(results, alg, i, "fp32")
            rows = [["fp32", C.stats(fp32.values()).fmt(), "", "", "", "", ""]]
            for variant in COMPARED:
                got = _auc(results, alg, i, variant)
                d = [got[s] - fp32[s] for s in args.seeds]
                st = C.stats(d)
                d_all[variant] += d
                means[variant].append(st.mean)
                rows.append([NAMES[variant], C.stats(got.values()).fmt(), f"{st.mean:+.4f} ± {st.std:.4f}",
                             f"{_rms(d):.4f}", f"{max(abs(x) for x in d):.4f}",
                             f"{sum(abs(x) > BAR for x in d)} of {len(d)}", " ".join(f"{x:+.4f}" for x in d)])
            tables.append(f"**{W.NAMES[alg]}, I = {i}** ({args.iterations // i} rounds)\n\n" + C.table(headers, rows))
    worst = {v: max(abs(x) for x in d) for v, d in d_all.items()}
    rms = {v: _rms(d) for v, d in d_all.items()}
    ratio = _bytes(results, "bf16") / _bytes(results, "fp32")
    holds = worst["bf16"] <= BAR and worst["bf16_ef"] <= BAR
    first = args.seeds[:3]
    first_worst = {v: max(abs(x) for s, x in zip(args.seeds * len(tables), d_all[v], strict=True) if s in first)
                   for v in COMPARED}
    body = "\n\n".join([
        f"comm_window's quick setting: {args.base['dataset']}-IH, K = {args.base['num_clients']}, "
        f"model {args.base['model']} (width {args.base['model_width']}), auc_margin, {args.iterations} iterations, "
        f"{_schedule(args)}, hyperparameters as comm_window tuned them, executor inline (the rounding of "
        f"a Ray run's transfers). Final test AUC, mean ± sample std over seeds {' '.join(map(str, args.seeds))}; "
        "d = AUC - fp32 AUC, paired per seed; rms d = root mean square of d.",
        *tables,
        f"**Bar |d| <= {BAR} on every seed: {'holds' if holds else 'does not hold'}** (largest |d|: bf16 "
        f"{worst['bf16']:.4f}, bf16 with error feedback {worst['bf16_ef']:.4f}; on seeds "
        f"{' '.join(map(str, first))} alone: {first_worst['bf16']:.4f} and {first_worst['bf16_ef']:.4f}). "
        f"Without any rounding (exact) the largest |d| is {worst['exact']:.4f} (rms {rms['exact']:.4f}, against "
        f"bf16's {rms['bf16']:.4f}, bf16 with error feedback's {rms['bf16_ef']:.4f} and fp16's {rms['fp16']:.4f}). "
        f"Bytes moved (up + down, all runs) bf16 / fp32: {ratio:.3f} (the stage's reference point and each run's "
        f"first broadcast travel in float32). {len(results)} runs, {m['wall_s'] / 60:.1f} min of run time.",
    ])
    C.write_results(out, "Compressed transfers: bf16 against fp32", command, body)
    return C.result_line(max_abs_d_bf16=worst["bf16"], max_abs_d_bf16_ef=worst["bf16_ef"],
                         max_abs_d_fp16=worst["fp16"], max_abs_d_exact=worst["exact"],
                         mean_d_bf16=sum(means["bf16"]) / len(means["bf16"]),
                         mean_d_bf16_ef=sum(means["bf16_ef"]) / len(means["bf16_ef"]),
                         rms_d_bf16=rms["bf16"], rms_d_bf16_ef=rms["bf16_ef"], rms_d_fp16=rms["fp16"],
                         rms_d_exact=rms["exact"], bytes_ratio=ratio, seeds=len(args.seeds))


def main(argv: list[str] | None = None) -> str:
    return C.run_script("transfer_precision.py", argv, parse_args, measure, report)


if __name__ == "__main__":
    main(sys.argv[1:])
