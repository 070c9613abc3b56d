"""Per-node reduction against the star: what reaches the driver's node per round, and the round time.

A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head
with no CPUs for clients and W worker nodes, each its own raylet and object
store, all listening on 127.0.0.1), 4 client actors pinned to each worker node
(``client_resources``), each client taking one trivial local step on one sample
of a linear scorer whose state v has N floats (the round_overhead workload). The
same started executor runs blocks of rounds with ``reduce: star`` (every actor's
partial sum goes to the driver) and ``reduce: node`` (the actors on one node are
merged there, the driver receives one sum per node), each under ``transport:
classic`` and ``transport: compiled``, alternating, so machine noise hits all.

Driver ingress per round is counted from the objects the driver folds (each is
one object fetched from another node's store); round time is the median over the
blocks of each block's median round wall time (broadcast, local steps, transfer,
merge, fold, server step).

All "nodes" here share one machine's memory bandwidth and its cores, so the
transfer between object stores is a memory copy, not a network link: the
round-time ratio measured here is not what a real cluster sees. The results file
therefore also works out, from the measured per-byte cost of a round on this
machine and from link speeds, what the driver's link costs per round on a real
cluster (10 GbE and 100 GbE, 16 to 256 clients, DenseNet121 and ResNet20 states).

With ``--netlab DIR`` (the netlab folder: ``DIR/netcluster.py``, which needs root
and ``tc``) the cluster is netlab's instead: every node at its own loopback
address, W worker nodes (the largest ``--nodes``), measured unshaped and then
with each node's ingress limited to ``--rate``, on the same cluster; the
results file gives the two side by side. At the rate it also measures
``transfer_precision: bf16`` against fp32 (classic transport), and then one
node at ``--slow-rate`` among the others at ``--rate`` (``reduce: node``), with
no deadline and with ``round_deadline`` ``--deadline``.

With ``--netlab DIR --precision-rates R1 R2 ...`` it measures only ``reduce:
node`` (classic) with fp32 against bf16 transfers, unshaped and at each rate,
and fits each precision's round time to a + b / rate: the part that does not
shrink with the link and the part that does
(benchmarks/results/node_reduce_precision.md).

    python benchmarks/node_reduce.py [--nodes 2 4] [--clients-per-node 4] [--state-floats 7000000]
                                     [--rounds 6] [--repeats 3] [--warmup N]
                                     [--out benchmarks/results/node_reduce.md]
                                     [--netlab ../shared/netlab --rate 1gbit [--slow-rate 100mbit]
                                      [--deadline 2x] [--precision-rates 1gbit 500mbit 250mbit]]

Last line: ``RESULT nodes=... clients=... ingress_ratio_node_star=... round_ratio_node_star=...
round_ratio_node_star_compiled=...`` (at the largest --nodes); with --netlab ``RESULT rate=...
round_ratio_node_star=... round_ratio_node_star_compiled=... round_ratio_bf16_fp32=...
straggler_ratio_deadline=... straggler_ratio_none=...`` (at that rate; the bf16 ratio under ``reduce: star``,
the straggler ratios against the ``reduce: node`` round with every node at the rate).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import re
import statistics
import sys
import time
from pathlib import Path

import _common as C
import numpy as np
import ray
import torch
from ray.cluster_utils import Cluster
from round_overhead import WideSource

from fdam_ray.algorithms import AlgorithmSection, build_algorithm
from fdam_ray.config import build_config
from fdam_ray.executors.base import ExecutorSetup
from fdam_ray.executors.ray.compat import loopback_node
from fdam_ray.executors.ray.executor import RayExecutor
from fdam_ray.executors.ray.transports import transport_for
from fdam_ray.features.deadlines import Deadline
from fdam_ray.features.transfer import Downlink
from fdam_ray.loop.client import Replica
from fdam_ray.loop.state import RoundPlan

DENSENET121_FLOATS = 6_960_000  # trainable parameters of DenseNet121 with one output, plus a, b
RESNET20_FLOATS = 270_000
LINKS_GBIT = {"10 GbE": 10.0, "100 GbE": 100.0}
TARGET_ROUND_RATIO = 0.6  # node's round time at most this times star's at the largest --nodes


LOOPBACK = "127.0.0.1"
# (transport, reduce, transfer_precision, round_deadline) of the blocks, in the order they alternate
BLOCKS = (("classic", "star", "fp32", None), ("classic", "node", "fp32", None), ("compiled", "star", "fp32", None),
          ("compiled", "node", "fp32", None))
# --netlab at the shaped rate: also bf16 transfers (classic: compiled carries float32 states only)
SHAPED_BLOCKS = (*BLOCKS, ("classic", "star", "bf16", None), ("classic", "node", "bf16", None))


@contextlib.contextmanager
def loopback_cluster(nodes: int, clients_per_node: int, store_bytes: int):
    """A head without CPUs and ``nodes`` worker nodes (``site_<i>``), every one listening on 127.0.0.1 only,
    with this process connected as the driver; shut down at the end."""
    with loopback_node():
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False, "object_store_memory": store_bytes,
            "node_ip_address": LOOPBACK})
    try:
        for i in range(nodes):
            with loopback_node():
                cluster.add_node(node_ip_address=LOOPBACK, num_cpus=clients_per_node, resources={f"site_{i}": 1},
                                 object_store_memory=store_bytes)
        with loopback_node():  # else Ray turns the head's 127.0.0.1 into the machine's address
            ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def load_netlab(folder: str):
    """The ``netcluster`` module of the netlab folder ``folder`` (imported from its file: nothing else in the
    project depends on it)."""
    path = Path(folder) / "netcluster.py"
    if not path.is_file():
        raise SystemExit(f"--netlab: {folder} has no netcluster.py (give the netlab folder, e.g. ../shared/netlab)")
    spec = importlib.util.spec_from_file_location("netcluster", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["netcluster"] = module
    spec.loader.exec_module(module)
    return module


def store_bytes_for(nodes: int, clients_per_node: int, state_floats: int) -> int:
    """Object store bytes per node (every node gets the same) so that no round's objects or channels go to disk.

    The driver's node is the fullest: under ``reduce: star`` it receives every client's sum (K states), and
    while classic blocks run the compiled star graph stays up with its own copy of each actor's output channel
    (K more), beside the broadcast and the node sums. A store too small for that puts new objects in files
    under Ray's temporary folder ("fallback allocation") and spills others to disk, which stalls rounds for
    seconds; the blocks report what was spilled and what sat in such files (:func:`store_pressure`).
    """
    state = state_floats * 4 + (1 << 20)
    k = nodes * clients_per_node
    return max(300 * 2**20, (2 * k + 8) * state, (3 * clients_per_node + 8) * state)


STORE_PRESSURE: dict[str, float] = {}  # the largest spilled and fallback MiB seen after a block, this process


def store_pressure() -> tuple[float, float] | None:
    """(MiB spilled to disk so far, MiB now in fallback files) over the cluster's object stores, from Ray's
    memory report (its internal API: None without a Ray session, or where this Ray has none of it)."""
    if not ray.is_initialized():
        return None
    try:
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        stats = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address)).store_stats
        return stats.spilled_bytes_total / 2**20, stats.object_store_bytes_fallback / 2**20
    except Exception:  # a Ray without this report: the figures are left out
        return None


def start_executor(nodes: int, clients_per_node: int, state_floats: int):
    k = nodes * clients_per_node
    config = build_config(dict(
        dataset="arrays", num_clients=k, model="linear", algorithm="coda_plus", batch_size="full", local_steps=1,
        lr=0.01, executor="ray", eval_on="driver", cpus_per_actor=1.0, threads_per_actor=1,
        client_resources=[{f"site_{c // clients_per_node}": 0.01} for c in range(k)], reduce="star"))
    source = WideSource(k, state_floats - 3)
    executor = RayExecutor()
    executor.start(ExecutorSetup.for_config(config, executor.section), source)
    state = Replica(config, source, device=torch.device("cpu")).flat.initial_state()
    executor.configure(np.array([0.5]))
    executor.begin_stage(state.v, True)
    return executor, build_algorithm(AlgorithmSection.of(config)), state


def use_transport(executor: RayExecutor, block: tuple, kept: dict) -> None:
    """Switch the started executor to ``block``: (transport, reduce, transfer_precision, round_deadline). The
    transport is kept in ``kept`` by its (transport, reduce) pair, so
    the node transports keep their reducer actors from block to block
    (a compiled graph left behind is ended, its actors then free for the next graph; the executor closes the last
    one at shutdown); so is each precision's downlink, whose master the actors keep from block to block."""
    transport, reduce, precision, deadline = block
    cls = transport_for(transport, reduce)
    name = cls.serves
    if transport == "compiled":  # an actor is in one graph at a time; classic calls run beside a graph
        for other, kept_transport in kept.items():
            graph = getattr(kept_transport, "graph", None)
            if other != name and graph is not None:
                graph.teardown()
    executor.config = dataclasses.replace(executor.config, transport=transport, reduce=reduce)
    if name not in kept:
        kept[name] = cls(executor.fleet, executor.config)
    executor.transport = kept[name]
    if precision != "fp32" and precision not in kept:
        kept[precision] = Downlink(precision, error_feedback=False)
    executor.downlink = kept.get(precision) if precision != "fp32" else None
    executor.deadline = (None if deadline is None
                         else Deadline.of(build_config(dict(executor="ray", round_deadline=deadline))))


