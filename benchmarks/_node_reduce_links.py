"""``node_reduce.py --netlab DIR --precision-rates R1 R2 ...``: round time against link speed for every transport.

On netlab's shaped cluster, one executor runs ``reduce: star`` and ``reduce: node`` (classic transport) and
``transport: collective``, each with float32 transfers and with ``transfer_precision: bf16`` plus
``error_feedback``, in alternating blocks, unshaped and then with every node's ingress at each rate. Each
transport and precision is fitted to round ms = a + b x (x = ns a bit takes on each node's link;
:mod:`_netlab_fit`), and the collective's b is set against the ring all-reduce's bound computed from the sizes.
Then one node at ``--slow-rate`` among the others at ``--rate``, with no deadline and with ``round_deadline``
``--deadline``, per transport (float32): the round, and the x at which the all-nodes line gives that round.

Last, one node's local steps slowed by a benchmark-only pace, the collective with and without a deadline
(:mod:`_node_reduce_compute`). A setting the config refuses is reported as refused with the config's line.
Blocks are sized in time (``--block-seconds``): a block runs as many rounds as fit, from the setting's last
measured round, between 2 and ``--rounds``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from pathlib import Path

import _common as C
import _node_reduce_compute as compute
from _netlab_fit import LineFit, fit_line, ns_per_bit, ring_bound_ms, state_ms
from _node_reduce_core import (
    _warmups,
    actors_per_node,
    blocks,
    end_graphs,
    meminfo_gib,
    rate_key,
    refusal,
    start_executor,
    store_bytes_for,
    store_line,
)

# (name, transport, reduce) of the transports compared, and the precisions each runs
TRANSPORTS = (("star", "classic", "star"), ("node", "classic", "node"), ("collective", "collective", "star"))
PRECISIONS = {"fp32": "fp32", "bf16": "bf16_ef"}  # name -> the block's precision (bf16 with error feedback)
UNSHAPED_X = 0.25  # the x a block's round time is scaled from when sizing the next, slower link's block


def combo_of(name: str, precision: str, deadline: str | None = None) -> tuple:
    transport, reduce = next((t, r) for n, t, r in TRANSPORTS if n == name)
    return (transport, reduce, PRECISIONS[precision], deadline)


def sweep_combos(names: list[str] | None = None) -> list[tuple]:
    return [combo_of(name, p) for name, _, _ in TRANSPORTS for p in PRECISIONS if names is None or name in names]


class Sizer:
    """Rounds per block: as many as ``block_s`` holds at the setting's last measured round time (scaled by the
    ratio of x when that was on a faster link), between 2 and ``most``."""

    def __init__(self, block_s: float, most: int) -> None:
        self.block_s, self.most = block_s, most
        self.seen: dict[tuple, tuple[float, float]] = {}  # combo -> (x, ms) of its last block
        self.x = 0.0

    def __call__(self, combo: tuple) -> int:
        if combo not in self.seen:
            return self.most
        x, ms = self.seen[combo]
        estimate = ms * max(1.0, max(self.x, UNSHAPED_X) / max(x, UNSHAPED_X))
        return max(2, min(self.most, int(self.block_s * 1e3 / estimate)))

    def saw(self, got: dict) -> None:
        for combo, measured in got.items():
            if measured:
                self.seen[combo] = (self.x, measured[-1].ms)


def row(measured: list) -> dict:
    """A setting's blocks as one row: median of the blocks' medians, lo, hi, rounds a call, MB into each node
    per round (the median block's counters)."""
    times = [b.ms for b in measured]
    mid = sorted(measured, key=lambda b: b.ms)[len(measured) // 2]
    return {"ms": statistics.median(times), "lo": min(times), "hi": max(times), "per_call": mid.per_call,
            "node_mb": mid.node_mb}


def measure(netcluster, args: argparse.Namespace) -> dict:
    """The sweep and the slow node, on one netlab cluster with one executor (see the module's docstring)."""
    nodes, per_node = args.nodes[-1], args.clients_per_node
    combos = sweep_combos(args.transports)
    refused = {c: why for c in combos if (why := refusal(c))}
    runnable = [c for c in combos if c not in refused]
    sizer = Sizer(args.block_seconds, args.rounds)
    started_at = time.monotonic()
    out: dict = {"links": {}, "refused": refused, "x": {}}
    with netcluster.net_cluster(workers=nodes, cpus_per_worker=per_node, rate=None,
                                object_store_bytes=store_bytes_for(nodes, per_node, args.state_floats)) as nc:
        executor, algorithm, state, started = start_executor(nodes, per_node, args.state_floats)
        kept: dict = {}
        try:
            for link in ["unshaped", *args.precision_rates]:
                sizer.x = 0.0 if link == "unshaped" else ns_per_bit(netcluster.parse_rate(link))
                print(f"{link} (x = {sizer.x:g} ns a bit), {time.monotonic() - started_at:.0f} s into the run",
                      file=sys.stderr, flush=True)
                with contextlib.ExitStack() as stack:
                    counters = None
                    if link != "unshaped":
                        shaping = stack.enter_context(netcluster.Shaping(nc.ips, link))
                        counters = _bytes_counter(shaping)
                    state, got = blocks(executor, algorithm, state, sizer, args.repeats, runnable, kept, args.warmup,
                                        started=started, counters=counters)
                sizer.saw(got)
                out["links"][link] = {c: row(m) for c, m in got.items()}
                out["x"][link] = sizer.x
            state, out["straggler"] = _straggler(netcluster, nc, args, executor, algorithm, state, kept, started,
                                                 sizer)
            out["placed"] = actors_per_node(executor)
        finally:
            end_graphs(executor, kept)
            executor.shutdown()
        if args.compute_steps and (args.transports is None or "collective" in args.transports):
            print(f"one node's compute slow, {time.monotonic() - started_at:.0f} s into the run", file=sys.stderr,
                  flush=True)
            out["slowcompute"] = compute.measure(netcluster, nc, args)
    out["wall_s"] = time.monotonic() - started_at
    return out


def _bytes_counter(shaping):
    def counters() -> dict[str, int]:
        return {ip: c["bytes"] for ip, c in shaping.counters().items()}
    return counters


def _straggler(netcluster, nc, args, executor, algorithm, state, kept: dict, started: tuple, sizer: Sizer):
    """The last worker node at ``--slow-rate``, the others at ``--rate``: every transport (fp32) without and
    with ``round_deadline``; (state, {"slow_node", "rows", "refused"})."""
    combos = [combo_of(name, "fp32", d) for name, _, _ in TRANSPORTS for d in (None, args.deadline)
              if args.transports is None or name in args.transports]
    refused = {c: why for c in combos if (why := refusal(c))}
    slow = nc.ips[-1]
    sizer.x = ns_per_bit(netcluster.parse_rate(args.slow_rate))
    print(f"{slow} at {args.slow_rate}, the others at {args.rate}", file=sys.stderr, flush=True)
    with netcluster.Shaping(nc.ips, args.rate, node_rates={slow: args.slow_rate}) as shaping:
        state, got = blocks(executor, algorithm, state, sizer, args.repeats, [c for c in combos if c not in refused],
                            kept, args.warmup, started=started, counters=_bytes_counter(shaping))
    return state, {"slow_node": slow, "rows": {c: row(m) for c, m in got.items()}, "refused": refused,
                   "x_rate": ns_per_bit(netcluster.parse_rate(args.rate)), "x_slow": sizer.x}


# -- figures -----------------------------------------------------------------------------------------------
def fits(results: dict, rates: list[str]) -> dict[tuple[str, str], LineFit]:
    """(transport name, precision) -> its line over the shaped links (where it ran at two or more)."""
    out = {}
    for name, _, _ in TRANSPORTS:
        for p in PRECISIONS:
            combo = combo_of(name, p)
            points = [(results["x"][r], results["links"][r][combo]["ms"]) for r in rates
                      if combo in results["links"][r]]
            if len({x for x, _ in points}) >= 2:
                out[name, p] = fit_line(points)
    return out


def values(args: argparse.Namespace, results: dict) -> dict:
    """The RESULT line's figures (nan where a setting was refused or not fitted)."""
    lines = fits(results, args.precision_rates)
    nan = float("nan")
    ring = ring_bound_ms(args.state_floats, args.nodes[-1])
    out: dict = {f"b_{n}_{p}": lines[n, p].b if (n, p) in lines else nan for n, _, _ in TRANSPORTS for p in PRECISIONS}
    out["b_ring_fp32"] = ring
    out["a_collective_fp32"] = lines["collective", "fp32"].a if ("collective", "fp32") in lines else nan
    key = rate_key(args.rate)
    at = results["links"].get(args.rate, {})
    coll, node = at.get(combo_of("collective", "fp32")), at.get(combo_of("node", "fp32"))
    out[f"round_ratio_collective_node_{key}"] = coll["ms"] / node["ms"] if coll and node else nan
    bound = (out["a_collective_fp32"] + ring * results["x"][args.rate]) if args.rate in results["x"] else nan
    out[f"round_ratio_collective_ring_{key}"] = coll["ms"] / bound if coll and not math.isnan(bound) else nan
    for (n, p), line in lines.items():
        out[f"resid_max_{n}_{p}"] = line.max_residual
    for combo, r in results.get("straggler", {}).get("rows", {}).items():
        name = next(n for n, t, red in TRANSPORTS if (t, red) == combo[:2])
        if (name, "fp32") in lines:
            out[f"straggler_x_{name}_{'none' if combo[3] is None else 'deadline'}"] = lines[name, "fp32"].x_at(r["ms"])
    late = results.get("straggler", {}).get("rows", {}).get(combo_of("collective", "fp32", args.deadline))
    out["straggler_round_ratio_collective"] = late["ms"] / coll["ms"] if late and coll else nan
    out["slowcompute_round_ratio_collective"] = compute.ratio(results)
    return out


def residual_lines(args: argparse.Namespace, results: dict) -> list[str]:
    """One line per fit: a, b and the residual at each rate (printed, and in the results file)."""
    return [f"fit {n} {p}: a = {f.a:.0f} ms, b = {f.b:.1f} ms per ns a bit; residuals "
            + ", ".join(f"{r} {res:+.0f} ms" for r, res in zip(args.precision_rates, f.residuals, strict=False))
            for (n, p), f in fits(results, args.precision_rates).items()]


def _cell(results: dict, link: str, combo: tuple) -> str:
    if combo in results["refused"]:
        return "refused"
    r = results["links"][link].get(combo)
    if r is None:
        return "-"
    call = f", {r['per_call']} a call" if r["per_call"] > 1 else ""
    return f"{r['ms']:.0f} ({r['lo']:.0f}..{r['hi']:.0f}{call})"


def body(args: argparse.Namespace, results: dict, netcluster, png: Path | None) -> str:
    """The results file's block."""
    rates = list(args.precision_rates)
    combos = sweep_combos()
    names = [f"{n} {p}" for n, _, _ in TRANSPORTS for p in PRECISIONS]
    rows = [[link, *(_cell(results, link, c) for c in combos)] for link in ["unshaped", *rates]]
    ring, one = ring_bound_ms(args.state_floats, args.nodes[-1]), state_ms(args.state_floats)
    lines = fits(results, rates)
    fit_rows = []
    for (n, p), f in lines.items():
        fit_rows.append([n, p, f"{f.a:.0f}", f"{f.b:.0f}", f"{f.b / ring:.2f}",
                         ", ".join(f"{res:+.0f}" for res in f.residuals)])
    refused = "".join(f"\n- {c[0]} {c[1]} {c[2]}: refused ({why})" for c, why in results["refused"].items())
    wall = f"{results['wall_s'] / 60:.1f} min" if "wall_s" in results else "-"
    text = f"""
netlab cluster ({args.netlab}): a head without CPUs and {args.nodes[-1]} worker nodes, each at its own loopback \
address, x {args.clients_per_node} client actors pinned per node (actors per node \
{", ".join(map(str, results["placed"]))}), state of N = {args.state_floats:,} floats \
({args.state_floats * 4 / 2**20:.1f} MiB), one trivial local step on one sample per round (CODA+, a linear \
scorer). One executor runs, in alternating blocks, `transport: classic` with `reduce: star` and with `reduce: \
node`, and `transport: collective` (as a run runs it: its rounds in runs of `collective_rounds` where it takes \
rounds ahead, "N a call"), each with fp32 transfers and with `transfer_precision: bf16` + `error_feedback`; \
unshaped, then with every node's ingress at each rate. Per link {args.repeats} blocks of each, each of \
{_warmups(args)} and as many timed rounds as {args.block_seconds:g} s hold (2 to {args.rounds}); round time = \
median over the blocks of each block's median (lo..hi over the blocks). Machine: {os.cpu_count()} CPU cores and \
{meminfo_gib('MemTotal'):.0f} GiB of memory shared by every node. {store_line(args)} Wall time {wall}.{refused}

**Round ms** by each node's link:

{C.table(["per-node link", *(f"{n} ms" for n in names)], rows)}

**Line fit** over the shaped links, round ms = a + b x (x = ns a bit takes on each node's link: 1 at 1gbit); \
b_ring = 2 (p - 1) / p x state bits = {ring:.0f} ms per ns a bit (p = {args.nodes[-1]} nodes, computed: the \
least a ring all-reduce moves into every node), one state = {one:.0f}; residuals = measured - fitted at \
{", ".join(rates)}:

{C.table(["transport", "precision", "a: ms that do not shrink with the link", "b: ms per ns a bit", "b / b_ring (fp32)",
          "residuals ms"], fit_rows)}

{_ingress_table(args, results, lines)}

{_straggler_text(args, results, lines)}

{compute.text(args, results)}
"""
    if png is not None:
        text += f"\n![round ms against ns a bit]({png.name})\n"
    return text


def _ingress_table(args: argparse.Namespace, results: dict, lines: dict) -> str:
    """MB into each node's link per round at ``--rate`` (the shaping's counters), 8 x the busiest (the b those
    bytes alone would give) beside the fitted b, and a warning where the collective's workers received less than
    half of what its all-reduce must move (its traffic then went around the shaping)."""
    at = results["links"].get(args.rate)
    if not at:
        return ""
    rows = []
    for combo, r in at.items():
        mb = r["node_mb"] or {}
        ips = sorted(mb, key=lambda ip: tuple(map(int, ip.split("."))))
        name, precision = _names(combo)
        fitted = lines.get((name, precision))
        rows.append([f"{name} {precision}", f"{mb.get(ips[0], 0.0):.1f}" if ips else "-",
                     " / ".join(f"{mb[ip]:.1f}" for ip in ips[1:]), f"{8 * max(mb.values(), default=0.0):.0f}",
                     "-" if fitted is None else f"{fitted.b:.0f}"])
    return (f"**Bytes on the links** at {args.rate} (tc's counters, MB into each node's link per timed round, head "
            "first; 8 x the busiest link's MB = the b those bytes alone would give, in ms per ns a bit):\n\n"
            + C.table(["setting", "head MB", "worker nodes MB", "8 x busiest MB", "fitted b"], rows)
            + "".join(f"\n\n{w}" for w in bypassed(args, results)))


def bypassed(args: argparse.Namespace, results: dict) -> list[str]:
    """A line for each collective setting whose worker nodes received, per round at ``--rate``, less than half of
    what a ring all-reduce must move into each (its traffic did not cross the shaped addresses, so its line
    measures the machine, not the links)."""
    out = []
    for combo, r in results["links"].get(args.rate, {}).items():
        name, precision = _names(combo)
        if name != "collective" or not r["node_mb"]:
            continue
        need = ring_bound_ms(args.state_floats, args.nodes[-1], 16 if precision == "bf16" else 32) / 8
        workers = sorted(r["node_mb"].items(), key=lambda kv: tuple(map(int, kv[0].split("."))))[1:]
        got = min((mb for _, mb in workers), default=0.0)
        if got < need / 2:
            out.append(f"Warning: collective {precision}: a worker node received {got:.1f} MB a round at {args.rate}, "
                       f"less than half the {need:.1f} MB an all-reduce must move into each: its traffic went around "
                       "the shaped node addresses, so its fit measures this machine, not the links.")
    return out


def _names(combo: tuple) -> tuple[str, str]:
    """(transport name, precision name) of a sweep's combo."""
    name = next(n for n, t, r in TRANSPORTS if (t, r) == combo[:2])
    return name, next(p for p, v in PRECISIONS.items() if v == combo[2])


def _straggler_text(args: argparse.Namespace, results: dict, lines: dict) -> str:
    st = results.get("straggler")
    if not st:
        return ""
    x_rate, x_slow = st["x_rate"], st["x_slow"]
    rows = []
    for name, transport, reduce in TRANSPORTS:
        for deadline in (None, args.deadline):
            combo = (transport, reduce, "fp32", deadline)
            setting = f"{name}, " + ("no deadline" if deadline is None else f"round_deadline={deadline}")
            if combo in st["refused"]:
                rows.append([setting, "refused", "", "", "", ""])
                continue
            if combo not in st["rows"]:  # not measured
                continue
            r, f = st["rows"][combo], lines.get((name, "fp32"))
            rows.append([setting, f"{r['ms']:.0f} ({r['lo']:.0f}..{r['hi']:.0f})",
                         *(("-",) * 4 if f is None else
                           (f"{f.a:.0f} + {f.b:.0f} x", f"{f.at(x_rate):.0f}", f"{f.at(x_slow):.0f}",
                            f"{f.x_at(r['ms']):.2f}"))])
    why = "".join(f"\n- {c[0]} {c[1]} round_deadline={c[3]}: refused ({w})" for c, w in st["refused"].items())
    return (f"**One slow node**: {st['slow_node']}'s ingress at {args.slow_rate} (x = {x_slow:g}), the other nodes' "
            f"at {args.rate} (x = {x_rate:g}), fp32. The fit of each transport (above) gives the round with every "
            f"node at {args.rate} and with every node at {args.slow_rate}; x_eff = (round - a) / b, the link every "
            f"node would need for the measured round (between {x_rate:g} and {x_slow:g}: how much of the slow link "
            f"the round feels).{why}\n\n"
            + C.table(["setting", "round ms", "fit a + b x", f"fit, all at {args.rate}",
                       f"fit, all at {args.slow_rate}", "x_eff"], rows))


def plot(path: Path, args: argparse.Namespace, results: dict) -> None:
    """Round ms against x: the measured points (unshaped at x = 0, hollow), each fitted line, and the collective's
    a with the ring bound's slope (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(args.precision_rates)
    lines = fits(results, rates)
    xmax = max(results["x"][r] for r in rates)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    colors = {"star": "tab:red", "node": "tab:blue", "collective": "tab:green"}
    for name, _, _ in TRANSPORTS:
        for p in PRECISIONS:
            combo = combo_of(name, p)
            style = "-" if p == "fp32" else "--"
            xs = [results["x"][r] for r in rates if combo in results["links"][r]]
            ys = [results["links"][r][combo]["ms"] for r in rates if combo in results["links"][r]]
            if not xs:
                continue
            ax.plot(xs, ys, "o" if p == "fp32" else "s", color=colors[name], label=f"{name} {p}")
            if combo in results["links"]["unshaped"]:
                ax.plot([0.0], [results["links"]["unshaped"][combo]["ms"]], "o" if p == "fp32" else "s",
                        mfc="none", color=colors[name])
            if (name, p) in lines:
                f = lines[name, p]
                ax.plot([0.0, xmax], [f.at(0.0), f.at(xmax)], style, color=colors[name], linewidth=1)
    if ("collective", "fp32") in lines:
        a, ring = lines["collective", "fp32"].a, ring_bound_ms(args.state_floats, args.nodes[-1])
        ax.plot([0.0, xmax], [a, a + ring * xmax], ":", color="black", linewidth=1,
                label="collective fp32 a + b_ring x (ring bound)")
    ax.set_xlabel("x = ns a bit takes on each node's link (1 at 1 Gbit/s); unshaped at 0, hollow")
    ax.set_ylabel("round ms")
    ax.set_title(f"{args.nodes[-1]} nodes x {args.clients_per_node} clients, {args.state_floats:,} floats", fontsize=10)
    C.save_figure(fig, ax, path)


def run(netcluster, args: argparse.Namespace, out: Path) -> tuple[str, dict]:
    """Measure, print the fits' residuals and draw the figure beside ``out``; the results file's block and the
    RESULT figures."""
    results = measure(netcluster, args)
    for line in residual_lines(args, results) + bypassed(args, results):
        print(line, flush=True)
    png = out.with_suffix(".png") if len(args.precision_rates) >= 2 else None
    if png is not None:
        plot(png, args, results)
    return body(args, results, netcluster, png), values(args, results)
