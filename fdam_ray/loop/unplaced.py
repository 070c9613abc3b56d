"""Clients that lost their state: a round that lost clients no node can hold again (its start is checkpointed and the
error says how to go on), the clients a resume rebuilds, and the rounds that ran rebuilt clients (recorded)."""

from __future__ import annotations

from fdam_ray.algorithms.drift import DriftCorrection
from fdam_ray.checkpoint import LoopState
from fdam_ray.core.state import ClientState, GlobalState
from fdam_ray.executors.base import Executor
from fdam_ray.executors.errors import PlacementError
from fdam_ray.outputs import Observer, Snapshot


def checkpoint_unplaced(exc: PlacementError, observer: Observer, round_index: int, at_start: Snapshot) -> None:
    """Write ``at_start`` (the state round ``round_index`` started from, with the placed clients' states and the
    unplaced ones marked for a rebuild) through ``observer``, and say in ``exc`` where it is and how to resume, or
    why it could not be written (the last checkpoint is then kept)."""
    try:
        run_dir = observer.interrupted(round_index - 1, at_start)
    except Exception as again:  # the stop's own reason comes first
        why = (str(again).strip().splitlines() or [""])[0]
        exc.args = (f"{exc.args[0]}; round {round_index} did not finish and its checkpoint could not be written "
                    f"({type(again).__name__}: {why}); the last checkpoint is kept",)
        return
    if run_dir is not None:
        exc.args = (f"{exc.args[0]}; round {round_index} did not finish: a checkpoint of the state it started "
                    f"from was written; once the cluster can hold every client again, continue with: "
                    f"fdam train --resume {run_dir}",)


def rebuilt_states(states: list[ClientState | None], state: GlobalState,
                   drift: DriftCorrection) -> list[ClientState | None]:
    """A checkpoint's client states, where a client marked ``rebuild`` (its actor could not be placed when the
    checkpoint was written) starts as a replaced actor's client does (the drift correction's rule,
    :meth:`~fdam_ray.algorithms.drift.DriftCorrection.replaced`: the global c of ``state``, a fresh sampler)."""
    typed = [None if s is None else ClientState.of(s) for s in states]  # (a mapping in the file's layout is read)
    return [drift.replaced(k, state) if s is not None and s.rebuild else s for k, s in enumerate(typed)]


def note_rebuilt(loop: LoopState, executor: Executor) -> None:
    """Record in ``loop.rebuilt`` the rounds whose update of a client the executor folded as a rebuilt client's
    first (:meth:`~fdam_ray.executors.base.Executor.take_rebuilt`; :mod:`fdam_ray.executors.rebuilds`)."""
    for r, clients in executor.take_rebuilt().items():
        loop.rebuilt[str(r)] = sorted(set(loop.rebuilt.get(str(r), [])) | set(clients))
