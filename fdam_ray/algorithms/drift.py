"""Drift correction as a strategy: none (CODA+, FedAvg, FedProx) or control variates (CODASCA, SCAFFOLD).

With control variates each client keeps c^k and the server the global c
(docs/algorithms.md s.2, s.3; SCAFFOLD "option II"). A client corrects every
local step by c - c^k, and at the round's end, with I the steps taken:

    c_v^k     <- c_v^k - c_v + (v_start - v_end) / (I eta)
    c_alpha^k <- c_alpha^k - c_alpha + (alpha_end - alpha_start) / (I eta)

The server's c is the (weighted) mean of the clients' c^k; under client
sampling a sampled client sends the change of its c^k and c moves by their
weighted sum over the total weight of all clients (s.3b). A stage start zeroes
c and every c^k unless ``reset_control_variates`` is off.

A strategy has a client half (:meth:`DriftCorrection.client`, one per model
replica, torch tensors where the replica computes) and a server half (the
methods on the strategy itself, numpy). :class:`NoCorrection` leaves every
term out, so the same solver is CODA+ without it and CODASCA with it.

The partial-participation rule lives here once, on :class:`DriftCorrection` (s.3b and s.8, R6, R7,
R10), and every executor and bridge reaches it through the algorithm's drift correction
(:attr:`fdam_ray.algorithms.base.Algorithm.drift`), never a module-level object: what a client uploads in
a full and in a sampled round (the client half's :meth:`ClientControlVariates.exported`), the change of c^k
(:meth:`DriftCorrection.change`), a host's sums of its clients' changes when another client was late
(:meth:`~DriftCorrection.host_changes`), :meth:`~DriftCorrection.moved_c` for bridges whose server takes a
full round's mean (Flower and SecAgg+), the total weight T of all clients, dropped ones included
(:meth:`~DriftCorrection.total_weight`), a late round refolded as a sampled one
(:meth:`~DriftCorrection.as_sampled`), a kept c^k zeroed at a stage start (:meth:`~DriftCorrection.zeroed`),
and the state a replaced client starts from (:meth:`DriftCorrection.replaced`). Each acts on the control
vectors a state carries, so without them (``none``) it finds nothing to do. How the server forms c from a
round's sums is the reducer's (:func:`fdam_ray.algorithms.server.server_c`). A mechanism that transforms a
client's change before aggregation (differential privacy: clip and noise) is a plug's client face
(:mod:`fdam_ray.clients.face`), not a drift correction.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from fdam_ray.core.flat import FlatModel
from fdam_ray.core.state import ClientState, GlobalState, Rule, StateVectors, vector_fields, vector_names

if TYPE_CHECKING:
    from fdam_ray.algorithms.server import RoundReducer

# a client's own control variate: (c_v^k, c_alpha^k) tensors, or None without drift correction
ClientVariate = tuple[torch.Tensor, torch.Tensor] | None


class ClientCorrection(abc.ABC):
    """The client half of a drift correction, for one model replica (bound to one client at a time)."""

    @abc.abstractmethod
    def begin(self, flat: FlatModel, state: GlobalState) -> None:
        """Load the round's global state into ``flat`` (with what the correction needs of it)."""

    def correct_v(self, d_v: torch.Tensor) -> None:  # noqa: B027 (a correction may leave v alone)
        """Add this round's correction to the primal step direction, in place."""

    def correct_alpha(self, g_alpha: torch.Tensor) -> None:  # noqa: B027
        """Add this round's correction to the dual gradient, in place."""

    def end(self, flat: FlatModel, steps: int, lr: float, *, change: bool) -> None:  # noqa: B027
        """The round is over: update the client's own state from the round's movement."""

    def exported(self) -> tuple[torch.Tensor, ...]:
        """Tensors sent up with the round's end point (c^k, or its change), in the order of the control vectors."""
        return ()

    def new_variate(self) -> ClientVariate:
        """A fresh (zero) client state for a client hosted on this replica."""
        return None

    def bind(self, variate: ClientVariate) -> None:  # noqa: B027
        """Step with this client's own state from now on."""


class NoCorrection(ClientCorrection):
    def begin(self, flat: FlatModel, state: GlobalState) -> None:
        flat.load(state)