def rounds(executor, algorithm, state, count: int, warmup: int = 1):
    """``count`` timed rounds (after ``warmup``, which also builds a compiled graph) with the executor's transport;
    returns (state, median ms, ingress bytes/round, objects folded in the last round)."""
    walls, ingress = [], []
    for r in range(warmup + count):
        plan = RoundPlan(round=state.round + 1, stage=1, steps=1, lr=0.01, iteration=state.iteration)
        reducer = algorithm.reducer(state)
        received = []

        def fold(part, reducer=reducer, received=received):  # (a rounded sum is counted as it travelled)
            received.append(part.bytes_up if executor.downlink is not None else sum(
                a.nbytes for a in (part.v, part.alpha, part.buffers, part.counters, part.c_v, part.c_alpha)
                if a is not None))
            reducer.fold(part)

        t0 = time.perf_counter()
        executor.run_round(state, plan, fold)
        state = reducer.finish(steps=1)
        if r >= warmup:
            walls.append(time.perf_counter() - t0)
            ingress.append(sum(received))
    return state, 1e3 * statistics.median(walls), statistics.median(ingress), len(received)


def blocks(executor, algorithm, state, count: int, repeats: int, combos=BLOCKS, kept: dict | None = None,
           warmup: int = 1) -> tuple[object, dict]:
    """``repeats`` alternating blocks of ``count`` rounds for each of ``combos`` (see :func:`use_transport`);
    (state, combo -> [(median ms, ingress, objects) per block]).

    The compiled ``reduce: node`` blocks come last, one after another: a compiled graph stays up while classic
    blocks run, and only the node graph costs much to end (see CompiledRounds.teardown), so each graph is built
    once per call, as in a run."""
    got: dict = {combo: [] for combo in combos}
    transports: dict = {} if kept is None else kept
    last = [c for c in combos if c[:2] == ("compiled", "node")]
    order = [c for _ in range(repeats) for c in combos if c not in last] + [c for c in last for _ in range(repeats)]
    for combo in order:
        use_transport(executor, combo, transports)
        state, ms, ingress, objects = rounds(executor, algorithm, state, count, warmup)
        got[combo].append((ms, ingress, objects))
        pressure = store_pressure()
        if pressure is not None:  # the run's worst, for the results file
            STORE_PRESSURE["spilled_mib"] = max(STORE_PRESSURE.get("spilled_mib", 0.0), pressure[0])
            STORE_PRESSURE["fallback_mib"] = max(STORE_PRESSURE.get("fallback_mib", 0.0), pressure[1])
        print(f"  block {label(combo)}: {ms:.0f} ms a round, {objects} sums folded "
              f"({meminfo_gib():.1f} GiB of memory free"
              + ("" if pressure is None else f"; object stores: {pressure[0]:.0f} MiB spilled so far, "
                 f"{pressure[1]:.0f} MiB in fallback files") + ")", file=sys.stderr, flush=True)
    return state, got


