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

With ``--netlab DIR --precision-rates R1 R2 ...`` it measures ``reduce: star``
and ``reduce: node`` (classic) and ``transport: collective``, each with fp32
and with bf16 + error feedback transfers, unshaped and at each rate, fits each
to round ms = a + b x (x = ns a bit takes on each node's link: a, the part
that does not shrink with the link; b, the part that does), sets the
collective's b against the ring all-reduce's bound computed from the sizes,
and ends with one node at ``--slow-rate`` per transport, with and without
``--deadline`` (_node_reduce_links.py; benchmarks/results/node_reduce_collective.md
and .png).

    python benchmarks/node_reduce.py [--nodes 2 4] [--clients-per-node 4] [--state-floats 7000000]
                                     [--rounds 6] [--repeats 3] [--warmup N]
                                     [--out benchmarks/results/node_reduce.md]
                                     [--netlab ../shared/netlab --rate 1gbit [--slow-rate 100mbit]
                                      [--deadline 2x] [--precision-rates 1gbit 500mbit 250mbit
                                      [--block-seconds 10]]]

Last line: ``RESULT nodes=... clients=... ingress_ratio_node_star=... round_ratio_node_star=...
round_ratio_node_star_compiled=...`` (at the largest --nodes); with --netlab ``RESULT rate=...
round_ratio_node_star=... round_ratio_node_star_compiled=... round_ratio_bf16_fp32=...
straggler_ratio_deadline=... straggler_ratio_none=...`` (at that rate; the bf16 ratio under ``reduce: star``,
the straggler ratios against the ``reduce: node`` round with every node at the rate); with --precision-rates
``RESULT b_star_fp32=... b_star_bf16=... b_node_fp32=... b_node_bf16=... b_collective_fp32=... b_collective_bf16=...
b_ring_fp32=... a_collective_fp32=... round_ratio_collective_node_<rate>=... round_ratio_collective_ring_<rate>=...
resid_max_<transport>_<precision>=... straggler_x_<transport>_<none|deadline>=... straggler_round_ratio_collective=...
slowcompute_round_ratio_collective=...`` (b in ms per ns a bit, nan where a setting was refused; the ratios at
--rate; the ring ratio = the collective round over a_collective + b_ring x, the best this machine's compute
allows; x_eff of the slow-node rounds on each transport's line; the collective with its deadline and one node at
--slow-rate, and with one node's steps --compute-factor times slower, each over the all-fast collective round).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import _common as C
import _node_reduce_links as links
import torch
from _node_reduce_core import (  # noqa: F401 (STORE_PRESSURE, store_pressure: read by the tests)
    BLOCKS,
    SHAPED_BLOCKS,
    STORE_PRESSURE,
    _ms,
    _warmups,
    actors_per_node,
    blocks,
    check_precision_rates,
    end_graphs,
    load_netlab,
    loopback_cluster,
    meminfo_gib,
    rate_key,
    start_executor,
    store_bytes_for,
    store_line,
    store_pressure,
    straggler_blocks,
)

DENSENET121_FLOATS = 6_960_000  # trainable parameters of DenseNet121 with one output, plus a, b
RESNET20_FLOATS = 270_000
LINKS_GBIT = {"10 GbE": 10.0, "100 GbE": 100.0}
TARGET_ROUND_RATIO = 0.6  # node's round time at most this times star's at the largest --nodes


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


def measure(nodes: int, clients_per_node: int, state_floats: int, count: int, repeats: int, warmup: int = 1
            ) -> dict:
    with loopback_cluster(nodes, clients_per_node, store_bytes_for(nodes, clients_per_node, state_floats)):
        executor, algorithm, state, started = start_executor(nodes, clients_per_node, state_floats)
        kept: dict = {}
        try:
            state, got = blocks(executor, algorithm, state, count, repeats, BLOCKS, kept, warmup, started=started)
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
            executor, algorithm, state, started = start_executor(nodes, per_node, args.state_floats)
            kept: dict = {}
            try:
                state, got = blocks(executor, algorithm, state, args.rounds, args.repeats, combos, kept,
                                    args.warmup, started=started)
                unshaped.update(got)
                with netcluster.Shaping(nc.ips, args.rate):
                    more = tuple(c for c in SHAPED_BLOCKS if c[0] == transport and c not in combos)
                    state, got = blocks(executor, algorithm, state, args.rounds, args.repeats, combos + more, kept,
                                        args.warmup, started=started)
                    shaped.update(got)
                if transport == "classic":
                    slow = nc.ips[-1]
                    with netcluster.Shaping(nc.ips, args.rate, node_rates={slow: args.slow_rate}):
                        state, straggled = blocks(executor, algorithm, state, args.rounds, args.repeats,
                                                  straggler_blocks(args), kept, args.warmup, started=started)
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
                        help="untimed rounds before each block (default 1; with --netlab 4, as a compiled graph's "
                             "first rounds over shaped links take 2-3x its later ones; with --precision-rates 1)")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/node_reduce.md; "
                                                    "with --netlab node_reduce_netlab.md)")
    parser.add_argument("--netlab", default=None, metavar="DIR",
                        help="run on netlab's shaped cluster (DIR/netcluster.py; needs root and tc) at the largest "
                             "--nodes, unshaped and at --rate")
    parser.add_argument("--rate", default="1gbit", help="--netlab: each node's ingress rate (tc's syntax)")
    parser.add_argument("--slow-rate", default="100mbit", help="--netlab: the slow node's ingress rate")
    parser.add_argument("--deadline", default="2x", help="--netlab: round_deadline with the slow node")
    parser.add_argument("--precision-rates", nargs="+", default=None, metavar="RATE",
                        help="--netlab: measure `reduce: star`, `reduce: node` (classic) and `transport: "
                             "collective`, each with fp32 and with bf16 + error feedback transfers, unshaped and at "
                             "each of these per-node rates, fit each to a + b x, then one node at --slow-rate "
                             "(results file default node_reduce_collective.md, with its .png)")
    parser.add_argument("--transports", nargs="+", default=None, choices=("star", "node", "collective"),
                        help="--precision-rates: only these (default all three)")
    parser.add_argument("--block-seconds", type=float, default=10.0,
                        help="--precision-rates: a block runs as many rounds (2 to --rounds) as this many seconds "
                             "hold at its setting's last round time")
    parser.add_argument("--compute-steps", type=int, default=4,
                        help="--precision-rates: local steps a round in the slow-compute phase (0: skip it)")
    parser.add_argument("--compute-pace", type=float, default=0.25,
                        help="--precision-rates: seconds each of those steps sleeps on every client")
    parser.add_argument("--compute-factor", type=float, default=3.0,
                        help="--precision-rates: how many times slower the last node's steps are")
    parser.add_argument("--compute-deadline", default="1.25x",
                        help="--precision-rates: round_deadline of the collective in the slow-compute phase")
    args = parser.parse_args(argv)
    if args.precision_rates and not args.netlab:
        parser.error("--precision-rates needs --netlab (the rates are netlab's shaping)")
    if args.block_seconds <= 0:
        parser.error(f"--block-seconds: {args.block_seconds:g}; must be above zero")
    if args.warmup is None:  # no compiled graph in the --precision-rates sweep
        args.warmup = 4 if args.netlab and not args.precision_rates else 1
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
    out_name = "node_reduce_collective.md" if args.precision_rates else "node_reduce.md"
    out = Path(args.out) if args.out else C.RESULTS_DIR / out_name
    if netcluster is not None and args.precision_rates:
        body, values = links.run(netcluster, args, out)
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
        out = Path(args.out) if args.out else C.RESULTS_DIR / "node_reduce_netlab.md"
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
    title = ("Round time against link speed: star, node and collective, fp32 and bf16" if args.precision_rates
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
