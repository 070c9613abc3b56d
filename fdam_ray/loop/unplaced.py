"""A round that lost clients no node can hold again: its start is checkpointed and the error says how to go on."""

from __future__ import annotations

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
