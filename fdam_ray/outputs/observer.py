"""The one interface everything a run writes, shows or reports hangs off (:class:`Observer`), the fan-out to
several (:class:`Observers`) and the simplest one, a callback per evaluation (:class:`EvalCallback`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fdam_ray.checkpoint import Checkpoint
from fdam_ray.core.state import RoundPlan

# A function that returns the checkpoint of the moment it is called (without the config).
Snapshot = Callable[[], Checkpoint]


@dataclasses.dataclass
class RunStart:
    """What an observer learns when a run starts (after its clients have started)."""

    resumed: bool
    history: list[dict]  # the records of earlier sessions of a resumed run
    round: int  # rounds done so far
    iteration: int  # iterations done so far
    iterations: int  # the run's total


class Observer:
    """Hooks the driver loop calls; each does nothing unless overridden.

    Order within one run: ``start``, then for the initial evaluation of a fresh
    run ``record``, then per round ``record`` (when it was evaluated) and
    ``round_end``; ``event`` for stage switches; ``finish`` after the last
    round; ``close`` always, with the exception that stopped the run, if any.
    """

    def start(self, run: RunStart) -> None:
        """The clients have started; the run begins (or continues)."""

    def record(self, record: dict, snapshot: Snapshot) -> None:
        """An evaluation record (``snapshot()`` gives the checkpoint of this moment)."""

    def round_end(self, plan: RoundPlan, record: dict | None, snapshot: Snapshot | None) -> None:
        """A round is done (``record`` is its evaluation, if it had one). ``snapshot`` is None for a round inside
        a run of rounds (``transport: collective``): the driver does not hold its state, so no checkpoint of it
        can be written (the run's last round has one)."""

    def needs_state(self, round_: int) -> bool:
        """Whether this observer needs the global state after round ``round_`` (a checkpoint round): such a round
        ends a run of rounds."""
        return False

    def event(self, message: str, *args: Any, level: int = logging.INFO) -> None:
        """Something worth a line in the run's log (a stage switch)."""

    def interrupted(self, round_: int, snapshot: Snapshot) -> Path | None:
        """The next round cannot finish and the run stops (clients that cannot be placed): an observer that
        saves the run writes a checkpoint of ``snapshot()`` (the state after round ``round_``) and returns the
        folder to resume; the others return None."""
        return None

    def best_model(self, model: dict, record: dict) -> None:
        """With a validation split, just before ``finish``: the model of the evaluation ``record`` with the best
        validation AUC (``model.pt``'s payload); an observer that saves the run writes ``best_model.pt``."""

    def finish(self, summary: dict, model: dict, snapshot: Snapshot) -> None:
        """The last round is done: the run's summary and final model. An observer that saves the run
        sets ``summary["run_dir"]``."""

    def close(self, error: BaseException | None) -> None:
        """The run is over (``error``: what stopped it, or None)."""


class Observers(Observer):
    """Several observers as one, called in the order given."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = list(observers)

    def start(self, run: RunStart) -> None:
        for o in self.observers:
            o.start(run)

    def record(self, record: dict, snapshot: Snapshot) -> None:
        for o in self.observers:
            o.record(record, snapshot)

    def round_end(self, plan: RoundPlan, record: dict | None, snapshot: Snapshot | None) -> None:
        for o in self.observers:
            o.round_end(plan, record, snapshot)

    def needs_state(self, round_: int) -> bool:
        return any(o.needs_state(round_) for o in self.observers)

    def event(self, message: str, *args: Any, level: int = logging.INFO) -> None:
        for o in self.observers:
            o.event(message, *args, level=level)

    def interrupted(self, round_: int, snapshot: Snapshot) -> Path | None:
        saved = [o.interrupted(round_, snapshot) for o in self.observers]
        return next((d for d in saved if d is not None), None)

    def best_model(self, model: dict, record: dict) -> None:
        for o in self.observers:
            o.best_model(model, record)

    def finish(self, summary: dict, model: dict, snapshot: Snapshot) -> None:
        for o in self.observers:
            o.finish(summary, model, snapshot)

    def close(self, error: BaseException | None) -> None:
        first: BaseException | None = None
        for o in self.observers:  # every observer closes, even if one fails
            try:
                o.close(error)
            except Exception as exc:
                first = first or exc
        if first is not None and error is None:
            raise first


class EvalCallback(Observer):
    """Calls ``fn(record)`` at every evaluation (``fdam_ray.train(..., on_eval=fn)``)."""

    def __init__(self, fn: Callable[[dict], None]) -> None:
        self.fn = fn

    def record(self, record: dict, snapshot: Snapshot) -> None:
        self.fn(record)
