"""How the K clients of a federation run: the interface every executor implements.

The driver loop (:mod:`fdam_ray.federation`) talks only to this interface; the
algorithms never see it. An executor owns the clients, hands each round's
global state to all of them and passes every client update to the
driver's ``fold`` callback as soon as it has it (so nothing holds K updates at
once). The clients are hosted ``clients_per_actor`` to a model replica (an actor
under Ray); each host returns its round's updates already folded into one
:class:`~fdam_ray.algorithms.server.PartialSum`, so ``fold`` receives one
partial sum per host.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.data import DataSource
from fdam_ray.sections import AT_LEAST_ONE, NONNEGATIVE, Section, setting
from fdam_ray.state import ClientInfo, ClientState, GlobalState, Moments, RoundPlan, Scores, StepStats

if TYPE_CHECKING:
    from fdam_ray.config import Config


def actor_groups(num_clients: int, clients_per_actor: int) -> list[list[int]]:
    """The clients of each host: client k on host k // clients_per_actor (the last host may have fewer)."""
    m = max(1, clients_per_actor)
    return [list(range(a, min(a + m, num_clients))) for a in range(0, num_clients, m)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutorSection(Section):
    """What any executor reads of the config: which executor, where and how its clients run.

    An executor is given the full config and cuts the sections it needs: this one,
    :class:`~fdam_ray.client.ClientSection` (all a client receives), and the Ray executor's
    :class:`~fdam_ray.executors.ray_section.RaySection`.
    """

    name = "executor"

    executor: str = setting("ray", "ray: every client a Ray actor, all in parallel; inline: every client in the "
                            "driver process, one after another (debuggers work).", choices=("ray", "inline"),
                            resume=True)
    device: str = setting("auto", "auto uses a GPU when one is visible.", choices=("auto", "cpu", "cuda"), resume=True)
    clients_per_actor: int = setting(1, "M, clients each host runs one after another on one model replica (each "
                                     "keeps its own shard, control variate and sampler position; the host returns "
                                     "their updates folded into one partial sum); ceil(K / M) Ray actors; 1 = one "
                                     "actor per client.", check=AT_LEAST_ONE, resume=True)
    threads_per_actor: int | None = setting(None, "torch intra-op threads per actor process (inline: of the "
                                            "driver while the clients run; threads_per_client is read as this when "
                                            "clients_per_actor = 1); null = as cpus_per_actor says (Ray), one "
                                            "(inline, unless OMP_NUM_THREADS is set).", check=AT_LEAST_ONE,
                                            resume=True)
    eval_on: str = setting("clients", "Where the global model is scored: clients (each actor scores a slice of the "
                           "test set, in parallel) or driver.", choices=("clients", "driver"), resume=True)
    on_client_failure: str = setting("retry", "A client actor that dies or raises: retry (replace it and re-run its "
                                     "call, at most max_client_retries times, then stop the run), drop (the same "
                                     "retries, then go on without it) or abort (stop at once).",
                                     choices=("retry", "drop", "abort"), resume=True)
    max_client_retries: int = setting(2, "Replacements of one client within one call before on_client_failure "
                                      "gives up on it.", check=NONNEGATIVE, resume=True)


@dataclasses.dataclass
class RoundsRun:
    """What :meth:`Executor.run_rounds` returns: the rounds of a run that were applied, in order, and why it
    stopped early, if it did (an applied round's server step was applied where the clients are).

    Attributes:
        stats: per applied round, its clients' step statistics (in actor order); then, when the run stopped on
            a client's non-finite update (``stop == "diverged"``), that round's statistics.
        counts: per applied round, the clients whose updates it folded.
        bytes_up: per applied round, the bytes its clients sent.
        state: the global state after the last applied round (None when no round was applied).
        ref_sum: the float64 sum of v over the applied rounds (asked for with ``average``), else None.
        stop: '' (every round was applied), ``diverged`` (the round after the applied ones had a non-finite
            client update; it was not applied), ``stale`` (the state after the last applied round is not
            finite) or ``failed`` (an actor failed in the run: it was undone, no round of it applied, the failure
            policy has run, and its rounds are to be run again one at a time, by :meth:`Executor.run_round`).
    """

    stats: list[list[StepStats]]
    counts: list[int]
    bytes_up: list[int]
    state: GlobalState | None
    ref_sum: np.ndarray | None = None
    stop: str = ""

    @property
    def applied(self) -> int:
        return len(self.counts)


class Executor(abc.ABC):
    """Runs the clients of one federation."""

    @abc.abstractmethod
    def start(self, config: Config, source: DataSource) -> list[ClientInfo]:
        """Create the K clients (each builds its own shard) and return what they report.

        ``config`` is the full config: the executor cuts the sections it reads (:class:`ExecutorSection`, its own
        section, and :class:`~fdam_ray.client.ClientSection`, the only part that travels to a client).
        """

    @abc.abstractmethod
    def configure(self, positive_ratio: np.ndarray) -> None:
        """Give every client the global positive ratio p."""

    @abc.abstractmethod
    def begin_stage(self, reference: np.ndarray, reset_control_variates: bool) -> None:
        """Start a stage on every client: proximal centre and (optionally) zero control variates."""

    @abc.abstractmethod
    def run_round(self, state: GlobalState, plan: RoundPlan, fold: Callable[[PartialSum], None],
                  clients: Sequence[int] | None = None) -> None:
        """Run one round from ``state`` on every client (or on ``clients``, the round's sample); call ``fold``
        once per host that ran clients, with the partial sum of their (weighted) updates.

        ``fold`` must not hold the partial sum past the round: it may be a view of a buffer the next round
        writes again (the compiled transport's output channels), so a fold that keeps one keeps a copy."""

    def rounds_ahead(self) -> int:
        """The most rounds :meth:`run_rounds` takes in one go; 1: this executor runs one round at a time (the
        federation then calls :meth:`run_round` for every round)."""
        return 1

    def run_rounds(self, state: GlobalState, plans: Sequence[tuple[RoundPlan, Sequence[int] | None]],
                   average: bool) -> RoundsRun:
        """Run ``plans`` (each with its sampled clients, or None for every client) back to back from ``state``,
        the server step applied where the clients are, without handing the driver each round's state; for at
        most :meth:`rounds_ahead` plans. ``average``: also return the sum of v over the rounds."""
        raise NotImplementedError(f"{type(self).__name__} runs one round at a time")

    @abc.abstractmethod
    def evaluate(self, state: GlobalState, split: str = "test") -> list[Scores]:
        """Scores of ``state`` on the clients' own test splits, or with ``split="val"`` their validation parts
        (clients without one are left out)."""

    @abc.abstractmethod
    def score_moments(self, state: GlobalState) -> list[Moments]:
        """Every client's score sums over its training positives and negatives."""

    @abc.abstractmethod
    def client_states(self) -> list[ClientState | None]:
        """Every client's resumable state (``Client.get_state()``: control variate, sampler position); None for a
        client that was dropped."""

    @abc.abstractmethod
    def restore_client_states(self, states: list[ClientState | None]) -> None:
        """Give every client back the state :meth:`client_states` returned (``Client.set_state``)."""

    @property
    @abc.abstractmethod
    def active_clients(self) -> int:
        """How many clients take part in rounds now (fewer than K after a client was dropped)."""

    def score_test_set(self, state: GlobalState) -> Scores | None:
        """Scores of ``state`` on the global test set computed by the clients, or None: the driver scores it."""
        return None

    def shutdown(self) -> None:  # noqa: B027 (optional hook)
        """Release the clients."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
