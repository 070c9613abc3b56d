"""The actor's side of ``transport: compiled``: the round on the graph's thread, and how it went.

A part of the actor shell (:class:`~fdam_ray.executors.ray.actor.ClientShell`
inherits it): :meth:`CompiledActor.compiled_round` is the task the round's
graph binds on every actor (:mod:`fdam_ray.executors.ray.transports.compiled`),
run on the graph's background thread; :meth:`CompiledActor.round_status` is a
classic call, answered on the actor's main thread even while that runs, from
which the driver recovers a round when the graph breaks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.executors.ray.transports.patience import patient_reads

if TYPE_CHECKING:
    from fdam_ray.core.state import GlobalState, RoundPlan
    from fdam_ray.executors.transfer import Broadcast, CompressedSum


class CompiledActor:
    """The compiled transport's part of an actor: its compiled round and that round's status."""

    actor: int

    if TYPE_CHECKING:  # the shell's, which this part calls
        def local_round(self, state: GlobalState | Broadcast, plan: RoundPlan, client_ids: Sequence[int],
                        adopt_global_c: Sequence[int] = (), undoable: bool = False) -> PartialSum | CompressedSum:
            ...

    def _start_compiled(self, channel_wait: str) -> None:
        """Set up this part (from the shell's ``__init__``): ``channel_wait``, how this process's reads of the
        graph's channels wait (``sleep`` or ``spin``)."""
        # how the last compiled round went, (round, "running" | "done" | "failed" | "withdrawn", value); set on
        # the graph's thread, read on the main thread
        self._status: tuple[int, str, object] | None = None
        self._status_lock = threading.Lock()
        patient_reads(channel_wait == "sleep")  # only the compiled graph's thread reads channels here

    def compiled_round(self, message: tuple) -> PartialSum | None:
        """One round under ``transport: compiled`` (on the graph's thread): ``message`` is
        ``(state, plan, calls)`` with ``calls`` mapping an actor index to its ``(client_ids, adopt_global_c)``;
        an actor with no client in the round returns None.

        How it ended stays readable by :meth:`round_status` (a classic call, answered on the actor's main
        thread even while this runs), so the driver can recover the round when the graph breaks.
        """
        state, plan, calls = message
        ids, adopt = calls.get(self.actor, ((), ()))
        with self._status_lock:
            if self._status is not None and self._status[:2] == (plan.round, "withdrawn"):
                return None  # the driver was told "not started" and runs this round with a classic call
            self._status = (plan.round, "running", None)
        if not ids:
            self._status = (plan.round, "done", None)
            return None
        try:
            # a compiled round carries a float32 state (transfer_precision bf16/fp16 refuses transport=compiled)
            partial = cast(PartialSum, self.local_round(state, plan, ids, adopt))
        except BaseException as exc:
            self._status = (plan.round, "failed", exc)
            raise
        self._status = (plan.round, "done", partial)
        return partial

    def round_status(self, round_index: int) -> tuple[str, PartialSum | BaseException | None]:
        """How this actor's compiled round ``round_index`` went: ``("done", partial sum or None)``,
        ``("failed", error)``, ``("running", None)`` or ``("not started", None)``.

        "not started" withdraws the round from the graph: should its input still reach this actor, the graph's
        thread does not run it (the driver re-runs it with a classic call, and it must not run twice).
        """
        with self._status_lock:
            status = self._status
            if status is None or status[0] != round_index or status[1] == "withdrawn":
                self._status = (round_index, "withdrawn", None)
                return "not started", None
            return status[1], cast(PartialSum | BaseException | None, status[2])
