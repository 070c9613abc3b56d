"""The machinery of benchmarks/node_reduce.py: the cluster, one started executor, and blocks of timed rounds.

One executor with K client actors pinned W to a node runs blocks of rounds, switching between transports and
reductions (``reduce: star`` / ``node`` under ``transport: classic`` or ``compiled``, and ``transport:
collective``), transfer precisions and round deadlines without starting its actors again, so every setting runs
on the same actors and machine noise hits all. A block under the collective transport runs its rounds as the
federation would: in runs of ``collective_rounds`` (one call per actor for all of them) when the executor takes
rounds ahead, else one at a time. A setting the config refuses (e.g. a deadline under the collective
transport) is reported as refused, with the config's own line, and not run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import ray
import torch
from ray.cluster_utils import Cluster
from round_overhead import WideSource

from fdam_ray.algorithms import AlgorithmSection, build_algorithm
from fdam_ray.clients.client import Replica
from fdam_ray.config import build_config
from fdam_ray.core.state import RoundPlan
from fdam_ray.executors.base import ExecutorSetup
from fdam_ray.executors.deadlines import Deadline
from fdam_ray.executors.ray.compat import loopback_node
from fdam_ray.executors.ray.executor import RayExecutor
from fdam_ray.executors.ray.transports import transport_for
from fdam_ray.executors.transfer import Downlink
from fdam_ray.settings.sections import ConfigError

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


def start_executor(nodes: int, clients_per_node: int, state_floats: int, source=None, batch_size="full"):
    """A started Ray executor over ``nodes`` x ``clients_per_node`` clients (client c pinned to node c //
    clients_per_node; ``source``: theirs, default a :class:`WideSource` of ``state_floats``; batches of
    ``batch_size``), its algorithm, the
    initial state, and what a transport's ``started`` hook takes (:func:`use_transport`)."""
    k = nodes * clients_per_node
    config = build_config(dict(
        dataset="arrays", num_clients=k, model="linear", algorithm="coda_plus", batch_size=batch_size, local_steps=1,
        lr=0.01, executor="ray", eval_on="driver", cpus_per_actor=1.0, threads_per_actor=1,
        client_resources=[{f"site_{c // clients_per_node}": 0.01} for c in range(k)], reduce="star"))
    source = WideSource(k, state_floats - 3) if source is None else source
    executor = RayExecutor()
    setup = ExecutorSetup.for_config(config, executor.section)
    infos = executor.start(setup, source)
    state = Replica(config, source, device=torch.device("cpu")).flat.initial_state()
    executor.configure(np.array([0.5]))
    executor.begin_stage(state.v, True)
    return executor, build_algorithm(AlgorithmSection.of(config)), state, (setup.algorithm, infos)


def refusal(combo: tuple) -> str:
    """The config's one-line refusal of ``combo`` ((transport, reduce, transfer_precision, round_deadline)), or
    '' where the config takes it: what a run with these settings would be told."""
    transport, reduce, precision, deadline = combo
    plain, feedback = precision_of(precision)
    try:
        build_config(dict(executor="ray", transport=transport, reduce=reduce, transfer_precision=plain,
                          error_feedback=feedback, round_deadline=deadline))
    except (ConfigError, ValueError) as exc:
        return str(exc).splitlines()[0]
    return ""


def precision_of(precision: str) -> tuple[str, bool]:
    """A block's precision, ``fp32``, ``bf16`` or ``bf16_ef`` (bf16 with error feedback), as the config's
    (transfer_precision, error_feedback)."""
    plain, _, feedback = precision.partition("_")
    return plain, feedback == "ef"


