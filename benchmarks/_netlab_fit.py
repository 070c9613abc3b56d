"""Round time against link speed: the line fit, its residuals, and the ring all-reduce's bound from the sizes.

A round on netlab's shaped cluster takes a + b x, x being the nanoseconds one bit takes on each node's link
(1 at 1 Gbit/s, 4 at 250 Mbit/s): a is what does not shrink with the link (the clients' steps, merges, folds,
the server step, all on the machine's shared cores), b the milliseconds per ns a bit, the bits that cross the
busiest link in a round, in millions. The fit is least squares over the shaped links; its residuals say how
well one line holds.

The bound: a ring all-reduce (reduce-scatter, then all-gather) of a state of S bits among p nodes sends and
receives 2 (p - 1) / p x S bits on each node's link, whatever the order of the ring, and no all-reduce among
p parties with one link each moves less into every node. Its b is therefore 2 (p - 1) / p x S / 1e6 ms per ns
a bit (336 for 7M float32 values among 4 nodes): a collective round cannot take less than a + b_ring x on the
same machine. Nothing here imports Ray: the arithmetic is checked without a cluster.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

FLOAT_BITS = 32


@dataclasses.dataclass(frozen=True)
class LineFit:
    """round ms = a + b x fitted to ``points`` (x, ms); ``residuals`` in the points' order: ms - (a + b x)."""

    a: float
    b: float
    points: tuple[tuple[float, float], ...]

    def at(self, x: float) -> float:
        return self.a + self.b * x

    @property
    def residuals(self) -> tuple[float, ...]:
        return tuple(y - self.at(x) for x, y in self.points)

    @property
    def max_residual(self) -> float:
        """The largest residual in absolute value (ms)."""
        return max(abs(r) for r in self.residuals)

    def x_at(self, ms: float) -> float:
        """The x at which the line reaches ``ms``: the link every node would need for a round of ``ms``."""
        return (ms - self.a) / self.b if self.b else math.nan


def fit_line(points: Sequence[tuple[float, float]]) -> LineFit:
    """Least-squares a + b x through ``points``; at least two distinct x (else ValueError naming them)."""
    pts = tuple((float(x), float(y)) for x, y in points)
    if len({x for x, _ in pts}) < 2:
        raise ValueError(f"a line fit needs two distinct x; got {[x for x, _ in pts]}")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return LineFit(a=my - b * mx, b=b, points=pts)


def ns_per_bit(bits_per_s: float) -> float:
    """The nanoseconds one bit takes on a link of ``bits_per_s``: 1 at 1 Gbit/s."""
    if bits_per_s <= 0:
        raise ValueError(f"link rate {bits_per_s!r} bit/s; must be above zero")
    return 1e9 / bits_per_s


def ring_bound_ms(state_floats: int, nodes: int, bits_per_float: int = FLOAT_BITS) -> float:
    """b of a ring all-reduce of ``state_floats`` values among ``nodes`` nodes, in ms per ns a bit: the
    2 (p - 1) / p x state bits that cross each node's link, at 1 ns a bit, in ms (0 for one node)."""
    if nodes < 1 or state_floats < 0:
        raise ValueError(f"nodes={nodes}, state_floats={state_floats}; need nodes >= 1, state_floats >= 0")
    return 2 * (nodes - 1) / nodes * state_floats * bits_per_float / 1e6


def state_ms(state_floats: int, bits_per_float: int = FLOAT_BITS) -> float:
    """ms per ns a bit of one state crossing one link (224 for 7M float32 values)."""
    return state_floats * bits_per_float / 1e6
