"""``node_reduce.py --netlab DIR --precision-rates ...``, last: one node's local steps 3x slower, the collective
with and without ``round_deadline``.

Slow compute is made here, not in the package: every client reads its one sample per local step through
:class:`PacedDataset`, which sleeps the pace the driver writes into a control file before each block (nothing
outside this phase: the sweep's executor reads its samples directly). A block runs ``--compute-steps`` local
steps a round at ``--compute-pace`` seconds a step on every node ("even"), or on every node but the last, whose
clients take ``--compute-factor`` times as long ("slow"); every node's link at ``--rate``. Four settings in
alternating blocks on one executor: even and slow, each without and with ``round_deadline`` ``--compute-deadline``
(a factor of the members' median step time of the previous round, or seconds). The deadline acts on step
lateness: each member cuts its own steps at it (fdam_ray/executors/ray/transports/collective_deadline.py), so
a block's rounds with a cut member also say which clients sat out.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common as C
import numpy as np
import torch
from _node_reduce_core import end_graphs, rounds, start_executor, use_transport
from round_overhead import WideSource

from fdam_ray.data import DatasetSplit, Shard

SETTINGS = (("even", None), ("even", "deadline"), ("slow", None), ("slow", "deadline"))


def read_pace(control: str, client: int) -> float:
    """Seconds client ``client`` sleeps per sample now: the control file holds ``base first_slow factor`` (clients
    from ``first_slow`` on take ``factor`` times ``base``), or nothing (no pace)."""
    try:
        words = Path(control).read_text().split()
    except OSError:
        return 0.0
    if len(words) != 3:
        return 0.0
    base, first_slow, factor = float(words[0]), int(words[1]), float(words[2])
    return base * (factor if client >= first_slow else 1.0)


class PacedDataset(torch.utils.data.Dataset):
    """One client's samples, each read after sleeping its current pace (:func:`read_pace`)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, client: int, control: str) -> None:
        self.x, self.y, self.client, self.control = x, y, client, control

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        pace = read_pace(self.control, self.client)
        if pace > 0:
            time.sleep(pace)
        return torch.from_numpy(self.x[i]), torch.from_numpy(self.y[i])


class PacedSource(WideSource):
    """:class:`WideSource`'s clients, read through :class:`PacedDataset` (no DataLoader process: the sleep is
    the step's)."""

    def __init__(self, num_clients: int, features: int, control: str) -> None:
        super().__init__(num_clients, features)
        self.control = control

    def client_shard(self, client_id: int) -> Shard:
        shard = super().client_shard(client_id)
        x, y = shard.train.x.numpy(), shard.train.y.numpy()
        return Shard(DatasetSplit(PacedDataset(x, y, client_id, self.control), y, num_workers=0))


def measure(netcluster, nc, args: argparse.Namespace) -> dict:
    """The four settings in ``args.repeats`` alternating blocks of ``args.rounds`` rounds (after one untimed
    run) on a new executor over the running netlab cluster ``nc``; {"rows": setting -> row, ...}."""
    nodes, per_node = args.nodes[-1], args.clients_per_node
    first_slow = (nodes - 1) * per_node  # the last worker node's clients (client c is pinned to node c // W)
    with tempfile.TemporaryDirectory(prefix="pace-") as folder:
        control = str(Path(folder) / "pace")
        Path(control).write_text("")
        source = PacedSource(nodes * per_node, args.state_floats - 3, control)
        executor, algorithm, state, started = start_executor(nodes, per_node, args.state_floats, source=source,
                                                             batch_size=1)  # its one sample: read from "disk"
        kept: dict = {}
        got: dict = {s: [] for s in SETTINGS}
        try:
            with netcluster.Shaping(nc.ips, args.rate):
                for _ in range(args.repeats):
                    for pace, deadline in SETTINGS:
                        factor = args.compute_factor if pace == "slow" else 1.0
                        Path(control).write_text(f"{args.compute_pace} {first_slow} {factor}")
                        use_transport(executor, ("collective", "star", "fp32",
                                                 args.compute_deadline if deadline else None), kept, started)
                        state, block = rounds(executor, algorithm, state, args.rounds, 1, steps=args.compute_steps)
                        got[pace, deadline].append(block.ms)
                        how = f"round_deadline={args.compute_deadline}" if deadline else "no deadline"
                        print(f"  slow compute, {pace} steps, {how}: {block.ms:.0f} ms a round", file=sys.stderr,
                              flush=True)
        finally:
            Path(control).write_text("")
            with contextlib.suppress(Exception):
                end_graphs(executor, kept)
            executor.shutdown()
    rows = {s: {"ms": statistics.median(v), "lo": min(v), "hi": max(v)} for s, v in got.items()}
    return {"rows": rows, "first_slow": first_slow}


def ratio(results: dict) -> float:
    """The slow node's round with the deadline over the even round without one (nan when not measured)."""
    rows = results.get("slowcompute", {}).get("rows")
    if not rows:
        return float("nan")
    return rows["slow", "deadline"]["ms"] / rows["even", None]["ms"]


def text(args: argparse.Namespace, results: dict) -> str:
    """The results file's paragraph and table."""
    sc = results.get("slowcompute")
    if not sc:
        return ""
    rows = sc["rows"]
    even = rows["even", None]["ms"]
    table = [[f"{pace} steps, " + (f"round_deadline={args.compute_deadline}" if d else "no deadline"),
              f"{r['ms']:.0f} ({r['lo']:.0f}..{r['hi']:.0f})", f"{r['ms'] / even:.2f}"]
             for (pace, d), r in rows.items()]
    return (f"**One node's compute slow** (`transport: collective`, fp32, every node's link at {args.rate}): "
            f"{args.compute_steps} local steps a round, each sleeping {args.compute_pace:g} s on every client "
            f"(\"even\"), or {args.compute_factor:g}x that on the last node's clients (clients {sc['first_slow']} "
            f"on, \"slow\"): a benchmark-only pace, read from a control file the driver writes before each block. "
            f"{args.repeats} alternating blocks of {args.rounds} rounds each (after one untimed run).\n\n"
            + C.table(["setting", "round ms", "/ even, no deadline"], table))