def use_transport(executor: RayExecutor, block: tuple, kept: dict, started: tuple) -> None:
    """Switch the started executor to ``block``: (transport, reduce, transfer_precision, round_deadline). The
    transport is kept in ``kept`` by its (transport, reduce) pair, so the node transports keep their reducer
    actors and the collective one its group from block to block (a compiled graph left behind is ended, its
    actors then free for the next graph; the executor closes the last one at shutdown); so is each precision's
    downlink, whose master the actors keep from block to block. A transport that rounds its own transfers (the
    collective's ``transfer``: its nodes' leaders send each other 16-bit differences) is given the precision
    instead (its group built again when that changes), and the driver sends it float32 states. ``started``:
    what a new transport's ``started`` hook takes (the algorithm and the clients' infos, from
    :func:`start_executor`)."""
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
        kept[name].started(*started)
    executor.transport = kept[name]
    if hasattr(executor.transport, "transfer"):  # the collective: its members round what crosses between nodes
        if executor.transport.transfer != precision_of(precision):  # set when its group is built: build it again
            executor.transport.transfer = precision_of(precision)
            executor.transport._forget()
        precision = "fp32"
    if precision != "fp32" and precision not in kept:
        plain, feedback = precision_of(precision)
        kept[precision] = Downlink(plain, error_feedback=feedback)
    executor.downlink = kept.get(precision) if precision != "fp32" else None
    executor.deadline = (None if deadline is None
                         else Deadline.of(build_config(dict(executor="ray", round_deadline=deadline))))
    # a transport that keeps the deadline in its runs of rounds (the collective's members) is told it, as at start
    if hasattr(executor.transport, "deadline"):
        executor.transport.deadline = None
    executor._deadline_in_runs = executor.deadline is not None and executor.transport.takes_deadline(executor.deadline)


def plan_after(state, ahead: int = 0, steps: int = 1) -> RoundPlan:
    """The plan of the round ``ahead`` rounds after the one that follows ``state`` (``steps`` local steps each)."""
    return RoundPlan(round=state.round + 1 + ahead, stage=1, steps=steps, lr=0.01,
                     iteration=state.iteration + ahead * steps)


def run_of_rounds(executor, state, count: int, steps: int = 1):
    """``count`` rounds in one run (``transport: collective``: one call per actor for all of them); the state
    after them, as the actors computed it. The run ends as a federation's run of rounds ends between evaluations
    (``read=False``): the state stays with the members, as nothing reads it."""
    out = executor.run_rounds(state, [(plan_after(state, i, steps), None) for i in range(count)], False, read=False)
    if out.applied != count or out.state is None:
        raise RuntimeError(f"a run of {count} rounds applied {out.applied} (stop: {out.stop or 'none'})")
    return out.state


def one_round(executor, algorithm, state) -> tuple[object, list[int]]:
    """One round through ``executor.run_round``, folded at the driver; the new state and the bytes of each sum
    the driver folded (a rounded sum counted as it travelled)."""
    reducer = algorithm.reducer(state)
    received: list[int] = []

    def fold(part) -> None:
        received.append(part.bytes_up if executor.downlink is not None else sum(
            a.nbytes for a in (part.v, part.alpha, part.buffers, part.counters, part.c_v, part.c_alpha)
            if a is not None))
        reducer.fold(part)

    executor.run_round(state, plan_after(state), fold)
    return reducer.finish(steps=1), received


@dataclasses.dataclass
class Block:
    """One block's figures: the median round ms, the driver's ingress per round (bytes of the sums it folded;
    nan in runs of rounds), the sums folded in its last round, rounds per call, and MB into each node's link per
    round from the shaping's counters (None unshaped)."""

    ms: float
    ingress: float
    objects: int
    per_call: int
    node_mb: dict[str, float] | None = None

    def __getitem__(self, i: int):  # (ms, ingress, objects): read by index where a block was a tuple
        return (self.ms, self.ingress, self.objects)[i]


