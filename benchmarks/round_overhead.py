"""What a round costs the Ray executor beyond the clients' own compute, under both transports, next to the
paper's own all-reduce; and the driver's memory in K.

K client actors each take one tiny local step (a linear scorer over N - 3
features, so the model state v is exactly N floats with a and b) on a shard
of one sample built in the actor. Per round we time what the driver loop does
(``run_round`` with the reducer's fold, then the server step) and subtract the
slowest client's compute (``compute_s``, measured in the client around its
steps): the rest is broadcast, transfer, serialisation and reduction. It is
measured for the transports of the executor (``classic``: one Ray call per
actor through the object store; ``compiled``: one Ray Compiled Graph, with
its default ``channel_wait: sleep`` and with ``spin``; ``collective``: the
actors all-reduce their partial sums (one node: through the shared-memory
block of ``collective_backend: auto``) and apply the server step,
timed as a run of rounds, one call per actor for the block, and one call a
round, the driver folding the lowest rank's reduced sum).

References in the same run, same K and N: the plain-Ray pattern (one
``ray.put`` of a numpy buffer, K actors return numpy, a running mean) and the
paper's way, a ``torch.distributed`` gloo all-reduce among K spawned
processes (127.0.0.1, one torch thread each; its round = the slowest rank's
all-reduce plus the division by K). Blocks of rounds of all of them alternate
``--repeats`` times, each repeat starting one pattern further on, so machine
noise and the clean-up after a block hit them alike; each figure is the
median over the blocks, and the blocks' range is the noise. Targets: the
classic overhead at most 1.5 x the plain pattern's; the compiled overhead at
most the gloo all-reduce round at every N (ratio <= 1.0) and at most 0.5 x the
classic overhead at the smallest N; the collective overhead at most 1.1 x the
gloo all-reduce round at every N. The copy floor (``K + 1`` numpy copies of
an N-float buffer) is reported for scale. Then, at the largest N, the driver's
memory before and during rounds at K = 2, 4, 8, each in a fresh driver process
(target: peak RSS at the largest K at most 1.5 x that at the smallest).

    python benchmarks/round_overhead.py [--sizes 270000 7000000] [--clients 4] [--also-clients 2]
                                        [--rounds 12] [--repeats 5] [--mem-clients 2 4 8]
                                        [--out benchmarks/results/round_overhead.md]

Last line: ``RESULT state_floats=... compiled_ms=... classic_ms=... gloo_ms=... compiled_spin_ms=...
collective_ms=... collective_round_ms=... ratio_collective_gloo=... ratio_collective_gloo_small=...
ratio_collective_round_gloo=... ratio_collective_round_gloo_small=... ratio_collective_gloo_k2=...
ratio_compiled_gloo=... ratio_compiled_gloo_small=... ratio_compiled_classic_small=... plain_ray_ms=...
ratio_classic_plain=... floor_ms=... driver_mem_ratio_k8_k2=... driver_rss_ratio_k8_k2=...`` (largest N,
K = --clients, except the ``_small`` ratios, at the smallest N; driver_mem = private memory, driver_rss =
resident set including mapped object-store pages).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import _common as C
import numpy as np
import ray
import torch

from fdam_ray.algorithms import AlgorithmSection, build_algorithm
from fdam_ray.clients.client import Replica
from fdam_ray.config import build_config
from fdam_ray.core.state import RoundPlan
from fdam_ray.data import DataSource, Shard, Split
from fdam_ray.executors.base import ExecutorSetup
from fdam_ray.executors.ray.compat import loopback_node, start_loopback_ray
from fdam_ray.executors.ray.executor import RayExecutor
from fdam_ray.executors.ray.transports.patience import SPIN_S

TARGET_RATIO = 1.5  # classic round overhead at most this times the plain-Ray pattern's (same K, N and run)
GLOO_TARGET = 1.0  # compiled round overhead at most this times the gloo all-reduce round (every N)
COLLECTIVE_TARGET = 1.1  # collective round overhead at most this times the gloo all-reduce round (every N)
CLASSIC_TARGET = 0.5  # compiled round overhead at most this times the classic one (smallest N)
MEMORY_TARGET = 1.5  # peak driver RSS at the largest K at most this times that at the smallest


class WideSource(DataSource):
    """K clients of one sample with ``features`` features, drawn in the client from a seed."""

    def __init__(self, num_clients: int, features: int) -> None:
        self.num_clients, self.features = num_clients, features
        self.input_shape = (features,)

    def client_shard(self, client_id: int) -> Shard:
        rng = np.random.default_rng([7, client_id])
        x = rng.standard_normal((1, self.features), dtype=np.float32)
        return Shard(Split(torch.from_numpy(x), torch.tensor([float(client_id % 2)])))

    def test_set(self) -> None:
        return None


def memory_mb() -> dict[str, float]:
    """This process's resident memory: total, private (anonymous) and mapped shared memory, in MiB.

    Shared memory here is the object store's pages this process has touched (reading updates, writing the
    state): they belong to the store, which holds them whether or not the driver maps them.
    """
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                out[{"VmRSS": "total", "RssAnon": "private", "RssShmem": "shared"}[key]] = int(value.split()[0]) / 1024
    return out


class PeakMemory:
    """Highest memory figures seen by a 1 ms poller and by explicit :meth:`sample` calls."""

    def __init__(self) -> None:
        self.peak = memory_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def sample(self) -> None:
        for key, value in memory_mb().items():
            self.peak[key] = max(self.peak[key], value)

    def _poll(self) -> None:
        while not self._stop.wait(0.001):
            self.sample()

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def copy_floor_ms(n: int, k: int, repeats: int = 15) -> float:
    """Median time of K + 1 copies (``ndarray.copy()``: new buffers, as a transfer makes) of n float32."""
    src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copies = [src.copy() for _ in range(k + 1)]
        times.append(time.perf_counter() - t0)
        del copies
    return 1e3 * statistics.median(times)


def federation(num_clients: int, state_floats: int, transport: str = "classic", channel_wait: str = "sleep"):
    """A started Ray executor with ``num_clients`` clients whose state v has ``state_floats`` floats."""
    config = build_config(dict(dataset="arrays", num_clients=num_clients, model="linear", algorithm="coda_plus",
                               batch_size="full", local_steps=1, lr=0.01, executor="ray", eval_on="driver",
                               cpus_per_actor=1.0, transport=transport, channel_wait=channel_wait))
    source = WideSource(num_clients, state_floats - 3)  # w (d), bias, a, b
    executor = RayExecutor()
    executor.start(ExecutorSetup.for_config(config, executor.section), source)
    replica = Replica(config, source, device=torch.device("cpu"))
    state = replica.flat.initial_state()
    assert state.v.size == state_floats, state.v.size
    executor.configure(np.array([0.5]))
    executor.begin_stage(state.v, True)
    return executor, build_algorithm(AlgorithmSection.of(config)), state


def executor_rounds(executor, algorithm, state, rounds: int, warmup: int = 2):
    """Time ``rounds`` rounds of the executor after ``warmup``; returns (the new state, medians in ms)."""
    walls, computes, cpus = [], [], []
    for r in range(1, warmup + rounds + 1):
        plan = RoundPlan(round=state.round + 1, stage=1, steps=1, lr=0.01, iteration=state.iteration)
        t0, c0 = time.perf_counter(), time.process_time()
        reducer = algorithm.reducer(state)
        executor.run_round(state, plan, reducer.fold)
        state = reducer.finish(steps=1)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if r > warmup:
            walls.append(wall)
            cpus.append(cpu)
            computes.append(max(s.compute_s for s in reducer.stats))
    over = [w - c for w, c in zip(walls, computes, strict=True)]
    return state, {"wall_ms": 1e3 * statistics.median(walls), "compute_ms": 1e3 * statistics.median(computes),
                   "overhead_ms": 1e3 * statistics.median(over), "driver_cpu_ms": 1e3 * statistics.median(cpus)}


def executor_runs(executor, state, rounds: int, warmup: int = 2):
    """Time ``rounds`` rounds as one run of rounds (``transport: collective``: the actors run them back to back,
    the server step on the actors, the state to the driver once) after a ``warmup`` run; per-round medians in ms:
    the run's wall and the slowest client's compute summed over its rounds, divided by ``rounds``."""
    out = {}
    for n in (warmup, rounds):
        plans = [(RoundPlan(round=state.round + 1 + i, stage=1, steps=1, lr=0.01, iteration=state.iteration + i),
                  None) for i in range(n)]
        t0, c0 = time.perf_counter(), time.process_time()
        done = executor.run_rounds(state, plans, True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert done.applied == n and done.state is not None, done.stop
        state = done.state
        compute = sum(max(st.compute_s for st in stats) for stats in done.stats)
        out = {"wall_ms": 1e3 * wall / n, "compute_ms": 1e3 * compute / n, "overhead_ms": 1e3 * (wall - compute) / n,
               "driver_cpu_ms": 1e3 * cpu / n}
    return state, out


@ray.remote(num_cpus=1)
class PlainActor:
    """The reference pattern: read the broadcast buffer, a trivial step, return a new numpy buffer."""

    def step(self, v: np.ndarray) -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        out = v + np.float32(1e-3)
        return out, time.perf_counter() - t0


def plain_ray_rounds(actors: list, state_floats: int, rounds: int, warmup: int = 2) -> dict:
    """Plain Ray, same K and N: one ``ray.put`` of a numpy buffer, K actors return numpy, running mean."""
    v = np.zeros(state_floats, dtype=np.float32)
    walls, over = [], []
    for r in range(warmup + rounds):
        t0 = time.perf_counter()
        ref = ray.put(v)
        pending = [a.step.remote(ref) for a in actors]
        total, slowest = np.zeros_like(v), 0.0
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=600)
            out, compute = ray.get(done[0])
            np.add(total, out, out=total)
            slowest = max(slowest, compute)
            del out
        total *= np.float32(1 / len(actors))
        v = total
        wall = time.perf_counter() - t0
        if r >= warmup:
            walls.append(wall)
            over.append(wall - slowest)
    return {"wall_ms": 1e3 * statistics.median(walls), "overhead_ms": 1e3 * statistics.median(over)}


def _gloo_rank(rank: int, k: int, n: int, rounds: int, warmup: int, port: int, results) -> None:
    """One rank of the all-reduce reference: a trivial step, then all-reduce and divide by K, per round."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=k, rank=rank)
    try:
        x = torch.zeros(n, dtype=torch.float32)
        times = torch.zeros(rounds, dtype=torch.float64)
        for r in range(warmup + rounds):
            x += 1e-3  # the step (not timed, as the clients' compute is not)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            x /= k
            if r >= warmup:
                times[r - warmup] = time.perf_counter() - t0
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a round ends when its slowest rank has the mean
        if rank == 0:
            results.put(times.tolist())
    finally:
        dist.destroy_process_group()


