"""Memory and round time against the number of clients K, clients hosted several to a Ray actor.

For each K, a federation of K synthetic-data clients (an MLP) runs under Ray
with S = min(K, 16) clients sampled per round, in two layouts side by side:

- ``pool``: a fixed pool of ``--pool`` actors (``clients_per_actor`` =
  ceil(K / pool)), each holding one model replica and its clients' own state;
- ``per-client``: one actor per client (``clients_per_actor`` = 1, the
  default layout), where it fits (K <= ``--max-actors``).

Per K and layout: the memory of the federation's actor processes (proportional
set size, PSS, from ``/proc/<pid>/smaps_rollup``, so shared libraries count
once across processes), the driver's PSS, and the median wall time of a round
(after warm-up rounds). The marginal memory per client is
(memory at K = 256 - memory at K = 16) / 240 in the pool layout; the round-time
ratio is the pool's median round time at K = 256 over K = 16 (S = 16 in both).

    python benchmarks/clients_scale.py --quick      # K = 4, 16, 64, 256 (committed results)
    python benchmarks/clients_scale.py              # adds K = 1024

Last line: ``RESULT mem_per_client_mb=... round_ratio_k256_k16=... actor_mem_mb=...`` (actor_mem_mb: the
PSS of one actor process hosting one client, the per-client cost of the one-actor-per-client layout).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

import _common as C

QUICK_CLIENTS = [4, 16, 64, 256]
FULL_CLIENTS = [4, 16, 64, 256, 1024]
MEM_TARGET_MB = 5.0  # marginal memory per client, pool layout
ROUND_TARGET = 1.2  # round time with S fixed, K = 256 over K = 16


def parse_args(argv: list[str] | None):
    p = C.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=None, help="the values of K")
    p.add_argument("--per-round", type=int, default=16, help="S = min(K, this) clients per round")
    p.add_argument("--pool", type=int, default=4, help="actors of the pool layout")
    p.add_argument("--max-actors", type=int, default=16,
                   help="the one-actor-per-client layout runs for K up to this (each actor is a process)")
    p.add_argument("--rounds", type=int, default=8, help="rounds per federation (the first two are warm-up)")
    p.add_argument("--local-steps", type=int, default=10, help="I")
    p.add_argument("--samples", type=int, default=100, help="training samples per client")
    p.add_argument("--features", type=int, default=20)
    p.add_argument("--width", type=int, default=64, help="MLP width")
    args = p.parse_args(argv)
    if args.clients is None:
        args.clients = QUICK_CLIENTS if args.quick else FULL_CLIENTS
    if args.rounds < 4:
        p.error("--rounds: at least 4 (two warm-up rounds, timed ones, a last one that ends with an evaluation)")
    if args.workers != 1:
        p.error("--workers: this benchmark runs one federation at a time (it measures memory)")
    if args.seeds is None:
        args.seeds = [0]
    return args


def pss_mb(pid: int) -> float:
    """Proportional set size of process ``pid`` in MiB (shared pages split among the processes mapping them)."""
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/smaps_rollup has no Pss line")


def run_layout(args, k: int, per_actor: int) -> dict:
    """One Ray federation of K clients, ``per_actor`` to an actor: memory and round times."""
    from fdam_ray.assembly.recipe import federate
    from fdam_ray.config import build_config
    from fdam_ray.data import make_source
    from fdam_ray.executors.ray.executor import RayExecutor
    from fdam_ray.outputs import Observer

    config = build_config({
        **C.RUN_DEFAULTS, "dataset": "synthetic", "num_clients": k, "samples_per_client": args.samples,
        "num_features": args.features, "model": "mlp", "model_width": args.width, "algorithm": "codasca",
        "local_steps": args.local_steps, "iterations": args.rounds * args.local_steps, "batch_size": 32,
        "stage_length": 10**6, "eval_every": 10**6, "clients_per_round": min(k, args.per_round),
        "clients_per_actor": per_actor, "executor": "ray", "cpus_per_actor": 0.25, "threads_per_actor": 1,
        "eval_on": "driver", "seed": args.seeds[0], "device": args.device})
    executor = RayExecutor()

    class Measure(Observer):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.memory: dict = {}

        def start(self, run) -> None:
            self.ends.append(time.perf_counter())

        def round_end(self, plan, record, snapshot) -> None:
            self.ends.append(time.perf_counter())
            if plan.round == args.rounds - 1:  # steady state: every structure built, before the final evaluation
                pids = sorted({w["pid"] for w in executor.client_info().values()})
                self.memory = {"actors": len(pids), "actor_mb": sum(pss_mb(p) for p in pids),
                               "driver_mb": pss_mb(os.getpid())}

    seen = Measure()
    t0 = time.perf_counter()
    federate(config, source=make_source(config), executor=executor, save=False, observers=[seen])
    # rounds 2..R; timed: 3..R-1 (rounds 1-2 warm up, round R ends with the final evaluation)
    rounds = [b - a for a, b in zip(seen.ends[1:], seen.ends[2:], strict=False)]
    return {"k": k, "per_actor": per_actor, **seen.memory, "round_s": statistics.median(rounds[1:-1]),
            "wall_s": time.perf_counter() - t0}


def measure(args) -> dict:
    import ray

    from fdam_ray.executors.ray.compat import start_loopback_ray

    started = not ray.is_initialized()
    saved_env = dict(os.environ)  # ray.init sets RAY_ADDRESS and the like for this process: undone at the end
    if started:  # logical CPUs: enough for the largest layout's quarter-CPU actors; the OS shares the cores
        most = max([math.ceil(max(args.clients) / args.pool)] + [k for k in args.clients if k <= args.max_actors])
        start_loopback_ray(num_cpus=max(4, math.ceil(0.25 * max(args.pool, most)) + 1), include_dashboard=False,
                           log_to_driver=False)  # listens on 127.0.0.1
    rows = []
    try:
        for k in args.clients:
            pool_m = math.ceil(k / args.pool)
            rows.append({"layout": "pool", **run_layout(args, k, pool_m)})
            if k <= args.max_actors and pool_m != 1:
                rows.append({"layout": "per-client", **run_layout(args, k, 1)})
            print(f"K={k}: " + "; ".join(f"{r['layout']} {r['actors']} actors {r['actor_mb']:.0f} MB "
                                         f"{r['round_s'] * 1e3:.0f} ms/round" for r in rows if r["k"] == k),
                  file=sys.stderr, flush=True)
    finally:
        if started:
            ray.shutdown()
            os.environ.clear()
            os.environ.update(saved_env)
    return {"rows": rows}


def report(args, measured: dict, out: Path, command: str) -> str:
    rows = measured["rows"]
    pool = {r["k"]: r for r in rows if r["layout"] == "pool"}
    single = {r["k"]: r for r in rows if r["layout"] == "per-client" or (r["layout"] == "pool" and r["per_actor"] == 1)}
    lo, hi = (16, 256) if {16, 256} <= set(pool) else (min(pool), max(pool))
    per_client = (pool[hi]["actor_mb"] - pool[lo]["actor_mb"]) / (hi - lo) if hi > lo else math.nan
    ratio = pool[hi]["round_s"] / pool[lo]["round_s"] if hi > lo else math.nan
    actor_mb = (statistics.median(r["actor_mb"] / r["actors"] for r in single.values()) if single else math.nan)
    table = C.table(
        ["K", "S", "layout", "actors", "clients per actor", "actors' PSS (MB)", "per client (MB)", "driver PSS (MB)",
         "round (ms)"],
        [[r["k"], min(r["k"], args.per_round), r["layout"], r["actors"], r["per_actor"], f"{r['actor_mb']:.0f}",
          f"{r['actor_mb'] / r['k']:.1f}", f"{r['driver_mb']:.0f}", f"{r['round_s'] * 1e3:.0f}"] for r in rows])
    ok_mem = "meets" if per_client <= MEM_TARGET_MB else "misses"
    ok_round = "meets" if ratio <= ROUND_TARGET else "misses"
    body = f"""\
