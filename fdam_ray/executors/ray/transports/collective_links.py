"""Slow links inside ``transport: collective`` across nodes (backend ``hier``, with ``round_deadline``): a node
whose link is slow sits out of the leaders' exchange while it stays slow, instead of every node waiting for it.

What is measured. In each round's reduce-scatter every active leader times the arrival of each other active
leader's chunk (:class:`~.hierarchy.Leaders`: the exchange starts right after the round's flags all-reduce, so
the leaders start together): ``rates[i, j]`` is the bytes a second at which node i received node j's chunk.
The next round's flags all-reduce (:func:`~.collective_deadline.agree`) carries every leader's row, so every
member reads the same matrix and takes the same decisions:

- **a slow link** (:func:`slow_nodes`): node n's link is slow when the median rate at which it received the
  others' chunks, or at which the others received its chunk, is more than ``factor`` times below the median
  rate of the pairs without it (``factor``: a factor deadline's, else :data:`LINK_FACTOR`). It needs three
  active nodes (with two, no pair is without either). A node found slow is left out from that round on, as
  long as the clients that made the round without it are at least ``min_clients``: its members' local steps of
  that round are put back (they ran, but their sums would cross the slow link) and it contributes nothing;
- **a node out** holds the state of the last round it took part in (its members are *behind*): in the rounds
  after, its members run no local steps and its clients count as not taking part (they follow the drift rule of
  s.3b, as a deadline's late clients do); the other nodes' leaders exchange among themselves, in node order
  (the sums of the nodes left out would be zeros: the result is the one the full exchange would give);
- **a probe** (:func:`probe_fast`): every :data:`PROBE_EVERY` rounds, once its exchange is done, the lowest
  active leader sends :data:`PROBE_BYTES` (after a header) to each node out and to the second active node, the
  control, whose leaders time it from the header's arrival. The link is fast again when its probe took at most
  ``factor`` times the control's plus :data:`PROBE_SLACK_S` (like for like: one message size, one sender, the
  control's link quiet). The members of that node then say so in their run's share, and the driver sends them the state
  with the next run of rounds (the only state that crosses their link): they rejoin in its first round. A
  node out also rejoins whenever the driver sends every member the state (a new group, a stage's new state).

The driver reads the state after a run from the lowest rank of a node that took part in its last round. Off:
with ``reference_point: average`` (each member sums its slice of every round's v, which a member behind does
not hold) and with ``error_feedback`` on 16-bit exchanges (a node's residual would wait in it while the node is
out, and a replay would send it): there every node takes part in every exchange.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)

LINK_FACTOR = 2.0  # a link this many times slower than the others' is slow (or a factor deadline's, if larger)
LINK_SLACK_S = 0.25  # and its chunk at least this much later than at the others' rate (not a hiccup of the
# scheduler on busy cores, and a delay worth a node's clients)
PROBE_BYTES = 4 << 20  # a probe of a node's link: 4 MiB (0.34 s at 100 Mbit/s, 34 ms at 1 Gbit/s)
PROBE_EVERY = 4  # rounds between probes of the nodes out (rounds whose index is a multiple of it)
PROBE_SLACK_S = 0.1  # a probe is slow once past the factor times the control's plus this


@dataclasses.dataclass(frozen=True)
class Links:
    """A round's leaders' exchange: the nodes in it (``active``, node order), those out of it, and the bytes of
    this round's probe of each node out and of the control, the second active node (0: no probe)."""

    active: tuple[int, ...]
    out: tuple[int, ...] = ()
    probe: int = 0

    @classmethod
    def of(cls, nodes: int, out: Sequence[int], round_index: int) -> Links:
        active = tuple(n for n in range(nodes) if n not in out)
        probe = PROBE_BYTES if out and len(active) >= 2 and round_index % PROBE_EVERY == 0 else 0
        return cls(active, tuple(sorted(out)), probe)


def link_factor(deadline_factor: float | None) -> float:
    """The factor a link is measured against: :data:`LINK_FACTOR`, or a factor deadline's where larger."""
    return max(deadline_factor or LINK_FACTOR, LINK_FACTOR)


def _median(values: Sequence[float]) -> float:
    """The lower median of the finite, positive ``values`` (NaN when there are none)."""
    kept = sorted(v for v in values if np.isfinite(v) and v > 0)
    return kept[(len(kept) + 1) // 2 - 1] if kept else float("nan")


def slow_nodes(rates: np.ndarray, active: Sequence[int], factor: float, nbytes: float) -> list[int]:
    """The nodes of ``active`` whose link is slow, slowest first: the median of what node n received
    (``rates[n, j]``) or of what the others received from it (``rates[i, n]``) below the median rate of the pairs
    without n over ``factor``, and its chunk of ``nbytes`` at least :data:`LINK_SLACK_S` later than at that rate
    (on a small state a scheduling hiccup can halve a rate without costing the round much). Pairs not measured (NaN) are
    skipped; a node with no pair measured is not slow."""
    found: list[tuple[float, int]] = []
    if len(active) < 3:
        return []
    for n in active:
        others = [i for i in active if i != n]
        reference = _median([rates[i, j] for i in others for j in others if i != j])
        received, sent = _median([rates[n, j] for j in others]), _median([rates[i, n] for i in others])
        worst = min((r for r in (received, sent) if np.isfinite(r)), default=float("nan"))
        if np.isfinite(reference) and np.isfinite(worst) and worst * factor < reference \
                and nbytes / worst - nbytes / reference >= LINK_SLACK_S:
            found.append((worst / reference, n))
    return [n for _, n in sorted(found)]


def probe_fast(probe_s: float, control_s: float, factor: float) -> bool:
    """Whether a node out whose probe took ``probe_s`` seconds has a fast link again: at most ``factor`` times the
    same probe's time to the control node (an active one, after its exchange) plus :data:`PROBE_SLACK_S` (a
    hiccup makes a probe slower, never faster: it keeps a node out longer, it does not bring a slow one back)."""
    return bool(np.isfinite(probe_s) and np.isfinite(control_s) and probe_s <= factor * control_s + PROBE_SLACK_S)


def note_sitting(before: set[int], now: set[int], sent: set[int], hosted: dict[int, list[int]],
                 rounds: Sequence[int]) -> None:
    """train.log, after a run of ``rounds``: the actors whose node began to sit out for its link in it (``now``
    but not ``before``), and those sent the state to rejoin with it (``before`` and ``sent``)."""
    def named(actors: set[int]) -> str:
        clients = sorted(k for a in actors for k in hosted.get(a, ()))
        return f"actors {', '.join(map(str, sorted(actors)))} (clients {', '.join(map(str, clients))})"

    if now - before:
        log.warning("%s sit out of the exchange between nodes from a round of rounds %d-%d on: their node's link "
                    "is slow; their clients do not take part until a probe finds it fast", named(now - before),
                    rounds[0], rounds[-1])
    if before & sent:
        log.info("%s rejoin the exchange between nodes in round %d (a probe found their link fast)",
                 named(before & sent), rounds[0])
