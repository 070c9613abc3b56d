"""What each transport of the Ray executor supports, declared once as plain data (no Ray is imported here).

A transport is named as the config names it, by its ``(transport, reduce)``
pair (``transport`` classic, compiled or collective; ``reduce`` star or node):
:data:`CAPABILITIES` and the registry are keyed by that pair, and every
transport class of :mod:`fdam_ray.executors.ray.transports` points at its
entry (``capabilities = CAPABILITIES["classic", "star"]``). Everything else that depends on what a transport supports
is derived from these entries, so adding a transport is one entry here:

- the config's checks and their one-line refusals: ``reduce`` (a pair no
  transport runs, :func:`refused_pairs`), ``round_deadline``
  (:func:`no_deadline`) and ``transfer_precision`` bf16/fp16
  (:func:`no_16bit`), checked before anything starts;
- the transports' registry (:func:`fdam_ray.executors.ray.transports.transport_for`);
- the transport table of docs/explanation/transports.md (:func:`markdown_table`, a test holds the page to it).

A transport supports a feature when its reason to refuse it is empty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

REDUCES = ("star", "node")  # the config's reduce values


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What one transport runs and supports.

    Attributes:
        transport: the config's ``transport`` it runs.
        reduce: the config's ``reduce`` it runs (``star``: the driver folds every actor's partial sum; ``node``:
            the actors of a node folded there first).
        travels: how a round travels, one line (the transport table).
        gpu: what GPUs change for it, one line (the transport table).
        no_deadline: why it refuses ``round_deadline`` ('' = it runs deadlines).
        no_16bit: why it refuses ``transfer_precision`` bf16/fp16 ('' = it runs them).
        no_node_reduce: why its ``transport`` has no ``reduce: node`` ('' = another entry runs it).
    """

    transport: str
    reduce: str
    travels: str
    gpu: str
    no_deadline: str = ""
    no_16bit: str = ""
    no_node_reduce: str = ""

    @property
    def serves(self) -> tuple[str, str]:
        """The config's ``(transport, reduce)`` pair this transport runs: its name."""
        return self.transport, self.reduce

    @property
    def label(self) -> str:
        """How messages name it: ``transport=classic reduce=star``."""
        return f"transport={self.transport} reduce={self.reduce}"


_HOST_MEMORY = "any gpus_per_actor; states and partial sums cross in host memory"
_COMPILED = dict(transport="compiled", gpu="any gpus_per_actor; the channels carry the numpy states and sums in "
                 "host shared memory", no_deadline="its graph returns every actor's output at once",
                 no_16bit="its graph's channels carry float32 states and sums")

CAPABILITIES: dict[tuple[str, str], Capabilities] = {c.serves: c for c in (
    Capabilities(transport="classic", reduce="star", gpu=_HOST_MEMORY,
                 travels="one Ray call per actor, the state through the object store; the driver folds every "
                 "actor's partial sum"),
    Capabilities(transport="classic", reduce="node", gpu=_HOST_MEMORY,
                 travels="one Ray call per actor; a reducer on each node folds its actors' partial sums, the "
                 "driver one per node"),
    Capabilities(reduce="star", travels="one Ray Compiled Graph per federation, run once a "
                 "round; the driver folds every actor's output", **_COMPILED),
    Capabilities(reduce="node", travels="the compiled graph; a reducer on each node folds "
                 "its actors' outputs inside the graph", **_COMPILED),
    Capabilities(transport="collective", reduce="star",
                 travels="the actors all-reduce their partial sums among themselves and apply the server step, "
                 "several rounds a call",
                 gpu="NCCL when every actor holds a GPU of its own; else shared memory on one node, and between "
                 "nodes shared memory in each node and gloo between one actor per node (16-bit with bf16/fp16)",
                 no_node_reduce="reduces the actors' partial sums among the actors themselves"),
)}


def transports() -> list[str]:
    """The config's transport values, in the registry's order."""
    return list(dict.fromkeys(c.transport for c in CAPABILITIES.values()))


def _running(transport: str) -> list[Capabilities]:
    return [c for c in CAPABILITIES.values() if c.transport == transport]


def _who(supports: Callable[[Capabilities], bool]) -> str:
    """``a or b``: the config's transports with an entry that ``supports`` (a predicate on an entry)."""
    return " or ".join(t for t in transports() if any(supports(c) for c in _running(t)))


def refused_pairs() -> dict[tuple[str, str], str]:
    """The config's ``(transport, reduce)`` pairs no transport runs, and why (one line each)."""
    out = {}
    for t in transports():
        served = {c.reduce for c in _running(t)}
        why = next((c.no_node_reduce for c in _running(t) if c.no_node_reduce), "")
        for r in REDUCES:
            if r not in served:
                needs = " or ".join(other for other in transports() if r in reduces(other))
                out[t, r] = f"transport={t} {why}; reduce={r} needs transport={needs}"
    return out


def reduces(transport: str) -> list[str]:
    """The ``reduce`` values some transport runs with ``transport``."""
    return [r for r in REDUCES if any(c.reduce == r for c in _running(transport))]


def no_deadline(transport: str) -> str:
    """Why ``transport`` refuses ``round_deadline`` and which transports run it ('' = it runs it)."""
    why = next((c.no_deadline for c in _running(transport) if c.no_deadline), "")
    return f"{why}; use transport={_who(lambda c: not c.no_deadline)}" if why else ""


def no_16bit(transport: str) -> str:
    """Where ``transfer_precision`` bf16/fp16 runs, when ``transport`` refuses it ('' = it runs them)."""
    if not any(c.no_16bit for c in _running(transport)):
        return ""
    return f"bf16/fp16 run with transport={_who(lambda c: not c.no_16bit)}"


def markdown_table() -> str:
    """The transport table of docs/explanation/transports.md: one row per (transport, reduce) pair, run or refused."""

    def cell(why: str) -> str:
        return f"no: {why}" if why else "yes"

    rows = ["| `transport` | `reduce` | a round | `round_deadline` | bf16/fp16 transfers | GPUs |",
            "|---|---|---|---|---|---|"]
    refused = refused_pairs()
    for t in transports():
        for r in REDUCES:
            c = next((c for c in _running(t) if c.reduce == r), None)
            if c is None:
                rows.append(f"| {t} | {r} | refused: {refused[t, r]} | | | |")
            else:
                rows.append(f"| {t} | {r} | {c.travels} | {cell(c.no_deadline)} | {cell(c.no_16bit)} | {c.gpu} |")
    return "\n".join(rows) + "\n"
