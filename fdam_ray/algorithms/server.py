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
"""

from __future__ import annotations

import numpy as np

from fdam_ray.state import ClientUpdate, GlobalState, StepStats


class RoundReducer:
    """Folds client updates of one round into the next global state.

    Args:
        previous: the global state the round started from.
        global_lr: eta_g.
        alpha_nonnegative: project alpha onto alpha >= 0 (auc_margin).
        control_variates: average the clients' control variates into the global c.
        weights: w_k by client id (None: every client weighs the same, plain means).
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
        self.count = 0
        self.total_weight = 0.0
        self._scratch: dict[int, np.ndarray] = {}  # w_k x^k, one buffer per length (no allocation per update)
        self._finished = False
        self.bytes_up = 0
        self.stats: list[StepStats] = []
        self._v = np.zeros_like(previous.v)
        self._alpha = np.zeros_like(previous.alpha)
        self._buffers = np.zeros_like(previous.buffers)
        self._counters = np.zeros_like(previous.counters)
        if control_variates:
            self._c_v = np.zeros_like(previous.v)
            self._c_alpha = np.zeros_like(previous.alpha)

    def fold(self, update: ClientUpdate) -> None:
        """Add one client's update to the running sums."""
        if self.control_variates and (update.c_v is None or update.c_alpha is None):
            raise ValueError(f"client {update.client_id} sent no control variate")
        if self.weights is None:
            np.add(self._v, update.v, out=self._v)
            np.add(self._alpha, update.alpha, out=self._alpha)
            np.add(self._buffers, update.buffers, out=self._buffers)
            if self.control_variates:
                np.add(self._c_v, update.c_v, out=self._c_v)
                np.add(self._c_alpha, update.c_alpha, out=self._c_alpha)
            self.total_weight += 1.0
        else:
            w = float(self.weights[update.client_id])
            pairs = [(self._v, update.v), (self._alpha, update.alpha), (self._buffers, update.buffers)]
            if self.control_variates:
                pairs += [(self._c_v, update.c_v), (self._c_alpha, update.c_alpha)]
            for total, x in pairs:
                scaled = self._scratch.setdefault(total.size, np.empty_like(total))
                np.multiply(x, np.float32(w), out=scaled)
                np.add(total, scaled, out=total)
            self.total_weight += w
        np.maximum(self._counters, update.counters, out=self._counters)
        self.count += 1
        self.bytes_up += update.nbytes
        self.stats.append(update.stats)

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
        inv = np.float32(1.0 / self.total_weight)
        prev = self.previous
        for total in (self._v, self._alpha, self._buffers):
            total *= inv
        v = self._extrapolate(self._v, prev.v)
        alpha = self._extrapolate(self._alpha, prev.alpha)
        if self.alpha_nonnegative:
            np.maximum(alpha, 0, out=alpha)
        c_v = c_alpha = None
        if self.control_variates:
            if self.partial_total is None:  # every client took part: c is their (weighted) mean
                self._c_v *= inv
                self._c_alpha *= inv
            else:  # c <- c + sum_k w_k (c^k_new - c^k_old) / sum_all w
                if prev.c_v is None or prev.c_alpha is None:
                    raise ValueError("a partial round needs the previous global control variate")
                share = np.float32(1.0 / self.partial_total)
                self._c_v *= share
                self._c_v += prev.c_v
                self._c_alpha *= share
                self._c_alpha += prev.c_alpha
            c_v, c_alpha = self._c_v, self._c_alpha
        return GlobalState(
            v=v.astype(np.float32, copy=False),
            alpha=alpha.astype(np.float32, copy=False),
            buffers=self._buffers,
            counters=self._counters,
            c_v=c_v,
            c_alpha=c_alpha,
            round=prev.round + 1,
            iteration=prev.iteration + steps,
        )