def rounds(executor, algorithm, state, count: int, warmup: int = 1,
           counters: Callable[[], dict[str, int]] | None = None, steps: int = 1) -> tuple[object, Block]:
    """``count`` timed rounds (after ``warmup``, which also builds a compiled graph or a collective group) with
    the executor's transport; in runs of up to ``executor.rounds_ahead()`` rounds where it takes more than one
    (each run's time split evenly over its rounds). Returns (state, :class:`Block`); ``counters``: bytes into
    each node's link so far (netlab's shaping); ``steps``: local steps a round (runs of rounds only)."""
    ahead = executor.rounds_ahead()
    if steps != 1 and ahead == 1:
        raise ValueError("rounds: more than one local step a round needs a transport that runs rounds ahead")
    walls: list[float] = []
    ingress: list[int] = []
    received: list[int] = []
    if ahead > 1:
        state = run_of_rounds(executor, state, warmup, steps)
    else:
        for _ in range(warmup):
            state, _ = one_round(executor, algorithm, state)
    before = counters() if counters is not None else None
    done = 0
    while done < count:
        n = min(ahead, count - done)
        t0 = time.perf_counter()
        if ahead > 1:
            state = run_of_rounds(executor, state, n, steps)
        else:
            state, received = one_round(executor, algorithm, state)
            ingress.append(sum(received))
        walls.extend([(time.perf_counter() - t0) / n] * n)
        done += n
    node_mb = None
    if before is not None and counters is not None:
        after = counters()
        node_mb = {ip: (after[ip] - before.get(ip, 0)) / count / 1e6 for ip in after}
    return state, Block(ms=1e3 * statistics.median(walls),
                        ingress=statistics.median(ingress) if ingress else float("nan"),
                        objects=len(received) if ahead == 1 else 1, per_call=min(ahead, count), node_mb=node_mb)


def blocks(executor, algorithm, state, count: int | Callable[[tuple], int], repeats: int, combos=BLOCKS,
           kept: dict | None = None, warmup: int = 1, *, started: tuple,
           counters: Callable[[], dict[str, int]] | None = None) -> tuple[object, dict]:
    """``repeats`` alternating blocks of ``count`` rounds (or ``count(combo)``) for each of ``combos`` (see
    :func:`use_transport`); (state, combo -> [:class:`Block` per block]).

    The compiled ``reduce: node`` blocks come last, one after another: a compiled graph stays up while classic
    blocks run, and only the node graph costs much to end (see CompiledRounds.teardown), so each graph is built
    once per call, as in a run."""
    got: dict = {combo: [] for combo in combos}
    transports: dict = {} if kept is None else kept
    last = [c for c in combos if c[:2] == ("compiled", "node")]
    order = [c for _ in range(repeats) for c in combos if c not in last] + [c for c in last for _ in range(repeats)]
    for combo in order:
        use_transport(executor, combo, transports, started)
        n = count(combo) if callable(count) else count
        state, block = rounds(executor, algorithm, state, n, warmup, counters)
        got[combo].append(block)
        pressure = store_pressure()
        if pressure is not None:  # the run's worst, for the results file
            STORE_PRESSURE["spilled_mib"] = max(STORE_PRESSURE.get("spilled_mib", 0.0), pressure[0])
            STORE_PRESSURE["fallback_mib"] = max(STORE_PRESSURE.get("fallback_mib", 0.0), pressure[1])
        print(f"  block {label(combo)}: {block.ms:.0f} ms a round over {n} rounds"
              + (f" ({block.per_call} a call)" if block.per_call > 1 else f", {block.objects} sums folded")
              + f" ({meminfo_gib():.1f} GiB of memory free"
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
    plain, feedback = precision_of(precision)
    return (f"transport={transport} reduce={reduce}"
            + ("" if precision == "fp32" else f" {plain}" + (" error_feedback" if feedback else ""))
            + ("" if deadline is None else f" round_deadline={deadline}"))



def actors_per_node(executor: RayExecutor) -> list[int]:
    by_node: dict = {}
    for info in executor.where_of.values():
        by_node[info.get("node_id")] = by_node.get(info.get("node_id"), 0) + 1
    return sorted(by_node.values())



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



def store_line(args: argparse.Namespace) -> str:
    """What the results file says of the object stores: their size and whether any round went to disk."""
    size = store_bytes_for(args.nodes[-1], args.clients_per_node, args.state_floats) / 2**20
    if not STORE_PRESSURE:
        return f"Object store: {size:,.0f} MiB per node."
    return (f"Object store: {size:,.0f} MiB per node; over the run {STORE_PRESSURE['spilled_mib']:,.0f} MiB were "
            f"spilled to disk and at most {STORE_PRESSURE['fallback_mib']:,.0f} MiB sat in fallback files "
            "(objects a full store puts on disk).")


