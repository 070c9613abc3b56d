"""How the K clients of a federation run: the interface every executor implements.

The driver loop (`fdam_ray.loop.federation`) talks only to this interface; the
algorithms never see it. An executor owns the clients, hands each round's
global state to all of them and passes every client update to the
driver's ``fold`` callback as soon as it has it (so nothing holds K updates at
once). The clients are hosted ``clients_per_actor`` to a model replica (an actor
under Ray); each host returns its round's updates already folded into one
`PartialSum`, so ``fold`` receives one
partial sum per host.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.clients.client import ClientSection
from fdam_ray.clients.face import NO_FACE, ClientFace
from fdam_ray.core.state import (
    ClientInfo,
    ClientState,
    GlobalState,
    RoundPlan,
    ScoreHistogram,
    Scores,
    ScoreSums,
    StepStats,
)
from fdam_ray.data import DataSource
from fdam_ray.executors.deadlines import DeadlineSection
from fdam_ray.executors.transfer import Downlink, TransferSection
from fdam_ray.scores.histogram import Binning
from fdam_ray.settings.sections import AT_LEAST_ONE, NONNEGATIVE, Section, setting

if TYPE_CHECKING:
    from fdam_ray.algorithms import Algorithm


def actor_groups(num_clients: int, clients_per_actor: int) -> list[list[int]]:
    """The clients of each host: client k on host k // clients_per_actor (the last host may have fewer)."""
    m = max(1, clients_per_actor)
    return [list(range(a, min(a + m, num_clients))) for a in range(0, num_clients, m)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutorSection(Section):
    """What any executor reads of the config: which executor, where and how its clients run (an executor that
    reads more declares a wider section as its :attr:`Executor.section`, as the Ray executor's
    :class:`~fdam_ray.executors.ray_section.RayExecutorSection` is)."""

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutorSetup:
    """Everything an executor runs its clients by, cut from the config once, by the federation
    ([`ExecutorSetup.cut`][fdam_ray.executors.base.ExecutorSetup.cut]): no executor reads the config itself.

    Attributes:
        algorithm: the algorithm the federation built (client weights, the server step's settings).
        executor: the executor's own section (an instance of its class's `Executor.section`).
        client: all that travels to a client (`ClientSection`).
        transfer: what a transfer rounds (``transfer_precision``, ``error_feedback``).
        deadline: the round deadline and the fewest clients a round needs.
        run_config: the config's plain values (YAML types only), for an executor whose clients are built in
            processes of their own from them (a Flower site) and to tell one run from another.
        face: a plug's client face (`fdam_ray.clients.face`), handed to every client as it is (the
            plug that does nothing: no face), put here by the plug (`fdam_ray.loop.plug.Plug.setup`).
    """

    algorithm: Algorithm
    executor: ExecutorSection
    client: ClientSection
    transfer: TransferSection
    deadline: DeadlineSection
    run_config: Mapping[str, Any]
    face: ClientFace = NO_FACE

    @classmethod
    def cut(cls, config: Section, algorithm: Algorithm, section: type[ExecutorSection]) -> ExecutorSetup:
        """The setup cut from ``config``, the run's whole config (a section holding every field; its
        ``to_dict()`` gives the plain values): this module knows only the sections it cuts."""
        return cls(algorithm=algorithm, executor=section.of(config), client=ClientSection.of(config),
                   transfer=TransferSection.of(config), deadline=DeadlineSection.of(config),
                   run_config=config.to_dict())

    @classmethod
    def for_config(cls, config: Section, section: type[ExecutorSection] = ExecutorSection) -> ExecutorSetup:
        """The setup of ``config`` with its algorithm built here (a federation passes the one it built to
        [`cut`][fdam_ray.executors.base.ExecutorSetup.cut]): for starting an executor outside a federation (tests,
        benchmarks)."""
        from fdam_ray.algorithms import AlgorithmSection, build_algorithm

        return cls.cut(config, build_algorithm(AlgorithmSection.of(config)), section)


@dataclasses.dataclass
class RoundsRun:
    """What [`RunsOfRounds.run_rounds`][fdam_ray.executors.base.RunsOfRounds.run_rounds] returns: the rounds of a run
    that were applied, in order, and why it stopped early, if it did (an applied round's server step was applied where
    the clients are).

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
            policy has run, and its rounds are to be run again one at a time, by
            [`Executor.run_round`][fdam_ray.executors.base.Executor.run_round]).
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
    """Runs the clients of one federation.

    The abstract members are what every executor implements; the others have defaults an executor overrides
    when it has more to say (bytes its broadcast moved, transfer state to checkpoint, where its clients run, the
    changes of c^k a deadline round needs). Running several rounds in one call is a second interface,
    [`RunsOfRounds`][fdam_ray.executors.base.RunsOfRounds], that an executor adds when it can.
    """

    section: ClassVar[type[ExecutorSection]] = ExecutorSection  # what it reads of the config
    downlink: Downlink | None = None  # transfer_precision bf16/fp16: the driver's side of the rounded broadcast
    sent: int | None = None  # bytes one client received in the last round's broadcast (None: the state's)
    # whether its clients are built from ``ExecutorSetup.client`` (settings the driver resolves, such as the privacy
    # noise of dp: client, reach them); False for one whose clients are built elsewhere from the plain config
    clients_from_setup: ClassVar[bool] = True
    # whether a round may lack a client on its own (Flower: a site past round_timeout_s); its rounds are then recorded
    # (the participation record, fdam_ray/executors/deadlines.py) as under a deadline
    leaves_clients_out: ClassVar[bool] = False
    # whether a replay can rebuild a client at a given round (:meth:`rebuild`): a record of rebuilt clients is refused
    # before the run otherwise
    rebuilds_clients: ClassVar[bool] = False

    @abc.abstractmethod
    def start(self, setup: ExecutorSetup, source: DataSource) -> list[ClientInfo]:
        """Create the K clients (each builds its own shard, from ``setup.client``) and return what they report."""

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

    def broadcast_nbytes(self, state: GlobalState) -> int:
        """The bytes one client received of the last round's broadcast of ``state`` (rounded transfers move
        fewer than the state's own)."""
        return state.nbytes if self.sent is None else self.sent

    def transfer_state(self) -> dict | None:
        """The broadcast's driver state for a checkpoint (None with fp32 transfers)."""
        return None if self.downlink is None else self.downlink.state_dict()

    def restore_transfer_state(self, state: dict | None) -> None:
        """Take back what [`transfer_state`][fdam_ray.executors.base.Executor.transfer_state] returned (a resume)."""
        if self.downlink is not None:
            self.downlink.load_state_dict(state)

    def placement_lines(self) -> list[str]:
        """Lines saying where each client runs, logged at the run's start (none when it runs in this process)."""
        return []

    def round_changes(self, round_index: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """After a round of ``round_index`` that a client missed by its deadline: the weighted sums of the changes
        of c^k of the hosts that made it, in the order their partial sums were folded
        (`as_sampled_round`). Only an executor with round deadlines has them."""
        raise NotImplementedError(f"{type(self).__name__} has no round deadlines (round_deadline needs executor=ray)")

    def take_rebuilt(self) -> dict[int, list[int]]:
        """Round -> the clients whose update it folded as a rebuilt client's first (a fresh client from its shard,
        c^k = that round's global c: its actor was replaced, its site lost its state), for the rounds since the
        last call; the loop records them (``LoopState.rebuilt``) and a replay rebuilds them then
        ([`rebuild`][fdam_ray.executors.base.Executor.rebuild], ``fdam_ray.executors.rebuilds``)."""
        return {}

    def rebuild(self, client_ids: Sequence[int], state: GlobalState) -> None:
        """A replay: clients ``client_ids`` run the next round, from ``state``, as rebuilt clients (a fresh client
        from its shard: fresh sampler, zero optimiser buffers, c^k = the global c of ``state``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot rebuild a client at a given round (such a record "
                                  "is refused before the run: fdam_ray.executors.rebuilds.refuse_unreplayable)")

    @abc.abstractmethod
    def evaluate(self, state: GlobalState, split: str = "test",
                 bins: Binning | None = None) -> list[Scores] | list[ScoreHistogram]:
        """Scores of ``state`` on the clients' own test splits, or with ``split="val"`` their validation parts
        (clients without one are left out); with ``bins`` (``test_scores: histogram``) each client's
        `ScoreHistogram` instead (``Client.score_histogram``): no per-sample score
        or label leaves a client. ``bins`` (`Binning`: the number of bins and,
        on the driver's second pass, a score range per task) reaches every client unchanged."""

    @abc.abstractmethod
    def score_sums(self, state: GlobalState) -> list[ScoreSums]:
        """Every client's score sums over its training positives and negatives."""

    @abc.abstractmethod
    def client_states(self) -> list[ClientState | None]:
        """Every client's resumable state (``Client.get_state()``: control variate, sampler position); None for a
        client that was dropped."""

    @abc.abstractmethod
    def restore_client_states(self, states: list[ClientState | None]) -> None:
        """Give every client back the state [`client_states`][fdam_ray.executors.base.Executor.client_states] returned
        (``Client.set_state``)."""

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


class RunsOfRounds(abc.ABC):
    """An executor that can run several rounds in one call, the server step applied where the clients are (the
    collective transport's runs of rounds): the federation hands it the plans up to the next round whose state the
    driver needs."""

    @abc.abstractmethod
    def rounds_ahead(self) -> int:
        """The most rounds [`run_rounds`][fdam_ray.executors.base.RunsOfRounds.run_rounds] takes in one go now; 1: one
        round at a time (the federation then calls [`Executor.run_round`][fdam_ray.executors.base.Executor.run_round]
        for every round)."""

    def runs_every_round(self) -> bool:
        """Whether a round alone goes through [`run_rounds`][fdam_ray.executors.base.RunsOfRounds.run_rounds] too (a
        round deadline kept where the clients are); the default: no."""
        return False

    @abc.abstractmethod
    def run_rounds(self, state: GlobalState, plans: Sequence[tuple[RoundPlan, Sequence[int] | None]],
                   average: bool, *, read: bool = True) -> RoundsRun:
        """Run ``plans`` (each with its sampled clients, or None for every client) back to back from ``state``,
        the server step applied where the clients are, without handing the driver each round's state; for at
        most [`rounds_ahead`][fdam_ray.executors.base.RunsOfRounds.rounds_ahead] plans. ``average``: also return the sum
        of v over the rounds. ``read``: whether the driver reads the state after the run (an evaluation, a
        checkpoint, the end); when False the executor may leave it where the clients are until it is read."""
