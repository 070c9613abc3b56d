"""The server's state across rounds and what happens to it at a stage end (docs/algorithms.md s.1, s.5).

Both CODA+ and CODASCA are stagewise: stage s solves a proximal subproblem
centred on v_ref, the output of stage s-1 (Yuan et al. 2021, Alg. 1 and 3).
The server therefore carries, besides the global state of s.3, the current
centre v_ref and, for ``reference_point: average``, the float64 running sum of
this stage's round-end global iterates and their count:

    after every round:  sum <- sum + v_r,  count <- count + 1          (average only)
    at a stage end:     v_ref <- sum / count  (average)  or  v_r  (last)
                        sum, count <- 0
                        c <- 0                (reset_control_variates; the paper's DSGSCA+ start;
                                               the drift correction's step, :mod:`.drift`)
                        alpha <- alpha*(v_r)  (CODA only: the closed form of s.1 from score sums)

The next stage starts from the last global iterate (v_r, alpha_r); with
``average`` only the centre is the stage average, since restarting a deep
network from an average of iterates would also need its BatchNorm statistics
recomputed.

These are functions of a named :class:`ServerState`. They take ownership of
the state they are given: state-sized buffers are updated in place (a round
of a 7M-parameter model must not allocate a fresh 56 MB sum) and the state
after the step is returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fdam_ray.core.state import GlobalState, ScoreSums


@dataclasses.dataclass
class ServerState:
    """What the server carries from round to round.

    Attributes:
        global_state: (v, alpha, model buffers, global c) after the last round.
        reference: v_ref, the proximal centre of the current stage.
        ref_sum: float64 sum of this stage's round-end v (``reference_point: average``).
        ref_count: number of terms in ``ref_sum``.
    """

    global_state: GlobalState
    reference: np.ndarray
    ref_sum: np.ndarray
    ref_count: int = 0


def init_server_state(initial: GlobalState) -> ServerState:
    """Stage 1's centre is the initial v_0 (not a random draw); the running sum starts empty."""
    return ServerState(initial, initial.v.copy(), np.zeros_like(initial.v, dtype=np.float64), 0)


def after_round(server: ServerState, new_state: GlobalState, *, reference_point: str) -> ServerState:
    """Adopt the round's global state; with ``average``, add its v to the stage's running sum."""
    if reference_point == "average":
        server.ref_sum += new_state.v
        server.ref_count += 1
    server.global_state = new_state
    return server


def after_rounds(server: ServerState, new_state: GlobalState, v_sum: np.ndarray | None, count: int, *,
                 reference_point: str) -> ServerState:
    """Adopt the state after a run of ``count`` rounds applied where the clients are; with ``average``, add
    ``v_sum`` (the float64 sum of those rounds' v, summed there) to the stage's running sum."""
    if reference_point == "average":
        if v_sum is None:
            raise ValueError("reference_point: average needs the sum of v over the run's rounds")
        server.ref_sum += v_sum
        server.ref_count += count
    server.global_state = new_state
    return server


def end_stage(server: ServerState, *, reference_point: str, alpha: np.ndarray | None = None) -> ServerState:
    """Hand the stage over: new centre, empty running sum, CODA's alpha (the drift correction then resets c).

    ``alpha``, when given, replaces the global alpha before the centre moves
    (CODA's closed-form step, :func:`coda_alpha`).
    """
    state = server.global_state
    if alpha is not None:
        state.alpha = alpha.astype(np.float32)
    if reference_point == "average" and server.ref_count:
        server.reference = (server.ref_sum / server.ref_count).astype(np.float32)
    else:
        server.reference = state.v.copy()
    server.ref_sum[:] = 0.0
    server.ref_count = 0
    return server


def coda_alpha(sums: Sequence[ScoreSums], *, objective: str, margin: float, positive_ratio: np.ndarray,
               weights: np.ndarray | None = None) -> np.ndarray:
    """CODA's alpha at a stage end: the maximiser in alpha of sum_k w_k f_k (s.1, s.3b), from client sums.

    With e_k = E_k[p h N - (1 - p) h P] over client k's labelled samples (its
    sums divided by its count, per task) and weights w_k normalised over the
    clients that have labels for the task:

        alpha* = sum_k w_k e_k / (p (1 - p))                 (auc_square)
        alpha* = max(0, m + sum_k w_k e_k / (p (1 - p)))     (auc_margin)

    ``weights`` None means every client weighs the same (the paper's f =
    (1/K) sum_k f_k). With weights n_k and p the pooled positive ratio this is
    E[h | neg] - E[h | pos] over the pooled data; with uniform weights and
    clients of different sizes or prevalences it is not, and only this one
    maximises the objective being optimised.
    """
    p = np.asarray(positive_ratio, dtype=np.float64)
    num = np.zeros_like(p)
    den = np.zeros_like(p)
    for x in sums:
        n = np.asarray(x.num_pos, dtype=np.float64) + np.asarray(x.num_neg, dtype=np.float64)
        has = n > 0
        e = (p * x.sum_neg - (1 - p) * x.sum_pos) / np.maximum(n, 1)
        w = 1.0 if weights is None else float(weights[x.client_id])
        num += np.where(has, w * e, 0.0)
        den += np.where(has, w, 0.0)
    gap = num / np.maximum(den, 1e-300) / (p * (1 - p))
    if objective == "auc_square":
        return gap.astype(np.float32)
    if objective == "auc_margin":
        return np.maximum(0.0, margin + gap).astype(np.float32)
    raise ValueError(f"closed-form alpha exists for auc_square and auc_margin, not {objective!r}")


def score_sums_nbytes(sums: Sequence[ScoreSums]) -> int:
    """Bytes the clients send up in CODA's alpha round."""
    return sum(x.sum_pos.nbytes + x.num_pos.nbytes + x.sum_neg.nbytes + x.num_neg.nbytes for x in sums)
