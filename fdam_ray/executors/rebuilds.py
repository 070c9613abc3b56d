"""Rebuilt clients in a run's record, and their replay.

A client is *rebuilt* when it loses its own state mid-run and starts again
from its shard: its Ray actor was replaced (``on_client_failure: retry`` or
``drop`` with an actor's other clients going on), or its Flower site lost or
damaged its state file. A rebuilt client is a fresh client (a fresh sampler,
zero optimiser buffers) whose c^k becomes the global c of the first round it
runs (docs/algorithms.md s.3b, :meth:`~fdam_ray.algorithms.drift.DriftCorrection.replaced`).
What it did before is gone, so a run with one is not the run without the
fault; it is the run that rebuilds that client at that round.

The loop records, for each round, the clients whose update it folded as a
rebuilt client's first (:meth:`~fdam_ray.executors.base.Executor.take_rebuilt`),
in the checkpoint's ``rebuilt`` (round -> clients) beside the participating
sets (:mod:`fdam_ray.executors.deadlines`). A replay (``participation_record``)
rebuilds each recorded client before its round
(:meth:`~fdam_ray.executors.base.Executor.rebuild`: a fresh client, c^k = the
round's global c), so a run with rebuilt clients equals its replay. The
inline executor replays them; an executor that cannot rebuild a client at a
given round refuses such a record before the run starts. Not replayed: the
16-bit transfers' upload residual of a replaced actor (it starts empty on the
new actor; the replay keeps the host's), so with ``transfer_precision``
bf16/fp16 and error feedback a replay of a rebuilt client is near, not equal.
"""

from __future__ import annotations

from typing import Any

from fdam_ray.core.schedules import ScheduleSection
from fdam_ray.executors.base import Executor
from fdam_ray.executors.deadlines import ReplaySection, check_record, parse_record, record_checkpoint
from fdam_ray.settings.redact import short


def read_replay(where: str, run: ReplaySection,
                schedule: ScheduleSection) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """The participating sets and the rebuilt clients (each round -> sorted clients) of a run folder or its
    checkpoint file, checked against the run that replays them (:func:`~fdam_ray.executors.deadlines.check_record`;
    a rebuilt client must be one of this run's clients and its round one the recorded run finished). One line
    when there is nothing to read or it cannot be replayed."""
    checkpoint = record_checkpoint(where)
    reached = checkpoint.loop.state.round
    rebuilt = parse_record(checkpoint.loop.rebuilt, where)
    for r, clients in sorted(rebuilt.items()):
        _check_rebuilt(r, clients, int(run.num_clients), reached, where)
    record = parse_record(checkpoint.loop.participation, where)
    recorded: Any = checkpoint.config if isinstance(checkpoint.config, dict) else {}
    check_record(record, run, schedule, where=where, recorded=recorded, reached=reached, rebuilds=bool(rebuilt))
    return record, rebuilt


def _check_rebuilt(r: int, clients: list[int], k: int, reached: int, where: str) -> None:
    """A recorded rebuild: a round the recorded run finished, clients within 0..K-1."""
    why = None
    if r > reached:
        why = f"rebuilt clients of round {r}, past round {reached}, the last the recorded run finished"
    elif any(not 0 <= c < k for c in clients):
        why = (f"round {r} rebuilds client {next(c for c in clients if not 0 <= c < k)}, outside 0..{k - 1} "
               f"(num_clients = {k})")
    if why is not None:
        raise ValueError(f"config field 'participation_record': {short(where)} cannot be replayed: {why} (the "
                         "record is damaged or of another run)")


def refuse_unreplayable(rebuilt: dict[int, list[int]], executor: Executor) -> None:
    """One line before the run when ``rebuilt`` names a client and ``executor`` cannot rebuild one at a round."""
    if rebuilt and not executor.rebuilds_clients:
        r, ks = min(rebuilt.items())
        raise ValueError(f"config field 'participation_record': the record rebuilds client{'s' if len(ks) > 1 else ''} "
                         f"{', '.join(map(str, ks))} at round {r} (its actor replaced or its site's state lost), "
                         f"which {type(executor).__name__} cannot replay: replay it with executor=inline")
