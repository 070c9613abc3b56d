"""Per-node reduction against the star: what reaches the driver's node per round, and the round time.

A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head
with no CPUs for clients and W worker nodes, each its own raylet and object
store), 4 client actors pinned to each worker node (``client_resources``), each
client taking one trivial local step on one sample of a linear scorer whose
state v has N floats (the round_overhead workload). The same started executor
runs blocks of rounds with ``reduce: star`` (every actor's partial sum goes to
the driver) and ``reduce: node`` (the actors on one node are merged there, the
driver receives one sum per node), alternating, so machine noise hits both.

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

    python benchmarks/node_reduce.py [--nodes 2 4] [--clients-per-node 4] [--state-floats 7000000]
                                     [--rounds 6] [--repeats 3] [--out benchmarks/results/node_reduce.md]

Last line: ``RESULT nodes=... clients=... ingress_ratio_node_star=... round_ratio_node_star=...`` (at the
largest --nodes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
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
from fdam_ray.client import Replica
from fdam_ray.config import build_config
from fdam_ray.executors.ray.compat import loopback_node
from fdam_ray.executors.ray.executor import RayExecutor
from fdam_ray.executors.ray.transports import REGISTRY, transport_for
from fdam_ray.state import RoundPlan

DENSENET121_FLOATS = 6_960_000  # trainable parameters of DenseNet121 with one output, plus a, b
RESNET20_FLOATS = 270_000
LINKS_GBIT = {"10 GbE": 10.0, "100 GbE": 100.0}
TARGET_ROUND_RATIO = 0.6  # node's round time at most this times star's at the largest --nodes


def start_cluster(nodes: int, clients_per_node: int, store_bytes: int) -> Cluster:
    with loopback_node():  # every node, and this driver, on 127.0.0.1
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                                "object_store_memory": store_bytes,
                                                                "node_ip_address": "127.0.0.1"})
        for i in range(nodes):
            cluster.add_node(num_cpus=clients_per_node, resources={f"site_{i}": 1}, object_store_memory=store_bytes,
                             node_ip_address="127.0.0.1")
        ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    return cluster


def start_executor(nodes: int, clients_per_node: int, state_floats: int):
    k = nodes * clients_per_node
    config = build_config(dict(
        dataset="arrays", num_clients=k, model="linear", algorithm="coda_plus", batch_size="full", local_steps=1,
        lr=0.01, executor="ray", eval_on="driver", cpus_per_actor=1.0, threads_per_actor=1,
        client_resources=[{f"site_{c // clients_per_node}": 0.01} for c in range(k)], reduce="star"))
    source = WideSource(k, state_floats - 3)
    executor = RayExecutor()
    executor.start(config, source)
    state = Replica(config, source, device=torch.device("cpu")).flat.initial_state()
    executor.configure(np.array([0.5]))
    executor.begin_stage(state.v, True)
    return executor, build_algorithm(AlgorithmSection.of(config)), state


def use_reduce(executor: RayExecutor, reduce: str, kept: dict) -> None:
    """Switch the started executor's transport to the one that runs ``reduce`` (kept in ``kept`` by name, so the
    node transport keeps its reducer actors from block to block); the executor closes the last one at shutdown."""
    executor.config = dataclasses.replace(executor.config, reduce=reduce)
    name = transport_for(executor.config.transport, reduce)
    if name not in kept:
        kept[name] = REGISTRY[name](executor.fleet, executor.config)
    executor.transport = kept[name]


def rounds(executor, algorithm, state, reduce: str, count: int, warmup: int = 1):
    """``count`` timed rounds (after ``warmup``) with ``reduce``; returns (state, median ms, ingress bytes/round)."""
    walls, ingress = [], []
    for r in range(warmup + count):
        plan = RoundPlan(round=state.round + 1, stage=1, steps=1, lr=0.01, iteration=state.iteration)
        reducer = algorithm.reducer(state)
        received = []

        def fold(part, reducer=reducer, received=received):
            received.append(sum(a.nbytes for a in (part.v, part.alpha, part.buffers, part.counters, part.c_v,
                                                   part.c_alpha) if a is not None))
            reducer.fold(part)

        t0 = time.perf_counter()
        executor.run_round(state, plan, fold)
        state = reducer.finish(steps=1)
        if r >= warmup:
            walls.append(time.perf_counter() - t0)
            ingress.append(sum(received))
    return state, 1e3 * statistics.median(walls), statistics.median(ingress), len(received)


def measure(nodes: int, clients_per_node: int, state_floats: int, count: int, repeats: int) -> dict:
    store = max(300 * 2**20, (clients_per_node + 3) * state_floats * 4 * 2)
    cluster = start_cluster(nodes, clients_per_node, store)
    try:
        executor, algorithm, state = start_executor(nodes, clients_per_node, state_floats)
        try:
            got = {"star": [], "node": []}
            transports: dict = {}
            for _ in range(repeats):
                for reduce in ("star", "node"):
                    use_reduce(executor, reduce, transports)
                    state, ms, ingress, objects = rounds(executor, algorithm, state, reduce, count)
                    got[reduce].append((ms, ingress, objects))
            by_node = {}
            for info in executor.where_of.values():
                by_node.setdefault(info.get("node_id"), 0)
                by_node[info.get("node_id")] += 1
        finally:
            executor.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    out = {"nodes": nodes, "clients": nodes * clients_per_node, "actors_per_node": sorted(by_node.values())}
    for reduce, blocks in got.items():
        times = [b[0] for b in blocks]
        out[reduce] = {"ms": statistics.median(times), "lo": min(times), "hi": max(times),
                       "ingress": blocks[-1][1], "objects": blocks[-1][2]}
    out["ingress_ratio"] = out["node"]["ingress"] / out["star"]["ingress"]
    out["round_ratio"] = out["node"]["ms"] / out["star"]["ms"]
    return out


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
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per block (after 1 warm-up round)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating blocks of star and node")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/node_reduce.md)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from fdam_ray.executors.ray.compat import token_auth_enabled as is_token_auth_enabled

    # the nodes started here must use the token mode this process's Ray read when it was imported
    os.environ["RAY_AUTH_MODE"] = "token" if is_token_auth_enabled() else "disabled"
    results = []
    for nodes in args.nodes:
        r = measure(nodes, args.clients_per_node, args.state_floats, args.rounds, args.repeats)
        results.append(r)
        print(f"nodes={nodes} clients={r['clients']} (actors per node {r['actors_per_node']}): "
              f"star {r['star']['ms']:.0f} ms, {r['star']['ingress'] / 1e6:.0f} MB in {r['star']['objects']} objects; "
              f"node {r['node']['ms']:.0f} ms, {r['node']['ingress'] / 1e6:.0f} MB in {r['node']['objects']} objects;"
              f" ingress ratio {r['ingress_ratio']:.3f}, round ratio {r['round_ratio']:.2f}", flush=True)
    last = results[-1]
    n_bytes = args.state_floats * 4
    # this machine's cost of moving state bytes between object stores, from the star rounds of the largest case
    ms_per_byte = last["star"]["ms"] / last["star"]["ingress"]
    rows = [[r["nodes"], r["clients"], ", ".join(map(str, r["actors_per_node"])),
             f"{r['star']['ingress'] / 1e6:.0f} ({r['star']['objects']})",
             f"{r['node']['ingress'] / 1e6:.0f} ({r['node']['objects']})", f"{r['ingress_ratio']:.3f}",
             f"{r['star']['ms']:.0f} ({r['star']['lo']:.0f}..{r['star']['hi']:.0f})",
             f"{r['node']['ms']:.0f} ({r['node']['lo']:.0f}..{r['node']['hi']:.0f})", f"{r['round_ratio']:.2f}"]
            for r in results]
    body = f"""
