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

import numpy as np

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.client import ClientSection
from fdam_ray.data import DataSource
from fdam_ray.state import ClientInfo, GlobalState, Moments, RoundPlan, Scores


def actor_groups(num_clients: int, clients_per_actor: int) -> list[list[int]]:
    """The clients of each host: client k on host k // clients_per_actor (the last host may have fewer)."""
    m = max(1, clients_per_actor)
    return [list(range(a, min(a + m, num_clients))) for a in range(0, num_clients, m)]


@dataclasses.dataclass(frozen=True)
class ExecutorSection(ClientSection):
    """What an executor reads of the config: how its clients run, plus what each client needs.

    Only the :class:`~fdam_ray.client.ClientSection` part travels to a client.
    """

    device: str
    threads_per_actor: int | None
    address: str | None
    clients_per_actor: int
    cpus_per_actor: float
    gpus_per_actor: float
    placement_strategy: str
    gpu_memory_cap: bool
    fold_order: str
    eval_on: str
    on_client_failure: str
    max_client_retries: int
    ray_timeout_s: float
    client_resources: tuple[dict, ...] | None
    reduce: str
    transport: str
    channel_wait: str
    placement_timeout_s: float


class Executor(abc.ABC):
    """Runs the clients of one federation."""

    @abc.abstractmethod
    def start(self, config: ExecutorSection, source: DataSource) -> list[ClientInfo]:
        """Create the K clients (each builds its own shard) and return what they report.

        ``config`` is read as an :class:`ExecutorSection` (a full config has its fields too).
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

    @abc.abstractmethod
    def evaluate(self, state: GlobalState) -> list[Scores]:
        """Scores of ``state`` on the clients' own test splits (clients without one are left out)."""

    @abc.abstractmethod
    def score_moments(self, state: GlobalState) -> list[Moments]:
        """Every client's score sums over its training positives and negatives."""

    @abc.abstractmethod
    def client_states(self) -> list[dict]:
        """Every client's resumable state (``Client.get_state()``: control variate, sampler position)."""

    @abc.abstractmethod
    def restore_client_states(self, states: list[dict]) -> None:
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
