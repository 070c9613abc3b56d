"""Server side of a round (docs/algorithms.md s.3, s.3b): running means, extrapolation eta_g, projection.

    v_r     = v_{r-1} + eta_g (mean_k v^k - v_{r-1})
    alpha_r = alpha_{r-1} + eta_g (mean_k alpha^k - alpha_{r-1}), projected to >= 0 for auc_margin
    c       = mean_k c^k
    float buffers (BatchNorm statistics): plain mean; integer buffers: max

The means are over the clients that took part, with weights w_k (client
weighting ``samples``: w_k = n_k) renormalised over them; without weights they
are plain means. When only a sample of the clients took part, c stays the
weighted mean over all clients (SCAFFOLD's rule): each sampled client sends the
change of its c^k and c <- c + sum_k w_k (c^k_new - c^k_old) / sum_all w.

Updates are folded into sums as they arrive and dropped, so the server holds a
fixed number of state-sized buffers whatever the number of clients.

One partial-sum format (:class:`PartialSum`): the weighted running sums of a
round with their total weight, client count, bytes and per-client statistics.
Whoever folds client updates folds them into it (an actor hosting several
clients, the driver's :class:`RoundReducer`), and partial sums merge into one
another, so every topology is the same arithmetic in a different place.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fdam_ray.state import ClientUpdate, GlobalState, StepStats


@dataclasses.dataclass
class PartialSum:
    """Weighted sums of some clients' updates of one round (a plain picklable record of numpy buffers).

    Attributes:
        v, alpha, buffers: sum_k w_k x^k over the clients folded in (float32).
        counters: elementwise max of the integer buffers (int64).
        c_v, c_alpha: sum_k w_k c^k (or of the change of c^k in a partial round); None without drift correction.
        weight: sum_k w_k (the count of clients without weights).
        count: how many clients were folded in.
        bytes_up: bytes those clients sent up (each client's own update, as a client-server round counts them).
        stats: each folded client's :class:`StepStats` (loss, time, whether its update was finite).
    """

    v: np.ndarray
    alpha: np.ndarray
    buffers: np.ndarray
    counters: np.ndarray
    c_v: np.ndarray | None = None
    c_alpha: np.ndarray | None = None
    weight: float = 0.0
    count: int = 0
    bytes_up: int = 0
    stats: list[StepStats] = dataclasses.field(default_factory=list)

    @classmethod
    def zeros(cls, like: GlobalState, *, control_variates: bool) -> PartialSum:
        """An empty sum for states shaped like ``like`` (with control-variate sums when asked)."""
        return cls(np.zeros_like(like.v, dtype=np.float32), np.zeros_like(like.alpha, dtype=np.float32),
                   np.zeros_like(like.buffers, dtype=np.float32), np.zeros_like(like.counters, dtype=np.int64),
                   np.zeros_like(like.v, dtype=np.float32) if control_variates else None,
                   np.zeros_like(like.alpha, dtype=np.float32) if control_variates else None)

    @property
    def control_variates(self) -> bool:
        return self.c_v is not None

    def _sums(self) -> list[np.ndarray]:
        return [self.v, self.alpha, self.buffers] + ([self.c_v, self.c_alpha] if self.control_variates else [])

    def reset(self) -> PartialSum:
        """Empty the sums in place (a host reuses one partial sum round after round)."""
        for total in self._sums():
            total.fill(0)
        self.counters.fill(0)
        self.weight, self.count, self.bytes_up, self.stats = 0.0, 0, 0, []
        return self

    def fold(self, update: ClientUpdate, weight: float | None = None) -> None:
        """Add one client's update with weight ``weight`` (None: weight 1, added without a multiplication)."""
        if self.control_variates and (update.c_v is None or update.c_alpha is None):
            raise ValueError(f"client {update.client_id} sent no control variate")
        terms = [update.v, update.alpha, update.buffers]
        if self.control_variates:
            terms += [update.c_v, update.c_alpha]
        if weight is None:
            for total, x in zip(self._sums(), terms, strict=True):
                np.add(total, x, out=total)
            self.weight += 1.0
        else:
            w = np.float32(weight)
            for total, x in zip(self._sums(), terms, strict=True):
                scaled = self._scratch(total.size)
                np.multiply(x, w, out=scaled)
                np.add(total, scaled, out=total)
            self.weight += float(weight)
        np.maximum(self.counters, update.counters, out=self.counters)
        self.count += 1
        self.bytes_up += update.nbytes
        self.stats.append(update.stats)

    def merge(self, other: PartialSum) -> None:
        """Add another partial sum of the same round (its clients' sums, weights, counts, bytes and stats)."""
        if self.control_variates and not other.control_variates:
            ids = [s.client_id for s in other.stats]
            raise ValueError(f"the partial sum of clients {ids} holds no control variate")
        for total, x in zip(self._sums(), other._sums(), strict=False):
            np.add(total, x, out=total)
        np.maximum(self.counters, other.counters, out=self.counters)
        self.weight += other.weight
        self.count += other.count
        self.bytes_up += other.bytes_up
        self.stats.extend(other.stats)

    def _scratch(self, size: int) -> np.ndarray:
        """w_k x^k lands here: one buffer per length, kept between folds (no allocation per update)."""
        scratch = self.__dict__.setdefault("_scratch_by_size", {})
        if size not in scratch:
            scratch[size] = np.empty(size, dtype=np.float32)
        return scratch[size]

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_scratch_by_size"}  # the scratch does not travel


class RoundReducer:
    """Folds client updates (or partial sums of them) of one round into the next global state.

    Args:
        previous: the global state the round started from.
        global_lr: eta_g.
        alpha_nonnegative: project alpha onto alpha >= 0 (auc_margin).
        control_variates: average the clients' control variates into the global c.
        weights: w_k by client id (None: every client weighs the same, plain means). A partial sum
            arrives with its clients' weights already applied.
        partial_total: for a round that only a sample of the clients took part in, the total weight of all
            clients (K without weights); the updates then carry the change of c^k, not c^k.
    """

    def __init__(
        self, previous: GlobalState, *, global_lr: float, alpha_nonnegative: bool, control_variates: bool,
        weights: np.ndarray | None = None, partial_total: float | None = None,
    ) -> None:
        self.previous = previous
        self.global_lr = global_lr
        self.alpha_nonnegative = alpha_nonnegative
        self.control_variates = control_variates
        self.weights = weights
        self.partial_total = partial_total
        self._finished = False
        self.sums = PartialSum.zeros(previous, control_variates=control_variates)

    @property
    def count(self) -> int:
        return self.sums.count

    @property
    def total_weight(self) -> float:
        return self.sums.weight

    @property
    def bytes_up(self) -> int:
        return self.sums.bytes_up

    @property
    def stats(self) -> list[StepStats]:
        return self.sums.stats

    def fold(self, update: ClientUpdate | PartialSum) -> None:
        """Add one client's update, or a partial sum of several, to the running sums."""
        if isinstance(update, PartialSum):
            self.sums.merge(update)
        else:
            self.sums.fold(update, None if self.weights is None else float(self.weights[update.client_id]))

    def _extrapolate(self, mean: np.ndarray, prev: np.ndarray) -> np.ndarray:
        if self.global_lr != 1.0:
            mean -= prev
            mean *= np.float32(self.global_lr)
            mean += prev
        return mean

    def finish(self, *, steps: int) -> GlobalState:
        """The global state after this round (``steps`` local steps were taken).

        The running sums become the new state in place (no state-sized copies on the driver's critical
        path), so a reducer finishes once.
        """
        if self.count == 0:
            raise RuntimeError("no client update reached the server this round")
        if self._finished:
            raise RuntimeError("this round's reducer has already finished")
        self._finished = True
        sums = self.sums
        inv = np.float32(1.0 / sums.weight)
        prev = self.previous
        for total in (sums.v, sums.alpha, sums.buffers):
            total *= inv
        v = self._extrapolate(sums.v, prev.v)
        alpha = self._extrapolate(sums.alpha, prev.alpha)
        if self.alpha_nonnegative:
            np.maximum(alpha, 0, out=alpha)
        c_v = c_alpha = None
        if self.control_variates:
            if self.partial_total is None:  # every client took part: c is their (weighted) mean
                sums.c_v *= inv
                sums.c_alpha *= inv
            else:  # c <- c + sum_k w_k (c^k_new - c^k_old) / sum_all w
                if prev.c_v is None or prev.c_alpha is None:
                    raise ValueError("a partial round needs the previous global control variate")
                share = np.float32(1.0 / self.partial_total)
                sums.c_v *= share
                sums.c_v += prev.c_v
                sums.c_alpha *= share
                sums.c_alpha += prev.c_alpha
            c_v, c_alpha = sums.c_v, sums.c_alpha
        return GlobalState(
            v=v.astype(np.float32, copy=False),
            alpha=alpha.astype(np.float32, copy=False),
            buffers=sums.buffers,
            counters=sums.counters,
            c_v=c_v,
            c_alpha=c_alpha,
            round=prev.round + 1,
            iteration=prev.iteration + steps,
        )