W worker nodes x {args.clients_per_node} client actors pinned per node (`client_resources`), one actor per \
client, state of N = {args.state_floats:,} floats ({n_bytes / 2**20:.1f} MiB), one trivial local step on one \
sample per round (CODA+, a linear scorer). {args.repeats} alternating blocks of {args.rounds} timed rounds \
(after one warm-up round) with `reduce: star` and `reduce: node` on the same started executor; round time = \
median over the blocks of each block's median (lo..hi over the blocks). Ingress = bytes of the objects the \
driver fetched and folded in one round (objects in brackets). Machine: {os.cpu_count()} CPU cores shared by \
every node of the cluster.

{C.table(["worker nodes", "clients", "actors per node", "star ingress MB (objects)", "node ingress MB (objects)",
          "ingress node / star", "star round ms", "node round ms", "round node / star"], rows)}

**Reading it.** With `node`, the driver's node receives one state per node instead of one per client \
(ingress ratio = nodes / clients = 1 / {args.clients_per_node}). On this one machine every node shares the \
same memory and {os.cpu_count()} cores, so moving an object between "nodes" is a memory copy, and the node \
reducers' merges take the same cores as the clients: what `node` saves here is the driver's copying and \
folding of {args.clients_per_node}x the bytes, not network time. Round time at {last['nodes']} nodes: \
{last['round_ratio']:.2f} x star's (target at most {TARGET_ROUND_RATIO}: \
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
    out = Path(args.out) if args.out else C.RESULTS_DIR / "node_reduce.md"
    C.write_results(out, "Per-node reduction against the star", C.command_line("node_reduce.py", argv), body)
    line = C.result_line(nodes=last["nodes"], clients=last["clients"], ingress_ratio_node_star=last["ingress_ratio"],
                         round_ratio_node_star=last["round_ratio"])
    print(line)
    return line


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
