"""A plug: a mechanism that acts on a run (differential privacy today), with at most three faces
(docs/architecture.md, "Plugs").

- the client face (:class:`~fdam_ray.clients.face.ClientFace`), which the plug puts into the executor's setup
  (:meth:`Plug.setup`) and every executor hands to its clients;
- the server face (:meth:`Plug.reducer`): the round's reducer, built wrapped by the plug, never patched after;
- the driver face, called by the federation at its hooks: the start (:meth:`Plug.setup`, :meth:`Plug.started`),
  who takes part in a round (:meth:`Plug.sampler`), what a round's plan carries to the clients
  (:meth:`Plug.round_plan`), before a round (:meth:`Plug.before_round`: a stop), after it
  (:meth:`Plug.after_round`), at an evaluation (:meth:`Plug.evaluation`: what of the pooled counts is released;
  :meth:`Plug.record`), at a checkpoint (:meth:`Plug.state`) and
  at the end (:meth:`Plug.summary`).

:class:`Plug` is the plug that does nothing: the federation calls every hook of whatever plug it was built with,
so it has no branch of its own for a mechanism. A plug is built at the top (``fdam_ray.assembly``) from the
config's sections; the federation knows only this interface.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from fdam_ray.algorithms.sampling import ClientSampler
    from fdam_ray.algorithms.server import RoundReducer
    from fdam_ray.core.flat import FlatModel
    from fdam_ray.core.state import RoundPlan
    from fdam_ray.data import DataSource
    from fdam_ray.executors.base import Executor, ExecutorSetup


@dataclasses.dataclass(frozen=True)
class PlugStart:
    """What a plug may read when the run starts (:meth:`Plug.setup`): the executor (whether its clients are built
    from the setup, ``Executor.clients_from_setup``), the data source, the driver's replica and a resumed run's
    checkpoint entry of this plug (:meth:`Plug.state`), or None."""

    executor: Executor
    source: DataSource
    flat: FlatModel
    state: dict | None


@dataclasses.dataclass(frozen=True)
class Released:
    """What an evaluation releases of one split's pooled counts (:meth:`Plug.evaluation`): ``counts`` ``(T, 2, B)``
    to read the AUC off (the summed int64 counts unchanged, or float64 ones a plug noised), whether the per-site
    AUCs may be recorded (``per_site``), and whether the driver may ask the sites for refinement passes
    (``refine``; each pass would be a further release of the same records)."""

    counts: np.ndarray
    per_site: bool = True
    refine: bool = True


class Plug:
    """The plug that does nothing (the module's docstring). Subclasses override the hooks they act at."""

    # whether the executor may run several rounds in one call (the collective's runs of rounds apply the server
    # step where the clients are, so a plug with a server face or a per-round hook must say no)
    runs_of_rounds: bool = True
    # whether an evaluation is released as pooled counts only (:meth:`evaluation`): the driver's own test set is then
    # binned too, not scored exactly
    counts_only: bool = False

    # -- the start ---------------------------------------------------------------------
    def setup(self, setup: ExecutorSetup, start: PlugStart) -> ExecutorSetup:
        """The executor's setup with what the clients act by (its :attr:`~ExecutorSetup.face`)."""
        return setup

    def started(self, num_train: list[int]) -> None:
        """The clients have started and report ``num_train`` (n_k by client id)."""

    def sampler(self, default: ClientSampler) -> ClientSampler:
        """Who takes part in each round: ``default`` (keyed by the run's seed) unless the plug keys the draw."""
        return default

    # -- a round -----------------------------------------------------------------------
    def round_plan(self, plan: RoundPlan) -> RoundPlan:
        """Round ``plan.round``'s plan as the clients receive it: ``plan`` itself, or one carrying the plug's value
        of the round (``RoundPlan.clip``: adaptive clipping's C_r), a function of released values only."""
        return plan

    def before_round(self, plan: RoundPlan, clients: list[int] | None) -> str | None:
        """A line saying why the run stops before round ``plan.round`` (asked of ``clients``, None: all), or
        None to run it."""
        return None

    def reducer(self, reducer: RoundReducer, plan: RoundPlan) -> RoundReducer:
        """Round ``plan.round``'s reducer: ``reducer`` itself, or one the plug builds around it."""
        return reducer

    def after_round(self, plan: RoundPlan, clients: list[int] | None, reported: int) -> None:
        """Round ``plan.round`` was applied: asked of ``clients`` (None: all), ``reported`` of them reached the
        server."""

    # -- evaluations, records, checkpoints, the end ---------------------------------------
    def evaluation(self, split: str, counts: np.ndarray) -> Released:
        """What is released of ``split``'s (``test`` or ``val``) per-class score counts summed over its records,
        ``(T, 2, B)`` int64, at an evaluation: by default the counts themselves, per-site AUCs and refinement."""
        return Released(counts)

    def record(self) -> dict[str, Any]:
        """Keys added to each evaluation's metrics record."""
        return {}

    def state(self) -> dict | None:
        """The plug's checkpoint entry (plain values), or None when it keeps nothing."""
        return None

    def summary(self) -> dict[str, Any]:
        """Keys added to the run's summary."""
        return {}


NO_PLUG = Plug()
