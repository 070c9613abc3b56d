"""What travels between the driver and the clients, as named fields of flat numpy buffers.

The model state moves as one float32 vector ``v`` = (trainable model parameters,
a, b), one float32 vector of float buffers (BatchNorm running statistics), one
int64 vector of integer buffers (num_batches_tracked) and the dual ``alpha``;
never as a dict of many small tensors (ARCHITECTURE.md, "One round, as data").
"""

from __future__ import annotations

import dataclasses

import numpy as np


def _nbytes(*arrays: np.ndarray | None) -> int:
    return int(sum(a.nbytes for a in arrays if a is not None))


@dataclasses.dataclass
class GlobalState:
    """The server's state after a round (r = ``round``).

    Attributes:
        v: primal variables (w, a, b), float32.
        alpha: dual variable, one per task (empty for bce), float32.
        buffers: float model buffers (BatchNorm statistics), float32; plain mean.
        counters: integer model buffers, int64; max over clients.
        c_v, c_alpha: global control variates (None without drift correction).
    """

    v: np.ndarray
    alpha: np.ndarray
    buffers: np.ndarray
    counters: np.ndarray
    c_v: np.ndarray | None = None
    c_alpha: np.ndarray | None = None
    round: int = 0
    iteration: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes one client receives per round."""
        return _nbytes(self.v, self.alpha, self.buffers, self.counters, self.c_v, self.c_alpha)


@dataclasses.dataclass
class RoundPlan:
    """What the driver asks of every client in one round.

    Attributes:
        round: index of this round (1-based).
        stage: index of the stage the round belongs to (1-based).
        steps: local steps I of this round.
        lr: local step size eta (eta_l) of this round.
        iteration: iterations done before this round.
        partial: only some clients take part (client sampling): each returns the change of its
            control variate, c^k_new - c^k_old, instead of c^k_new (docs/algorithms.md s.3b).
    """

    round: int
    stage: int
    steps: int
    lr: float
    iteration: int
    partial: bool = False


@dataclasses.dataclass
class StepStats:
    """A client's summary of its round."""

    client_id: int
    loss: float
    steps: int
    samples: int
    compute_s: float  # seconds of the local steps (loading the state and exporting the update excluded)
    finite: bool = True  # every value of the update (v, alpha, buffers, c^k) is finite


@dataclasses.dataclass
class ClientUpdate:
    """A client's end point of a round and (with drift correction) its new control variate."""

    client_id: int
    v: np.ndarray
    alpha: np.ndarray
    buffers: np.ndarray
    counters: np.ndarray
    c_v: np.ndarray | None  # c^k after the round, or its change in a partial round (RoundPlan.partial)
    c_alpha: np.ndarray | None
    stats: StepStats

    @property
    def nbytes(self) -> int:
        """Bytes the client sends up."""
        return _nbytes(self.v, self.alpha, self.buffers, self.counters, self.c_v, self.c_alpha)


@dataclasses.dataclass
class ClientInfo:
    """What a client reports at start-up: sizes and label counts (for the global p)."""

    client_id: int
    num_train: int
    num_test: int
    positives: np.ndarray  # per task, training labels equal to 1
    labelled: np.ndarray  # per task, training labels that are not missing
    state_size: int  # length of v, checked against the driver's


@dataclasses.dataclass
class Scores:
    """Scores of the global model on some labelled samples (for AUC on the driver)."""

    client_id: int
    scores: np.ndarray  # (n, T) float32
    labels: np.ndarray  # (n, T) float32, NaN = missing


@dataclasses.dataclass
class Moments:
    """Per-task sums of scores over a client's positives and negatives (CODA's alpha round)."""

    sum_pos: np.ndarray
    num_pos: np.ndarray
    sum_neg: np.ndarray
    num_neg: np.ndarray
    client_id: int = -1