class ClientControlVariates(ClientCorrection):
    """c^k of the bound client, and the round's c - c^k and start point (one set of buffers per replica)."""

    def __init__(self, flat: FlatModel) -> None:
        n, m, dev = flat.state_size, flat.aux_size, flat.device
        self.v_start = torch.zeros(n, device=dev)
        self.alpha_start = torch.zeros(m, device=dev)
        self.c_v = torch.zeros(n, device=dev)  # the bound client's c^k
        self.c_alpha = torch.zeros(m, device=dev)
        self.corr_v = torch.zeros(n, device=dev)  # c - c^k for this round
        self.corr_alpha = torch.zeros(m, device=dev)
        self._spare: ClientVariate = (self.c_v, self.c_alpha)  # handed to the first client hosted here
        self._change = False  # whether end() kept the change of c^k (in v_start, alpha_start)

    def new_variate(self) -> ClientVariate:
        if self._spare is not None:
            variate, self._spare = self._spare, None
            return variate
        return torch.zeros_like(self.c_v), torch.zeros_like(self.c_alpha)

    def bind(self, variate: ClientVariate) -> None:
        if variate is not None:
            self.c_v, self.c_alpha = variate

    def begin(self, flat: FlatModel, state: GlobalState) -> None:
        self._change = False
        if state.c_v is None or state.c_alpha is None:
            raise ValueError("the algorithm uses control variates but the global state carries none")
        # the global c lands in corr (one crossing with the state), then corr = c - c^k on the device
        flat.load(state, also=[(state.c_v, self.corr_v), (state.c_alpha, self.corr_alpha)])
        with torch.no_grad():
            self.v_start.copy_(flat.v)  # the start point is needed only for the c^k update in end()
            self.alpha_start.copy_(flat.alpha)
            self.corr_v.sub_(self.c_v)
            self.corr_alpha.sub_(self.c_alpha)

    def correct_v(self, d_v: torch.Tensor) -> None:
        d_v.add_(self.corr_v)

    def correct_alpha(self, g_alpha: torch.Tensor) -> None:
        g_alpha.add_(self.corr_alpha)

    def end(self, flat: FlatModel, steps: int, lr: float, *, change: bool) -> None:
        self._change = change
        scale = 1.0 / (steps * lr)
        with torch.no_grad():
            # c^k - c + (v_start - v_end)/(I eta): c^k - c is -corr.
            self.v_start.sub_(flat.v)
            self.alpha_start.sub_(flat.alpha)
            if not change:
                self.c_v.copy_(self.corr_v).neg_().add_(self.v_start, alpha=scale)
                self.c_alpha.copy_(self.corr_alpha).neg_().sub_(self.alpha_start, alpha=scale)
                return
            # c^k_new into corr (used up), the change into v_start / alpha_start, then c^k <- c^k_new
            self.corr_v.neg_().add_(self.v_start, alpha=scale)
            self.corr_alpha.neg_().sub_(self.alpha_start, alpha=scale)
            torch.sub(self.corr_v, self.c_v, out=self.v_start)
            torch.sub(self.corr_alpha, self.c_alpha, out=self.alpha_start)
            self.c_v.copy_(self.corr_v)
            self.c_alpha.copy_(self.corr_alpha)

    def exported(self) -> tuple[torch.Tensor, ...]:
        return (self.v_start, self.alpha_start) if self._change else (self.c_v, self.c_alpha)


