"""Drift correction as a strategy: none (CODA+, FedAvg, FedProx) or control variates (CODASCA, SCAFFOLD).

With control variates each client keeps c^k and the server the global c
(docs/algorithms.md s.2, s.3; SCAFFOLD "option II"). A client corrects every
local step by c - c^k, and at the round's end, with I the steps taken:

    c_v^k     <- c_v^k - c_v + (v_start - v_end) / (I eta)
    c_alpha^k <- c_alpha^k - c_alpha + (alpha_end - alpha_start) / (I eta)

The server's c is the (weighted) mean of the clients' c^k; under client
sampling a sampled client sends the change of its c^k and c moves by their
weighted sum over the total weight of all clients (s.3b), which
:class:`~fdam_ray.algorithms.server.RoundReducer` applies. A stage start zeroes
c and every c^k unless ``reset_control_variates`` is off.

A strategy has a client half (:meth:`DriftCorrection.client`, one per model
replica, torch tensors where the replica computes) and a server half (the
methods on the strategy itself, numpy). :class:`NoCorrection` leaves every
term out, so the same solver is CODA+ without it and CODASCA with it.
"""

from __future__ import annotations

import abc

import numpy as np
import torch

from fdam_ray.flat import FlatModel
from fdam_ray.state import GlobalState, Rule, vector_fields

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


DRIFT_CORRECTIONS: dict[str, DriftCorrection] = {d.name: d for d in (NoDriftCorrection(), ControlVariates())}