def meminfo_gib(key: str = "MemAvailable") -> float:
    """A line of Linux's /proc/meminfo in GiB (MemAvailable: the memory free for use; nan elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(f"{key}:")) / 2**20
    except (OSError, StopIteration, ValueError):
        return float("nan")


def label(combo: tuple) -> str:
    transport, reduce, precision, deadline = combo
    return (f"transport={transport} reduce={reduce}" + ("" if precision == "fp32" else f" {precision}")
            + ("" if deadline is None else f" round_deadline={deadline}"))


def summary(got: dict) -> dict:
    """Per (transport, reduce): median, lo, hi round ms, last ingress and objects; and the node/star ratios."""
    out: dict = {}
    for combo, measured in got.items():
        times = [b[0] for b in measured]
        row = {"ms": statistics.median(times), "lo": min(times), "hi": max(times),
               "ingress": measured[-1][1], "objects": measured[-1][2]}
        out[combo] = row
        if combo[2:] == ("fp32", None):
            out[combo[:2]] = row
    out["star"], out["node"] = out["classic", "star"], out["classic", "node"]
    if ("classic", "star", "bf16", None) in out:
        out["bf16_ratio"] = out["classic", "star", "bf16", None]["ms"] / out["star"]["ms"]
        out["bf16_ratio_node"] = out["classic", "node", "bf16", None]["ms"] / out["node"]["ms"]
    out["ingress_ratio"] = out["node"]["ingress"] / out["star"]["ingress"]
    out["round_ratio"] = out["node"]["ms"] / out["star"]["ms"]
    out["round_ratio_compiled"] = out["compiled", "node"]["ms"] / out["compiled", "star"]["ms"]
    return out


def actors_per_node(executor: RayExecutor) -> list[int]:
    by_node: dict = {}
    for info in executor.where_of.values():
        by_node[info.get("node_id")] = by_node.get(info.get("node_id"), 0) + 1
    return sorted(by_node.values())


def measure(nodes: int, clients_per_node: int, state_floats: int, count: int, repeats: int, warmup: int = 1
            ) -> dict:
    with loopback_cluster(nodes, clients_per_node, store_bytes_for(nodes, clients_per_node, state_floats)):
        executor, algorithm, state = start_executor(nodes, clients_per_node, state_floats)
        kept: dict = {}
        try:
            state, got = blocks(executor, algorithm, state, count, repeats, BLOCKS, kept, warmup)
            placed = actors_per_node(executor)
        finally:
            end_graphs(executor, kept)
            executor.shutdown()
    return {"nodes": nodes, "clients": nodes * clients_per_node, "actors_per_node": placed, **summary(got)}


def measure_netlab(netcluster, args: argparse.Namespace) -> dict[str, dict]:
    """On netlab's cluster, two executors one after the other (so that the memory of the compiled graphs and
    that of the classic node reducers are never held at once: 4 x 4 clients of 7M floats fill this machine).
    Each measures unshaped, then with every node's ingress at ``--rate``; the classic one also bf16 transfers
    at ``--rate`` and, last, the last worker node at ``--slow-rate`` among the others at ``--rate``: ``reduce:
    node`` without and with ``round_deadline`` ``--deadline`` ("straggler")."""
    nodes, per_node = args.nodes[-1], args.clients_per_node
    unshaped: dict = {}
    shaped: dict = {}
    with netcluster.net_cluster(workers=nodes, cpus_per_worker=per_node, rate=None,
                                object_store_bytes=store_bytes_for(nodes, per_node, args.state_floats)) as nc:
        for transport in ("classic", "compiled"):
            combos = tuple(c for c in BLOCKS if c[0] == transport)
            executor, algorithm, state = start_executor(nodes, per_node, args.state_floats)
            kept: dict = {}
            try:
                state, got = blocks(executor, algorithm, state, args.rounds, args.repeats, combos, kept,
                                    args.warmup)
                unshaped.update(got)
                with netcluster.Shaping(nc.ips, args.rate):
                    more = tuple(c for c in SHAPED_BLOCKS if c[0] == transport and c not in combos)
                    state, got = blocks(executor, algorithm, state, args.rounds, args.repeats, combos + more, kept,
                                        args.warmup)
                    shaped.update(got)
                if transport == "classic":
                    slow = nc.ips[-1]
                    with netcluster.Shaping(nc.ips, args.rate, node_rates={slow: args.slow_rate}):
                        state, straggled = blocks(executor, algorithm, state, args.rounds, args.repeats,
                                                  straggler_blocks(args), kept, args.warmup)
                    placed = actors_per_node(executor)
            finally:
                end_graphs(executor, kept)
                executor.shutdown()
    out = {"unshaped": summary(unshaped), args.rate: summary(shaped)}
    reference = out[args.rate]["node"]["ms"]
    times = {combo[3]: statistics.median(b[0] for b in measured) for combo, measured in straggled.items()}
    out["straggler"] = {"slow_node": slow, "reference_ms": reference, "none_ms": times[None],
                        "deadline_ms": times[args.deadline], "ratio_none": times[None] / reference,
                        "ratio_deadline": times[args.deadline] / reference,
                        "objects": {combo[3]: measured[-1][2] for combo, measured in straggled.items()}}
    for key in ("unshaped", args.rate):
        out[key].update(nodes=nodes, clients=nodes * per_node, actors_per_node=placed)
    return out


PRECISION_BLOCKS = (("classic", "node", "fp32", None), ("classic", "node", "bf16", None))


def measure_precision_rates(netcluster, args: argparse.Namespace) -> dict[str, dict]:
    """``--precision-rates``: on netlab's cluster, one classic executor with ``reduce: node``, fp32 against bf16
    transfers in alternating blocks, unshaped and then at each rate (every node's ingress). Returns rate ->
    {"fp32": row, "bf16": row, "ratio": bf16 / fp32}, rows as in :func:`summary`."""
    nodes, per_node = args.nodes[-1], args.clients_per_node
    out: dict[str, dict] = {}
    with netcluster.net_cluster(workers=nodes, cpus_per_worker=per_node, rate=None,
                                object_store_bytes=store_bytes_for(nodes, per_node, args.state_floats)) as nc:
        executor, algorithm, state = start_executor(nodes, per_node, args.state_floats)
        kept: dict = {}
        try:
            for rate in ["unshaped", *args.precision_rates]:
                with contextlib.ExitStack() as shaped:
                    if rate != "unshaped":
                        shaped.enter_context(netcluster.Shaping(nc.ips, rate))
                    state, got = blocks(executor, algorithm, state, args.rounds, args.repeats, PRECISION_BLOCKS,
                                        kept, args.warmup)
                rows = {}
                for combo, measured in got.items():
                    times = [b[0] for b in measured]
                    rows[combo[2]] = {"ms": statistics.median(times), "lo": min(times), "hi": max(times),
                                      "ingress": measured[-1][1], "objects": measured[-1][2]}
                out[rate] = {**rows, "ratio": rows["bf16"]["ms"] / rows["fp32"]["ms"]}
                print(f"  {rate}: fp32 {rows['fp32']['ms']:.0f} ms, bf16 {rows['bf16']['ms']:.0f} ms, "
                      f"bf16 / fp32 {out[rate]['ratio']:.2f}", file=sys.stderr, flush=True)
            out["actors_per_node"] = {"placed": actors_per_node(executor)}
        finally:
            end_graphs(executor, kept)
            executor.shutdown()
    return out


def rate_key(rate: str) -> str:
    """A rate as it appears in a RESULT name: ``1.5gbit`` -> ``1_5gbit``."""
    return re.sub(r"\W", "_", rate.strip())


def check_precision_rates(parser: argparse.ArgumentParser, netcluster, rates: list[str]) -> None:
    """--precision-rates: each a rate netlab reads, above zero, no two the same (the fit needs distinct links);
    checked before any node starts."""
    bits: dict[int, str] = {}
    for rate in rates:
        try:
            value = netcluster.parse_rate(rate)
        except ValueError as e:
            parser.error(f"--precision-rates: {e}")
        if value <= 0:
            parser.error(f"--precision-rates: {rate!r} is no rate above zero (use e.g. 1gbit, 500mbit)")
        if value in bits:
            parser.error(f"--precision-rates: {rate!r} and {bits[value]!r} are the same rate; give distinct rates")
        bits[value] = rate


def line_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y on x through ``points`` (at least two distinct x)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def precision_body(args: argparse.Namespace, results: dict[str, dict], netcluster) -> str:
    """The results file's block for --precision-rates: fp32 and bf16 node rounds per link, and a line fit of the
    round time against the time one bit takes on a link (1 / rate) that splits each into a part that does not
    shrink with the link (the intercept) and a part that does (the slope)."""
    rates = list(args.precision_rates)
    rows = [[rate, _ms(results[rate]["fp32"]), _ms(results[rate]["bf16"]), f"{results[rate]['ratio']:.2f}"]
            for rate in ["unshaped", *rates]]
    placed = ", ".join(map(str, results["actors_per_node"]["placed"]))
    mib = args.state_floats * 4 / 2**20
    text = f"""
netlab cluster ({args.netlab}): a head without CPUs and {args.nodes[-1]} worker nodes, each at its own \
loopback address, x {args.clients_per_node} client actors pinned per node (actors per node {placed}), state \
of N = {args.state_floats:,} floats ({mib:.1f} MiB), one trivial local step on one sample per round (CODA+, a \
linear scorer), classic transport, `reduce: node`. One executor; `transfer_precision` fp32 and bf16 in \
{args.repeats} alternating blocks of {args.rounds} timed rounds (after {_warmups(args)}) per link, unshaped and \
then with every node's ingress at each rate; round time = median over the blocks of each block's median \
(lo..hi over the blocks). Machine: {os.cpu_count()} CPU cores and {meminfo_gib('MemTotal'):.0f} GiB of memory \
shared by every node. {store_line(args)}

{C.table(["per-node link", "fp32 node round ms", "bf16 node round ms", "bf16 / fp32"], rows)}
"""
    if len(rates) >= 2:
        x = {rate: 1e9 / netcluster.parse_rate(rate) for rate in rates}  # ns a bit takes on the link
        fits = {p: line_fit([(x[rate], results[rate][p]["ms"]) for rate in rates]) for p in ("fp32", "bf16")}
        fit_rows = [[p, f"{fits[p][0]:.0f}", f"{fits[p][1]:.0f}"] for p in ("fp32", "bf16")]
        bound = ", ".join(f"{(fits['fp32'][0] + fits['fp32'][1] * x[r] / 2) / results[r]['fp32']['ms']:.2f} of "
                          f"fp32's at {r}" for r in rates)
        kept = fits["bf16"][1] / fits["fp32"][1]
        text += f"""
Line fit over the shaped links (round ms = a + b x, x = ns a bit takes on each node's link: 1 at 1gbit):

{C.table(["precision", "a: ms that do not shrink with the link", "b: ms per ns a bit"], fit_rows)}

b (bf16) / b (fp32) = {kept:.2f}: the share of fp32's network time a bf16 round keeps. A bf16 round that \
halved the network time and added nothing would take a (fp32) + b (fp32) x / 2: {bound}.
"""
    return text


def end_graphs(executor: RayExecutor, kept: dict) -> None:
    """End the compiled graphs of the kept transports other than the executor's own (it ends that one)."""
    for transport in kept.values():
        graph = getattr(transport, "graph", None)
        if transport is not executor.transport and graph is not None:
            graph.teardown()


def straggler_blocks(args: argparse.Namespace) -> tuple:
    return (("classic", "node", "fp32", None), ("classic", "node", "fp32", args.deadline))


def _ms(r: dict) -> str:
    return f"{r['ms']:.0f} ({r['lo']:.0f}..{r['hi']:.0f})"


def _warmups(args: argparse.Namespace) -> str:
    return "one warm-up round" if args.warmup == 1 else f"{args.warmup} warm-up rounds"


def netlab_body(args: argparse.Namespace, results: dict[str, dict]) -> str:
    """The results file's block for a --netlab run: unshaped and shaped side by side, bf16, one slow node."""
    links = {k: results[k] for k in ("unshaped", args.rate)}
    rows = [[link, _ms(r["classic", "star"]), _ms(r["classic", "node"]), f"{r['round_ratio']:.2f}",
             _ms(r["compiled", "star"]), _ms(r["compiled", "node"]), f"{r['round_ratio_compiled']:.2f}",
             f"{r['star']['ingress'] / 1e6:.0f} ({r['star']['objects']}) / "
             f"{r['node']['ingress'] / 1e6:.0f} ({r['node']['objects']})"]
            for link, r in links.items()]
    last = results[args.rate]
    bf16 = [[reduce, _ms(last["classic", reduce]), _ms(last["classic", reduce, "bf16", None]),
             f"{last['bf16_ratio' if reduce == 'star' else 'bf16_ratio_node']:.2f}",
             f"{last['classic', reduce]['ingress'] / 1e6:.0f} / "
             f"{last['classic', reduce, 'bf16', None]['ingress'] / 1e6:.0f}"] for reduce in ("star", "node")]
    st = results["straggler"]
    slow = [[f"all nodes at {args.rate}, no deadline", f"{st['reference_ms']:.0f}", "1.00",
             str(last["node"]["objects"])],
            [f"{st['slow_node']} at {args.slow_rate}, no deadline", f"{st['none_ms']:.0f}",
             f"{st['ratio_none']:.2f}", str(st["objects"][None])],
            [f"{st['slow_node']} at {args.slow_rate}, round_deadline={args.deadline}", f"{st['deadline_ms']:.0f}",
             f"{st['ratio_deadline']:.2f}", str(st["objects"][args.deadline])]]
    return f"""
netlab cluster ({args.netlab}): a head without CPUs and {last['nodes']} worker nodes, each at its own \
loopback address, x {args.clients_per_node} client actors pinned per node (actors per node \
{", ".join(map(str, last["actors_per_node"]))}), one actor per client, state of N = {args.state_floats:,} floats \
({args.state_floats * 4 / 2**20:.1f} MiB), one trivial local step on one sample per round (CODA+, a linear scorer). \
One cluster; on it an executor for the classic transport, then one for the compiled transport (their memory \
together does not fit this machine at this size). Each measures unshaped, then with every node's ingress \
limited to {args.rate} (tc); the classic one then with one node at {args.slow_rate}. In each, {args.repeats} \
alternating blocks of {args.rounds} timed rounds (after {_warmups(args)}) per setting (the compiled \
`reduce: node` blocks last, one after another, so each graph is built once); round time = median over the \
blocks of each block's median (lo..hi over the blocks). Machine: {os.cpu_count()} CPU cores and \
{meminfo_gib('MemTotal'):.0f} GiB of memory shared by every node. {store_line(args)}

**Star against node**, under the classic and the compiled transport:

{C.table(["per-node link", "classic star ms", "classic node ms", "node / star", "compiled star ms",
          "compiled node ms", "node / star (compiled)", "driver ingress MB (objects), star / node"], rows)}

**`transfer_precision: bf16`** against fp32 at {args.rate}, classic transport (rounded differences both ways; \
the compiled transport carries float32 states only):

{C.table(["reduce", "fp32 ms", "bf16 ms", "bf16 / fp32", "MB the clients sent, fp32 / bf16"], bf16)}

**One slow site**: {st['slow_node']}'s ingress at {args.slow_rate}, the other nodes' at {args.rate}, `reduce: \
node`, classic; ratios against the round with every node at {args.rate} (measured above):

{C.table(["setting", "round ms", "/ without the slow node", "sums folded in the last round"], slow)}
"""


def store_line(args: argparse.Namespace) -> str:
    """What the results file says of the object stores: their size and whether any round went to disk."""
    size = store_bytes_for(args.nodes[-1], args.clients_per_node, args.state_floats) / 2**20
    if not STORE_PRESSURE:
        return f"Object store: {size:,.0f} MiB per node."
    return (f"Object store: {size:,.0f} MiB per node; over the run {STORE_PRESSURE['spilled_mib']:,.0f} MiB were "
            f"spilled to disk and at most {STORE_PRESSURE['fallback_mib']:,.0f} MiB sat in fallback files "
            "(objects a full store puts on disk).")


def local_body(args: argparse.Namespace, results: list[dict]) -> str:
    """The results file's block for a run on the loopback cluster."""
    last = results[-1]
    n_bytes = args.state_floats * 4
    # this machine's cost of moving state bytes between object stores, from the star rounds of the largest case
    ms_per_byte = last["star"]["ms"] / last["star"]["ingress"]
    rows = [[r["nodes"], r["clients"], ", ".join(map(str, r["actors_per_node"])),
             f"{r['star']['ingress'] / 1e6:.0f} ({r['star']['objects']})",
             f"{r['node']['ingress'] / 1e6:.0f} ({r['node']['objects']})", f"{r['ingress_ratio']:.3f}",
             _ms(r["star"]), _ms(r["node"]), f"{r['round_ratio']:.2f}",
             _ms(r["compiled", "star"]), _ms(r["compiled", "node"]), f"{r['round_ratio_compiled']:.2f}"]
            for r in results]
    return f"""
W worker nodes x {args.clients_per_node} client actors pinned per node (`client_resources`), one actor per \
client, state of N = {args.state_floats:,} floats ({n_bytes / 2**20:.1f} MiB), one trivial local step on one \
sample per round (CODA+, a linear scorer). {args.repeats} alternating blocks of {args.rounds} timed rounds \
(after {_warmups(args)}) with `reduce: star` and `reduce: node`, each under `transport: classic` and \
`transport: compiled`, on the same started executor; round time = median over the blocks of each block's median \
(lo..hi over the blocks). Ingress = bytes of the objects the driver fetched and folded in one round (objects in \
brackets; the same under both transports). Machine: {os.cpu_count()} CPU cores shared by every node of the cluster.

{C.table(["worker nodes", "clients", "actors per node", "star ingress MB (objects)", "node ingress MB (objects)",
          "ingress node / star", "star round ms", "node round ms", "round node / star", "compiled star ms",
          "compiled node ms", "round node / star (compiled)"], rows)}

**Reading it.** With `node`, the driver's node receives one state per node instead of one per client \
(ingress ratio = nodes / clients = 1 / {args.clients_per_node}). On this one machine every node shares the \
same memory and {os.cpu_count()} cores, so moving an object between "nodes" is a memory copy, and the node \
reducers' merges take the same cores as the clients: what `node` saves here is the driver's copying and \
folding of {args.clients_per_node}x the bytes, not network time. Round time at {last['nodes']} nodes: \
{last['round_ratio']:.2f} x star's under the classic transport, {last['round_ratio_compiled']:.2f} x under the \
compiled one (target at most {TARGET_ROUND_RATIO}: \
{"met" if last['round_ratio'] <= TARGET_ROUND_RATIO else "not met on this machine"}). Both reductions fold \
each sum as it arrives (a node's reducer its actors' sums, the driver the nodes' sums), but a node's sum can \
leave its node only once its last actor has finished, while star's transfers overlap the other actors' local \
steps: what `node` keeps after its actors finish is one merge, one copy into the reducer's object store and \
{last['nodes']} transfers of a state to the driver's node. On this machine the star rounds cost \
{ms_per_byte * 1e6:.2f} ms per MB received by the driver.

**On a real cluster** the driver's network link carries the ingress. Time to receive one round's updates \
through the driver's link alone (state of float32, 16 clients per node, link at its nominal rate, no \
protocol overhead), star against node; the last column is what the same bytes cost at this machine's \
measured per-byte rate, for scale:

{C.table(["state", "clients", "nodes", "driver link", "star ms", "node ms", "star / node",
          "this machine's rate, star ms"], link_table(ms_per_byte * 4))}

{example(64)}

`star` stays the default: it folds every sum as it arrives and needs no reducer actors, and on one node \
(or a fast driver link with few clients) the merge step is pure cost; choose `node` when the clients span many \
nodes and the driver's link is the bottleneck.
"""


def link_table(bytes_per_float_ms: float) -> list[list]:
    """Driver-link time per round, star vs node, for real clusters (16 clients per node)."""
    rows = []
    for model, floats in (("DenseNet121", DENSENET121_FLOATS), ("ResNet20", RESNET20_FLOATS)):
        size = floats * 4
        for clients in (16, 64, 256):
            nodes = max(1, clients // 16)
            for link, gbit in LINKS_GBIT.items():
                per_byte_ms = 8e3 / (gbit * 1e9)
                star, node = clients * size * per_byte_ms, nodes * size * per_byte_ms
                rows.append([model, clients, nodes, link, f"{star:.0f}", f"{node:.0f}", f"{star / node:.0f}x",
                             f"{clients * size * bytes_per_float_ms / 4:.0f}"])
    return rows


def example(clients: int, link: str = "10 GbE") -> str:
    """One sentence of the arithmetic above, for ``clients`` clients (16 per node)."""
    per_byte_ms = 8e3 / (LINKS_GBIT[link] * 1e9)
    nodes = max(1, clients // 16)
    parts = []
    for model, floats in (("DenseNet121", DENSENET121_FLOATS), ("ResNet20", RESNET20_FLOATS)):
        size = floats * 4
        parts.append(f"{model} ({size / 1e6:.1f} MB a state) needs {clients * size * per_byte_ms:.0f} ms of "
                     f"driver link per round with star and {nodes * size * per_byte_ms:.1f} ms with node")
    return f"At {clients} clients on {nodes} nodes over {link}: " + "; ".join(parts) + "."


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--clients-per-node", type=int, default=4)
    parser.add_argument("--state-floats", type=int, default=7_000_000)
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per block (after --warmup rounds)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating blocks of each transport and reduce")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed rounds before each block (default 1; with --netlab 4: a compiled graph's "
                             "first rounds over shaped links take 2-3x its later ones)")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/node_reduce.md; "
                                                    "with --netlab node_reduce_netlab.md)")
    parser.add_argument("--netlab", default=None, metavar="DIR",
                        help="run on netlab's shaped cluster (DIR/netcluster.py; needs root and tc) at the largest "
                             "--nodes, unshaped and at --rate")
    parser.add_argument("--rate", default="1gbit", help="--netlab: each node's ingress rate (tc's syntax)")
    parser.add_argument("--slow-rate", default="100mbit", help="--netlab: the slow node's ingress rate")
    parser.add_argument("--deadline", default="2x", help="--netlab: round_deadline with the slow node")
    parser.add_argument("--precision-rates", nargs="+", default=None, metavar="RATE",
                        help="--netlab: measure only `reduce: node` (classic) with fp32 against bf16 transfers, "
                             "unshaped and at each of these per-node rates (results file default "
                             "node_reduce_precision.md)")
    args = parser.parse_args(argv)
    if args.precision_rates and not args.netlab:
        parser.error("--precision-rates needs --netlab (the rates are netlab's shaping)")
    if args.warmup is None:
        args.warmup = 4 if args.netlab else 1
    if args.warmup < 1:
        parser.error(f"--warmup: {args.warmup}; at least 1 (the first round of a block builds its compiled graph)")
    netcluster = load_netlab(args.netlab) if args.netlab else None
    if netcluster is not None and args.precision_rates:
        check_precision_rates(parser, netcluster, args.precision_rates)
    if netcluster is not None:
        netcluster.ensure_driver_shim()  # re-executes this program as a process of the head node
    torch.set_num_threads(1)
    from fdam_ray.executors.ray.compat import token_auth_enabled as is_token_auth_enabled

    # the nodes started here must use the token mode this process's Ray read when it was imported
    os.environ["RAY_AUTH_MODE"] = "token" if is_token_auth_enabled() else "disabled"
    out_name = "node_reduce.md"
    if netcluster is not None and args.precision_rates:
        by_rate = measure_precision_rates(netcluster, args)
        body = precision_body(args, by_rate, netcluster)
        values = dict(rates="_".join(args.precision_rates), ratio_bf16_fp32_node_unshaped=by_rate["unshaped"]["ratio"],
                      **{f"ratio_bf16_fp32_node_{rate_key(r)}": by_rate[r]["ratio"] for r in args.precision_rates})
        out_name = "node_reduce_precision.md"
    elif netcluster is not None:
        by_link = measure_netlab(netcluster, args)
        for link in ("unshaped", args.rate):
            print(f"{link}: {progress(by_link[link])}", flush=True)
        body = netlab_body(args, by_link)
        shaped, st = by_link[args.rate], by_link["straggler"]
        values = dict(rate=args.rate, round_ratio_node_star=shaped["round_ratio"],
                      round_ratio_node_star_compiled=shaped["round_ratio_compiled"],
                      round_ratio_bf16_fp32=shaped["bf16_ratio"], straggler_ratio_deadline=st["ratio_deadline"],
                      straggler_ratio_none=st["ratio_none"])
        out_name = "node_reduce_netlab.md"
    else:
        results = []
        for nodes in args.nodes:
            results.append(measure(nodes, args.clients_per_node, args.state_floats, args.rounds, args.repeats,
                                   args.warmup))
            print(progress(results[-1]), flush=True)
        body = local_body(args, results)
        last = results[-1]
        values = dict(nodes=last["nodes"], clients=last["clients"], ingress_ratio_node_star=last["ingress_ratio"],
                      round_ratio_node_star=last["round_ratio"],
                      round_ratio_node_star_compiled=last["round_ratio_compiled"])
    out = Path(args.out) if args.out else C.RESULTS_DIR / out_name
    title = ("bf16 against fp32 transfers under per-node reduction, by link rate" if args.precision_rates
             else "Per-node reduction against the star")
    C.write_results(out, title, C.command_line("node_reduce.py", argv), body)
    line = C.result_line(**values)
    print(line)
    return line


def progress(r: dict) -> str:
    return (f"nodes={r['nodes']} clients={r['clients']} (actors per node {r['actors_per_node']}): "
            f"star {r['star']['ms']:.0f} ms, {r['star']['ingress'] / 1e6:.0f} MB in {r['star']['objects']} objects; "
            f"node {r['node']['ms']:.0f} ms, {r['node']['ingress'] / 1e6:.0f} MB in {r['node']['objects']} objects; "
            f"ingress ratio {r['ingress_ratio']:.3f}, round ratio {r['round_ratio']:.2f}; compiled star "
            f"{r['compiled', 'star']['ms']:.0f} ms, node {r['compiled', 'node']['ms']:.0f} ms, round ratio "
            f"{r['round_ratio_compiled']:.2f}")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