def gloo_rounds(k: int, n: int, rounds: int, warmup: int = 2) -> dict:
    """The paper's way, same K and N: K spawned processes all-reduce an N-float tensor over gloo (127.0.0.1)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(rank, k, n, rounds, warmup, port, results)) for rank in range(k)]
    for proc in procs:
        proc.start()
    try:
        times = results.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return {"overhead_ms": 1e3 * statistics.median(times)}


def measure_case(num_clients: int, state_floats: int, rounds: int, repeats: int) -> dict:
    """Alternating blocks of executor rounds (every transport, the compiled one with both ways of waiting),
    plain-Ray rounds and gloo all-reduce rounds, each repeat starting one pattern further on (the object store
    frees a classic block's objects during the next block, so no pattern always follows the same one);
    medians and ranges over the blocks."""
    executors = {"classic": federation(num_clients, state_floats, "classic"),
                 "compiled": federation(num_clients, state_floats, "compiled", "sleep"),
                 "compiled_spin": federation(num_clients, state_floats, "compiled", "spin"),
                 "collective": federation(num_clients, state_floats, "collective")}
    actors = [PlainActor.remote() for _ in range(num_clients)]
    blocks: dict[str, list[dict]] = {"classic": [], "compiled": [], "compiled_spin": [], "collective": [],
                                     "collective_runs": [], "plain": [], "gloo": []}
    floors = []
    try:
        patterns = [*executors, "collective_runs", "plain", "gloo"]
        for repeat in range(repeats):
            shift = repeat % len(patterns)
            for pattern in patterns[shift:] + patterns[:shift]:
                if pattern == "plain":
                    blocks["plain"].append(plain_ray_rounds(actors, state_floats, rounds))
                elif pattern == "gloo":
                    blocks["gloo"].append(gloo_rounds(num_clients, state_floats, rounds))
                elif pattern == "collective_runs":  # the same executor as collective, its rounds as one run
                    executor, algorithm, state = executors["collective"]
                    state, block = executor_runs(executor, state, rounds)
                    executors["collective"] = (executor, algorithm, state)
                    blocks[pattern].append(block)
                else:
                    executor, algorithm, state = executors[pattern]
                    state, block = executor_rounds(executor, algorithm, state, rounds)
                    executors[pattern] = (executor, algorithm, state)
                    blocks[pattern].append(block)
                    if executor.graph is not None:  # a spinning graph's threads poll a core each: not during others
                        executor.graph.teardown()
            floors.append(copy_floor_ms(state_floats, num_clients))
    finally:
        for executor, _, _ in executors.values():
            executor.shutdown()
        for a in actors:
            ray.kill(a)
    med = statistics.median
    row = {"n": state_floats, "k": num_clients, "floor_ms": med(floors)}
    for name, got in blocks.items():
        if not got:
            continue
        over = [b["overhead_ms"] for b in got]
        row[name] = {"ms": med(over), "lo": min(over), "hi": max(over)}
        if "compute_ms" in got[0]:
            row[name].update(wall_ms=med([b["wall_ms"] for b in got]), compute_ms=med([b["compute_ms"] for b in got]),
                             driver_cpu_ms=med([b["driver_cpu_ms"] for b in got]))
    return row


def driver_memory(num_clients: int, state_floats: int, rounds: int) -> dict:
    """Driver RSS before and during ``rounds`` rounds (run in a fresh process, see ``--memory-run``)."""
    executor, algorithm, state = federation(num_clients, state_floats)
    try:
        for r in (1, 2):  # warm-up: first touch of the reducer's buffers, Ray's first transfers
            reducer = algorithm.reducer(state)
            executor.run_round(state, RoundPlan(r, 1, 1, 0.01, r - 1), reducer.fold)
            state = reducer.finish(steps=1)
        base = memory_mb()
        with PeakMemory() as peak:
            for r in range(3, 3 + rounds):
                reducer = algorithm.reducer(state)

                def fold(update, reducer=reducer):
                    reducer.fold(update)
                    peak.sample()

                executor.run_round(state, RoundPlan(r, 1, 1, 0.01, r - 1), fold)
                state = reducer.finish(steps=1)
                peak.sample()
    finally:
        executor.shutdown()
    return {"base": base, "peak": peak.peak}


def memory_in_fresh_process(num_clients: int, state_floats: int, address: str) -> dict:
    """:func:`driver_memory` in a new driver process connected to this run's Ray (so runs do not share a heap)."""
    out = subprocess.run([sys.executable, __file__, "--memory-run", str(num_clients), "--sizes", str(state_floats),
                          "--address", address], capture_output=True, text=True, check=True)
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[270_000, 7_000_000])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--also-clients", type=int, nargs="*", default=[2],
                        help="extra K measured at the largest size (K at most the cores: no oversubscription); "
                             "the RESULT line adds ratio_collective_gloo_kK for each")
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds per block (after 2 warm-up rounds)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="alternating blocks of every pattern (each repeat starts one pattern further on)")
    parser.add_argument("--mem-clients", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/round_overhead.md)")
    parser.add_argument("--memory-run", type=int, help=argparse.SUPPRESS)  # internal: one memory measurement
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.memory_run:
        with loopback_node():  # joins the run's Ray on 127.0.0.1 (else Ray turns it into the machine's address)
            ray.init(address=args.address, log_to_driver=False)
        print(json.dumps(driver_memory(args.memory_run, args.sizes[0], rounds=4)))
        return ""
    if len(args.mem_clients) < 2:
        parser.error("--mem-clients needs at least two K to compare")
    ks = [args.clients, *args.also_clients]
    # logical CPUs: the four executors' actors and the plain actors exist at once (they take turns to run)
    start_loopback_ray(num_cpus=max(5 * max(ks), *args.mem_clients), include_dashboard=False,
                       log_to_driver=False)  # listens on 127.0.0.1
    gpus = int(ray.cluster_resources().get("GPU", 0))

    cases = [(n, args.clients) for n in args.sizes] + [(max(args.sizes), k) for k in args.also_clients]
    rows = []
    for n, k in cases:
        r = measure_case(k, n, args.rounds, args.repeats)
        rows.append(r)
        print(f"N={n:>9,}  K={k}  compiled {r['compiled']['ms']:7.1f} ms  collective {r['collective_runs']['ms']:7.1f}"
              f" ms (one call a round {r['collective']['ms']:7.1f} ms)"
              f"  classic {r['classic']['ms']:7.1f} ms"
              f"  plain Ray {r['plain']['ms']:6.1f} ms  gloo all-reduce {r['gloo']['ms']:6.1f} ms"
              f"  floor {r['floor_ms']:6.1f} ms", flush=True)
    mem_n = max(args.sizes)
    address = ray.get_runtime_context().gcs_address
    mem = {}
    for k in args.mem_clients:
        mem[k] = memory_in_fresh_process(k, mem_n, address)
        b, p = mem[k]["base"], mem[k]["peak"]
        print(f"N={mem_n:,} K={k}: driver private memory {b['private']:.0f} -> peak {p['private']:.0f} MiB; "
              f"RSS {b['total']:.0f} -> peak {p['total']:.0f} MiB (object-store pages mapped: peak "
              f"{p['shared']:.0f} MiB)", flush=True)
    ray.shutdown()

    main_row = next(r for r in rows if r["n"] == max(args.sizes) and r["k"] == args.clients)
    small_row = next(r for r in rows if r["n"] == min(args.sizes) and r["k"] == args.clients)
    k_lo, k_hi = min(mem), max(mem)
    private_ratio = mem[k_hi]["peak"]["private"] / mem[k_lo]["peak"]["private"]
    rss_ratio = mem[k_hi]["peak"]["total"] / mem[k_lo]["peak"]["total"]
    ratio = lambda r, a, b: r[a]["ms"] / r[b]["ms"]
    span = lambda m: f"{m['ms']:.1f} ({m['lo']:.1f}..{m['hi']:.1f})"
    yes = lambda ok: "yes" if ok else "no"
    case_rows = []
    for r in rows:
        case_rows.append([
            f"{r['n']:,}", r["k"], f"{r['compiled']['compute_ms']:.1f}",
            f"{r['compiled']['wall_ms']:.1f} / {r['compiled_spin']['wall_ms']:.1f} / {r['classic']['wall_ms']:.1f}",
            f"{r['compiled']['driver_cpu_ms']:.1f} / {r['compiled_spin']['driver_cpu_ms']:.1f} / "
            f"{r['classic']['driver_cpu_ms']:.1f}",
            span(r["compiled"]), span(r["compiled_spin"]), span(r["classic"]),
            span(r["plain"]), span(r["gloo"]),
            f"{ratio(r, 'compiled', 'gloo'):.2f}",
            yes(ratio(r, "compiled", "gloo") <= GLOO_TARGET),
            f"{ratio(r, 'compiled_spin', 'gloo'):.2f}",
            span(r["collective_runs"]), f"{ratio(r, 'collective_runs', 'gloo'):.2f}",
            yes(ratio(r, "collective_runs", "gloo") <= COLLECTIVE_TARGET),
            span(r["collective"]), f"{ratio(r, 'collective', 'gloo'):.2f}",
            f"{r['collective_runs']['driver_cpu_ms']:.1f} / {r['collective']['driver_cpu_ms']:.1f}",
            f"{ratio(r, 'compiled', 'classic'):.2f}", f"{ratio(r, 'classic', 'plain'):.2f}",
            yes(ratio(r, "classic", "plain") <= TARGET_RATIO), f"{r['floor_ms']:.1f}"])
    mem_rows = [[k, f"{m['base']['private']:.0f}", f"{m['peak']['private']:.0f}", f"{m['base']['total']:.0f}",
                 f"{m['peak']['total']:.0f}", f"{m['peak']['shared']:.0f}"] for k, m in mem.items()]
    body = f"""
K client actors, one local step each on one sample (a linear scorer whose state v has N floats), CODA+. \
{args.repeats} alternating blocks of {args.rounds} timed rounds (after 2 warm-up rounds) of the executor under \
each transport, of the plain-Ray pattern and of the gloo all-reduce, each repeat starting one pattern further \
on; each figure is the median over the blocks \
of the blocks' medians, (lo..hi) the range over the blocks. Overhead = the driver's round time (broadcast, \
local rounds, fold, server step) minus the slowest client's compute (its local steps). Compiled = `transport: \
compiled` (one Ray Compiled Graph: shared-memory channels) with its default `channel_wait: sleep` (a wait polls \
for its first {SPIN_S * 1e3:g} ms, then sleeps between checks); compiled spin = the same with `channel_wait: \
spin` (Ray's polling throughout); each graph is ended after its block (a spinning graph's waiting threads keep a \
core each busy) and built again in the next block's warm-up rounds. Collective = `transport: collective` (the \
actors all-reduce their partial sums, here through the shared-memory block of `collective_backend: auto` (all \
actors on one node), and apply the server step) as a training run uses it: the \
block's rounds as one run of rounds (`collective_rounds` >= {args.rounds}: one call per actor for the whole \
block, the state to the driver once at its end; overhead = (the run's wall - the sum over its rounds of the \
slowest client's compute) / rounds, after a warm-up run of 2 rounds). Collective one call a round = the same \
executor round by round (`collective_rounds: 1`: one call per actor per round; the driver folds the lowest \
rank's reduced sum and finishes the round as usual); in both the state goes down only when the actors' copy is \
stale, here never after the first round. Classic = `transport: classic` (a Ray call \
per actor, the object store). Plain Ray = one `ray.put` of a numpy buffer, K actors add a constant \
and return numpy, the driver keeps a running mean as results arrive (round time minus the slowest actor's \
step). Gloo all-reduce = the paper's way: K spawned processes (127.0.0.1, one torch thread each) all-reduce an \
N-float tensor and divide by K (the slowest rank's time; the step before it is not counted). Targets: compiled \
/ gloo <= {GLOO_TARGET} and collective / gloo <= {COLLECTIVE_TARGET} at every N; compiled / classic <= \
{CLASSIC_TARGET} at N = {min(args.sizes):,}; classic \
/ plain Ray <= {TARGET_RATIO}. Driver CPU = the driver process's CPU time per round (Ray's compiled-graph \
channels poll while they wait). Copy floor = K+1 numpy copies (`ndarray.copy()`) of N floats. Machine: \
{os.cpu_count()} CPU cores, {gpus} GPUs in the Ray cluster; all actors on this node.

{C.table(["N floats", "K", "slowest compute ms", "round wall ms compiled / spin / classic",
          "driver CPU ms per round compiled / spin / classic", "compiled overhead ms (lo..hi)",
          "compiled spin overhead ms (lo..hi)", "classic overhead ms (lo..hi)",
          "plain Ray ms (lo..hi)", "gloo all-reduce ms (lo..hi)", "compiled / gloo", f"<= {GLOO_TARGET} met",
          "compiled spin / gloo", "collective overhead ms (lo..hi)", "collective / gloo",
          f"<= {COLLECTIVE_TARGET} met", "collective one call a round ms (lo..hi)", "one call a round / gloo",
          "driver CPU ms per round collective / one call a round", "compiled / classic", "classic / plain Ray",
          f"<= {TARGET_RATIO} met", "copy floor ms"], case_rows)}

Driver memory at N = {mem_n:,} floats ({mem_n * 4 / 2**20:.1f} MiB per state), classic transport, each K in a \
fresh driver process, before 4 rounds (after 2 warm-up rounds) and the peak during them (sampled after every fold \
and every 1 ms). Private = the driver's own memory (RssAnon); RSS also counts the object-store pages the driver \
has touched (RssShmem).

{C.table(["K", "private MiB before", "private MiB peak", "RSS MiB before", "RSS MiB peak",
          "object-store pages mapped, peak MiB"], mem_rows)}

Peak private memory K={k_hi} / K={k_lo}: {private_ratio:.2f}; peak RSS K={k_hi} / K={k_lo}: {rss_ratio:.2f} \
(target: at most {MEMORY_TARGET}: {"met" if rss_ratio <= MEMORY_TARGET else "not met"}).
"""
    out = Path(args.out) if args.out else C.RESULTS_DIR / "round_overhead.md"
    C.write_results(out, "Round overhead of the Ray executor", C.command_line("round_overhead.py", argv), body)
    line = C.result_line(state_floats=main_row["n"], compiled_ms=main_row["compiled"]["ms"],
                         classic_ms=main_row["classic"]["ms"], gloo_ms=main_row["gloo"]["ms"],
                         compiled_spin_ms=main_row["compiled_spin"]["ms"],
                         collective_ms=main_row["collective_runs"]["ms"],
                         collective_round_ms=main_row["collective"]["ms"],
                         ratio_collective_gloo=ratio(main_row, "collective_runs", "gloo"),
                         ratio_collective_gloo_small=ratio(small_row, "collective_runs", "gloo"),
                         ratio_collective_round_gloo=ratio(main_row, "collective", "gloo"),
                         ratio_collective_round_gloo_small=ratio(small_row, "collective", "gloo"),
                         ratio_compiled_gloo=ratio(main_row, "compiled", "gloo"),
                         ratio_compiled_gloo_small=ratio(small_row, "compiled", "gloo"),
                         ratio_compiled_classic_small=ratio(small_row, "compiled", "classic"),
                         plain_ray_ms=main_row["plain"]["ms"], ratio_classic_plain=ratio(main_row, "classic", "plain"),
                         floor_ms=main_row["floor_ms"],
                         **{f"ratio_collective_gloo_k{r['k']}": ratio(r, "collective_runs", "gloo")
                            for r in rows if r["k"] != args.clients},
                         **{f"driver_mem_ratio_k{k_hi}_k{k_lo}": private_ratio,
                            f"driver_rss_ratio_k{k_hi}_k{k_lo}": rss_ratio})
    print(line)
    return line


if __name__ == "__main__":
    main()
