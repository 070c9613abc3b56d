"""Server side of a round (docs/algorithms.md s.3, s.3b): running means, extrapolation eta_g, projection.

    v_r     = v_{r-1} + eta_g (mean_k v^k - v_{r-1})
    alpha_r = alpha_{r-1} + eta_g (mean_k alpha^k - alpha_{r-1}), projected to >= 0 for auc_margin
    c       = mean_k c^k
    float buffers (BatchNorm statistics): plain mean; integer buffers: max

The means are over the clients that took part, with weights w_k (client
weighting ``samples``: w_k = n_k) renormalised over them; without weights they
are plain means. When only a sample of the clients took part, c stays the
weighted mean over all clients (SCAFFOLD's rule): each sampled client sends the
change of its c^k and c <- c + sum_k w_k (c^k_new - c^k_old) / sum_all w
(:func:`server_c`). What a client sends for it (c^k, or its change) is the drift
correction's (:mod:`fdam_ray.algorithms.drift`); a family whose server forms
its state otherwise brings its own reducer (:meth:`~fdam_ray.algorithms.base.Algorithm.reducer`).

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

from fdam_ray.core.state import ClientUpdate, GlobalState, Rule, StateVectors, StepStats, vector_fields, vector_names


@dataclasses.dataclass(kw_only=True)
class PartialSum(StateVectors):
    """Weighted sums of some clients' updates of one round (a plain picklable record of numpy buffers).

    Its state vectors hold sum_k w_k x^k over the clients folded in (float32; the control variates, or their
    changes in a partial round, only with drift correction), except those combined by max (integer buffers),
    which hold the elementwise max.

    Attributes:
        weight: sum_k w_k (the count of clients without weights).
        count: how many clients were folded in.
        bytes_up: bytes those clients sent up (each client's own update, as a client-server round counts them).
        stats: each folded client's :class:`StepStats` (loss, time, whether its update was finite).
    """

    weight: float = 0.0
    count: int = 0
    bytes_up: int = 0
    stats: list[StepStats] = dataclasses.field(default_factory=list)

    @classmethod
    def zeros(cls, like: StateVectors, *, control_variates: bool, flat: bool = False,
              buffer: np.ndarray | None = None) -> PartialSum:
        """An empty sum for states shaped like ``like`` (with control-variate sums when asked).

        ``flat``: the summed vectors are consecutive views of one float32 buffer, in declaration order
        (:attr:`flat`), so the whole sum can be reduced in one call without a copy; ``buffer``: that buffer
        (float32, exactly as long as the summed vectors; zeroed here), else a new one.
        """
        out: dict[str, np.ndarray | None] = {}
        for f in vector_fields():
            rule = f.metadata["rule"]
            if rule is Rule.CONTROL:
                of = getattr(like, f.metadata["corrects"])
                out[f.name] = np.zeros_like(of, dtype=np.float32) if control_variates else None
            else:
                out[f.name] = np.zeros_like(getattr(like, f.name), dtype=np.int64 if rule is Rule.MAX else np.float32)
        made = cls.from_vectors(out)
        if flat:
            summed = {name: getattr(made, name) for name in made._summed()}
            size = sum(x.size for x in summed.values())
            if buffer is None:
                buffer = np.zeros(size, dtype=np.float32)
            elif buffer.dtype != np.float32 or buffer.shape != (size,):
                raise ValueError(f"a flat partial sum needs a float32 buffer of {size} values, not {buffer.dtype} "
                                 f"{buffer.shape}")
            else:
                buffer.fill(0)
            at = 0
            for name, x in summed.items():
                setattr(made, name, buffer[at:at + x.size].reshape(x.shape))
                at += x.size
            made.__dict__["_flat"] = buffer
        return made

    @property
    def flat(self) -> np.ndarray | None:
        """The one buffer the summed vectors are views of (:meth:`zeros` with ``flat``), else None."""
        return self.__dict__.get("_flat")

    @property
    def control_variates(self) -> bool:
        return all(getattr(self, name) is not None for name in _CONTROL)

    def fits(self, state: StateVectors) -> bool:
        """Whether this sum can take the updates of a round from ``state``: control-variate sums exactly when
        ``state`` carries c, and the shapes of v, alpha and the buffers."""
        return self.control_variates == (state.c_v is not None) and all(
            getattr(self, name).shape == getattr(state, name).shape for name in ("v", "alpha", "buffers"))

    def _summed(self) -> list[str]:
        """The names of the vectors this partial sum adds up (every one present but those combined by max)."""
        return [f.name for f in vector_fields() if f.metadata["rule"] is not Rule.MAX
                and getattr(self, f.name) is not None]

    def reset(self, lazy: bool = False) -> PartialSum:
        """Empty the sums in place (a host reuses one partial sum round after round).

        ``lazy``: the summed vectors are not zeroed; the first update folded or merged is written into them as
        ``x + 0`` (the same bits as adding it to zeros, one pass fewer), and :meth:`settle` zeroes them if
        nothing was. Until then they must not be read.
        """
        for name, x in self.vectors().items():
            if x is not None and (not lazy or name in _MAX):
                x.fill(0)
        self.weight, self.count, self.bytes_up, self.stats = 0.0, 0, 0, []
        self.__dict__["_unset"] = lazy
        return self

    def settle(self) -> PartialSum:
        """Zero the summed vectors of a lazily reset sum into which nothing was folded (readable from here)."""
        if self.__dict__.pop("_unset", False):
            for name in self._summed():
                getattr(self, name).fill(0)
        return self

    def fold(self, update: ClientUpdate, weight: float | None = None) -> None:
        """Add one client's update with weight ``weight`` (None: weight 1, added without a multiplication)."""
        if self.control_variates and not all(getattr(update, name) is not None for name in _CONTROL):
            raise ValueError(f"client {update.client_id} sent no control variate")
        names = self._summed()
        first = self.__dict__.pop("_unset", False)  # a lazy reset: these sums hold nothing yet
        if weight is None:
            for name in names:
                total = getattr(self, name)
                np.add(getattr(update, name) if first else total, _ZERO if first else getattr(update, name),
                       out=total)
            self.weight += 1.0
        else:
            w = np.float32(weight)
            for name in names:
                total = getattr(self, name)
                scaled = total if first else self._scratch(total.size)
                np.multiply(getattr(update, name), w, out=scaled)
                np.add(total, _ZERO if first else scaled, out=total)
            self.weight += float(weight)
        self._fold_max(update)
        self.count += 1
        self.bytes_up += update.nbytes
        self.stats.append(update.stats)

    def _fold_max(self, other: StateVectors) -> None:
        for name in vector_names(Rule.MAX):
            total = getattr(self, name)
            np.maximum(total, getattr(other, name), out=total)

    def merge(self, other: PartialSum) -> None:
        """Add another partial sum of the same round (its clients' sums, weights, counts, bytes and stats)."""
        if self.control_variates and not other.control_variates:
            ids = [s.client_id for s in other.stats]
            raise ValueError(f"the partial sum of clients {ids} holds no control variate")
        first = self.__dict__.pop("_unset", False)  # a lazy reset: these sums hold nothing yet
        for name in self._summed():
            total = getattr(self, name)
            if getattr(other, name) is not None:
                np.add(getattr(other, name) if first else total, _ZERO if first else getattr(other, name), out=total)
            elif first:
                total.fill(0)
        self._fold_max(other)
        self._add_counts(other)

    def _add_counts(self, other: PartialSum) -> None:
        self.weight += other.weight
        self.count += other.count
        self.bytes_up += other.bytes_up
        self.stats.extend(other.stats)

    @staticmethod
    def sum_of(first: PartialSum, second: PartialSum, into: PartialSum | None = None) -> PartialSum:
        """``first + second`` as a new partial sum whose vectors are written into ``into``'s buffers (a kept
        partial sum, reused while the shapes match; new buffers otherwise): one pass, no copy of either part.

        ``into`` is left untouched apart from its buffers; use the returned record.
        """
        if first.control_variates != second.control_variates:
            late = second if first.control_variates else first
            raise ValueError(f"the partial sum of clients {[s.client_id for s in late.stats]} holds no control "
                             "variate")
        out: dict[str, np.ndarray | None] = {}
        for f in vector_fields():
            x, y = getattr(first, f.name), getattr(second, f.name)
            if x is None:
                out[f.name] = None
                continue
            buf = None if into is None else getattr(into, f.name)
            if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
                buf = np.empty_like(x)
            (np.maximum if f.metadata["rule"] is Rule.MAX else np.add)(x, y, out=buf)
            out[f.name] = buf
        total = PartialSum(**out)  # type: ignore[arg-type]
        total._add_counts(first)
        total._add_counts(second)
        return total

    def _scratch(self, size: int) -> np.ndarray:
        """w_k x^k lands here: one buffer per length, kept between folds (no allocation per update)."""
        scratch = self.__dict__.setdefault("_scratch_by_size", {})
        if size not in scratch:
            scratch[size] = np.empty(size, dtype=np.float32)
        return scratch[size]

    def __getstate__(self) -> dict:
        if self.__dict__.get("_unset"):
            raise RuntimeError("a lazily reset partial sum was sent before settle()")
        # neither the scratch nor the flat buffer travels (the vectors, views of it, travel on their own)
        return {k: v for k, v in self.__dict__.items() if k not in ("_scratch_by_size", "_flat", "_unset")}


_CONTROL = vector_names(Rule.CONTROL)
_MAX = vector_names(Rule.MAX)
_ZERO = np.float32(0)


def server_c(total: np.ndarray, prev: np.ndarray | None, inv: np.float32, partial_total: float | None) -> np.ndarray:
    """The server's c from the round's weighted sum ``total`` of the clients' uploads, in place (R10): their mean
    S * inv (inv = float32(1 / W)) in a round every client was asked to run, else, ``partial_total`` being T,
    c <- c + sum_k w_k (c^k new - c^k old) / T (SCAFFOLD's rule, s.3b), the sum already holding the changes."""
    if partial_total is None:
        total *= inv
        return total
    if prev is None:
        raise ValueError("a partial round needs the previous global control variate")
    total *= np.float32(1.0 / partial_total)
    total += prev
    return total


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
        sums: the running sums to fold into and finish in place (default: zeros of ``previous``'s shapes);
            a caller that has the round's sums already (the collective transport's members) passes them.
    """

    def __init__(
        self, previous: GlobalState, *, global_lr: float, alpha_nonnegative: bool, control_variates: bool,
        weights: np.ndarray | None = None, partial_total: float | None = None, sums: PartialSum | None = None,
    ) -> None:
        self.previous = previous
        self.global_lr = global_lr
        self.alpha_nonnegative = alpha_nonnegative
        self.control_variates = control_variates
        self.weights = weights
        self.partial_total = partial_total
        self._finished = False
        self.sums = PartialSum.zeros(previous, control_variates=control_variates) if sums is None else sums

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

    def _finishing(self, empty: bool = False) -> None:
        """Refuse a round no update reached (unless ``empty`` may finish: dp: client's noise-only round), or a
        second finish (the sums became the state in place)."""
        if self.count == 0 and not empty:
            raise RuntimeError("no client update reached the server this round")
        if self._finished:
            raise RuntimeError("this round's reducer has already finished")
        self._finished = True

    def finish(self, *, steps: int) -> GlobalState:
        """The global state after this round (``steps`` local steps were taken).

        The running sums become the new state in place (no state-sized copies on the driver's critical
        path), so a reducer finishes once.
        """
        self._finishing()
        sums, prev = self.sums, self.previous
        inv = np.float32(1.0 / sums.weight)
        out: dict[str, np.ndarray | None] = {}
        for f in vector_fields():
            total, rule = getattr(sums, f.name), f.metadata["rule"]
            if rule is Rule.CONTROL and not self.control_variates:
                total = None
            elif rule in (Rule.EXTRAPOLATE, Rule.MEAN):
                total *= inv
                if rule is Rule.EXTRAPOLATE:
                    total = self._extrapolate(total, getattr(prev, f.name))
            elif rule is Rule.CONTROL:
                total = server_c(total, getattr(prev, f.name), inv, self.partial_total)
            out[f.name] = total
        if self.alpha_nonnegative:
            alpha = out["alpha"]
            if alpha is None:
                raise RuntimeError("the server combined no alpha (every state carries one, empty for bce)")
            np.maximum(alpha, 0, out=alpha)
        return GlobalState.from_vectors(out, round=prev.round + 1, iteration=prev.iteration + steps)


@dataclasses.dataclass(frozen=True)
class ServerStep:
    """The settings of the plain server step (:class:`RoundReducer`), and that step applied to a round's reduced
    sums: what the collective transport's members run after the all-reduce, from
    :meth:`~fdam_ray.algorithms.base.Algorithm.server_step`."""

    global_lr: float
    alpha_nonnegative: bool
    control_variates: bool

    def apply(self, previous: GlobalState, total: PartialSum, steps: int, partial_total: float | None,
              into: PartialSum | None = None, in_place: bool = False) -> GlobalState:
        """The new global state from the round's reduced sums, as the driver's reducer computes it (which folds
        them into zeros: ``0 + x``, written here into ``into``'s buffers when their shapes match, so a round
        allocates no state-sized buffer; the returned state's vectors are then those buffers).

        ``in_place``: the state is finished in ``total``'s own buffers, with no ``0 + x`` pass. The same bits:
        the sums hold no -0.0 (each member's partial sum starts from +0.0 and +0.0 + -0.0 is +0.0; a sum of
        terms none of which is -0.0 is never -0.0), the one value ``0 + x`` changes."""
        def reducer(sums: PartialSum | None = None) -> RoundReducer:
            return RoundReducer(previous, global_lr=self.global_lr, alpha_nonnegative=self.alpha_nonnegative,
                                control_variates=self.control_variates, partial_total=partial_total, sums=sums)

        if in_place:
            return reducer(total).finish(steps=steps)
        if into is None or not same_shapes(into, total):
            folding = reducer()
            folding.fold(total)
            return folding.finish(steps=steps)
        for f in vector_fields():
            x, out = getattr(total, f.name), getattr(into, f.name)
            if x is not None:
                (np.maximum if f.metadata["rule"] is Rule.MAX else np.add)(x, x.dtype.type(0), out=out)
        into.weight, into.count, into.bytes_up, into.stats = 0.0 + total.weight, total.count, total.bytes_up, []
        return reducer(into).finish(steps=steps)  # no zeros made to fold into


def same_shapes(a: PartialSum, b: PartialSum) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and x.shape == y.shape
                                             and x.dtype == y.dtype)
               for x, y in zip(a.vectors().values(), b.vectors().values(), strict=True))