Synthetic data: {args.samples} training samples x {args.features} features per client; MLP of width \
{args.width}; CODASCA, I = {args.local_steps}, batch 32; S = min(K, {args.per_round}) clients sampled per round; \
{args.rounds} rounds per federation (round times: median of rounds 3..{args.rounds - 1}, the last one before the \
final evaluation is not timed). Pool layout: {args.pool} actors (clients_per_actor = ceil(K / {args.pool})); \
per-client layout: one actor per client, for K <= {args.max_actors}. Memory: PSS of the federation's actor \
processes and of the driver, read from /proc/<pid>/smaps_rollup after round {args.rounds - 1}. \
Ray actors reserve 0.25 logical CPU each and run one torch thread; this machine has {os.cpu_count()} cores.

{table}

**Marginal memory per hosted client** (pool, K = {lo} to {hi}): **{per_client:.2f} MB** (target at most \
{MEM_TARGET_MB:g} MB: {ok_mem}). **Round time with S fixed**, K = {hi} over K = {lo}: **{ratio:.2f}x** (target at \
most {ROUND_TARGET:g}x: {ok_round}). **One actor hosting one client**: {actor_mb:.0f} MB of PSS per process \
(the per-client cost of the one-actor-per-client layout)."""
    C.write_results(out, "Clients at scale: memory and round time with clients hosted by a pool of actors", command,
                    body)
    return C.result_line(mem_per_client_mb=per_client, round_ratio_k256_k16=ratio, actor_mem_mb=actor_mb)


def main(argv: list[str] | None = None) -> str:
    return C.run_script("clients_scale.py", argv, parse_args, measure, report)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