class DriftCorrection(abc.ABC):
    """A drift correction: its client half and what the server does with the global c."""

    name: str
    control_variates: bool  # whether the state carries control variates (c, c^k)

    @abc.abstractmethod
    def client(self, flat: FlatModel) -> ClientCorrection:
        """The client half for one model replica."""

    def init(self, initial: GlobalState) -> None:  # noqa: B027 (no global state of its own)
        """Give the round-0 global state what the correction keeps in it (zero global c)."""

    def end_stage(self, state: GlobalState, *, reset: bool) -> None:  # noqa: B027
        """A stage ends: zero the global c when ``reset`` (the paper's DSGSCA+ start)."""


    def replaced(self, client_id: int, state: StateVectors) -> ClientState:
        """The state a client rebuilt on a new actor starts from (a replacement after a failure, or on resume a
        client whose actor could not be placed): c^k = the global c of ``state``, a fresh sampler (None keeps
        it), no loss scale, zero optimiser buffers (s.8, R1)."""
        control = tuple(getattr(state, name) for name in vector_names(Rule.CONTROL))
        return ClientState(client_id, None if any(c is None for c in control) else control)

    # -- the partial-participation rule (s.3b; s.8, R6, R7, R10), on the control vectors a state carries ------------
    # A correction that carries none (``none``) finds nothing to do: no changes (None), its sums and states untouched.
    names = vector_names(Rule.CONTROL)  # the control vectors of a state, in declaration order

    @staticmethod
    def total_weight(num_clients: int, weights: np.ndarray | None) -> float:
        """T, the total weight of all K clients of the run: K under ``uniform``, the sum of every n_k under
        ``samples``. K and T stay those of the run's start: a dropped client still counts (R7)."""
        return float(num_clients if weights is None else weights.sum())

    @staticmethod
    def change(new: Sequence[np.ndarray], old: Sequence[np.ndarray]) -> list[np.ndarray]:
        """c^k new - c^k old per control vector, in float32: what a client of a sampled round sends (the client
        half forms the same value on its device, R9) and what a late round's sums add up."""
        return [np.subtract(np.asarray(n), np.asarray(o), dtype=np.float32) for n, o in zip(new, old, strict=True)]

    def host_changes(self, clients: Iterable[tuple[Sequence[np.ndarray] | None, Sequence[np.ndarray] | None,
                                                   float | None]]) -> tuple[np.ndarray, ...] | None:
        """sum_k w_k (c^k new - c^k old) over a host's clients, each given as (c^k new, c^k old, w_k or None for
        weight 1), folded in their order with the arithmetic of a partial sum (R10): what a host whose clients
        made a round that another client missed sends instead of its sums of c^k (R6). None when a client holds
        no control variate (or no client is given)."""
        totals: tuple[np.ndarray, ...] | None = None
        for new, old, weight in clients:
            if new is None or old is None:
                return None
            changes = self.change(new, old)
            if weight is not None:
                changes = [np.multiply(x, np.float32(weight)) for x in changes]
            if totals is None:
                totals = tuple(np.zeros_like(x) for x in changes)
            for total, x in zip(totals, changes, strict=True):
                np.add(total, x, out=total)
        return totals

    def as_sampled(self, reducer: RoundReducer, changes: Sequence[Sequence[np.ndarray]], total_weight: float) -> None:
        """Make a round every client was asked to run, and that some missed, fold as a sampled round of those that
        made it (s.3b, R6): the reducer's sums of c^k become the sums ``changes`` of their hosts' changes
        (:meth:`host_changes`, in fold order), and c moves by them over ``total_weight`` (T). Nothing to do
        when the round's sums hold no control variate."""
        sums = reducer.sums
        if not sums.control_variates:
            return
        for i, name in enumerate(self.names):
            total = getattr(sums, name)
            total.fill(0)
            for part in changes:
                np.add(total, part[i], out=total)
        reducer.partial_total = total_weight

    @staticmethod
    def moved_c(previous: np.ndarray, changes: Iterable[tuple[float, np.ndarray]], total: float) -> np.ndarray:
        """c + sum_k w_k (c^k new - c^k old) / T in float64, the changes given as (w_k, change) and added in
        their order: the rule for a bridge whose server takes a full round's mean of what the sites that came
        send (Flower, SecAgg+), which then sends a value whose mean is this c."""
        moved = previous.astype(np.float64)
        for weight, change in changes:
            moved += weight * change / total
        return moved

    def zeroed(self, state: ClientState) -> ClientState:
        """A kept client state at a stage start with ``reset_control_variates``: c^k = 0 (s.5)."""
        if state.control is not None:
            state.control = tuple(np.zeros_like(np.asarray(c)) for c in state.control)
        return state


class NoDriftCorrection(DriftCorrection):
    name = "none"
    control_variates = False

    def client(self, flat: FlatModel) -> ClientCorrection:
        return NoCorrection()


class ControlVariates(DriftCorrection):
    name = "control_variates"
    control_variates = True

    def client(self, flat: FlatModel) -> ClientCorrection:
        return ClientControlVariates(flat)

    def init(self, initial: GlobalState) -> None:
        for f in vector_fields(Rule.CONTROL):
            setattr(initial, f.name, np.zeros_like(getattr(initial, f.metadata["corrects"])))

    def end_stage(self, state: GlobalState, *, reset: bool) -> None:
        if reset and state.c_v is not None:
            for f in vector_fields(Rule.CONTROL):
                setattr(state, f.name, np.zeros_like(getattr(state, f.name)))


CONTROL_VARIATES = ControlVariates()
DRIFT_CORRECTIONS: dict[str, DriftCorrection] = {d.name: d for d in (NoDriftCorrection(), CONTROL_VARIATES)}
