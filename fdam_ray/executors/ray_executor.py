"""Every client a Ray actor: object-store broadcast, streaming reduce, GPU shares, failures survived.

One round (ARCHITECTURE.md, "One round, as data"): the driver puts the global
state in the object store once (flat numpy buffers, read without a copy by
actors on the same node), calls ``local_round`` on every actor, and passes
each update to the reducer's ``fold`` as soon as it arrives (``ray.wait``), so
the driver maps one update at a time whatever K is. Float sums depend on
their order, so such a run matches the inline executor to float32 rounding
(about 1e-7 relative), not bit for bit. ``fold_order: client`` folds in client
order instead (an update that arrives early waits in the object store, not in
driver memory): runs are then bit-for-bit repeatable and equal to the inline
executor's, at the price of waiting for a late low-numbered client.

Placement: all actors live in one placement group of K bundles (``PACK`` by
default). When this code itself runs inside a placement group (a Ray Tune
trial: driver bundle 0, client bundles 1..K), the actors go into that group's
bundles 1..K instead of a new group.

Failures: an actor that dies (its process killed, ``ray.kill``, lost node),
raises, or does not answer within ``ray_timeout_s`` is replaced by a new
actor that rebuilds its shard, gets p, the current stage's reference point
and zero control variate, and re-runs the call; in a round it first sets its
c^k to the round's global c. ``on_client_failure`` says what happens when a
client fails more than ``max_client_retries`` times within one call: ``retry``
stops the run with the client's error, ``drop`` goes on without that client,
``abort`` stops at the first failure. A ``ValueError`` in client code (bad
data or config) is never retried. Every event is logged with client id and
round, and kept in :attr:`RayExecutor.events`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fdam_ray.client import ClientSection
from fdam_ray.data import DataSource
from fdam_ray.executors.base import Executor, ExecutorSection
from fdam_ray.executors.errors import ClientError, ClientInputError
from fdam_ray.executors.ray_actor import ClientShell
from fdam_ray.executors.ray_session import ensure_ray
from fdam_ray.state import ClientInfo, ClientUpdate, GlobalState, Moments, RoundPlan, Scores

log = logging.getLogger(__name__)

_RemoteShell = ray.remote(ClientShell)


class RayExecutor(Executor):
    """Runs each client in its own Ray actor (see the module docstring).

    Attributes:
        events: one dict per client failure (client, round, action, error, outcome).
        bundle_of: client id -> placement group bundle index.
    """

    def __init__(self) -> None:
        self.actors: dict[int, Any] = {}
        self.live: list[int] = []
        self.events: list[dict] = []
        self.bundle_of: dict[int, int] = {}
        self.placement_group: PlacementGroup | None = None
        self._own_group = False
        self._round = 0
        self._positive_ratio: np.ndarray | None = None
        self._reference_ref = None
        self._adopt_global_c: set[int] = set()
        self._test_size = 0
        self._put_state: GlobalState | None = None
        self._in_flight: dict[Any, tuple[int, float]] = {}
        self._put_ref = None

    # -- set-up ---------------------------------------------------------------------------
    def start(self, config: ExecutorSection, source: DataSource) -> list[ClientInfo]:
        self.config = config = ExecutorSection.of(config)
        self._client_section = ClientSection.of(config)
        self.timeout = config.ray_timeout_s
        num_clients = source.num_clients
        if config.device == "cuda" and not config.gpus_per_client:
            raise ValueError("device=cuda with executor=ray needs gpus_per_client > 0 (the GPU share of each client)")
        started_here = ensure_ray(address=config.address, cpus_needed=num_clients * config.cpus_per_client)
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus and not config.gpus_per_client and config.device != "cpu":
            per_gpu = -(-num_clients // max(1, int(gpus)))  # the clients spread evenly over the GPUs
            log.warning("the Ray cluster has %g GPU(s) but gpus_per_client=0, so the clients train on CPUs; set "
                        "gpus_per_client (e.g. %g for %d clients per GPU) to use them, or device=cpu to silence this",
                        gpus, round(1.0 / per_gpu, 4), per_gpu)
        self._place(num_clients, local=started_here)
        # A recipe goes to the object store once for every client; data held in memory (train_arrays) goes
        # one client's part per client, so no actor receives another client's samples.
        shared = ray.put(source) if source.for_client(0) is source else None
        self._source_refs = {k: shared if shared is not None else ray.put(source.for_client(k))
                             for k in range(num_clients)}
        self.live = list(range(num_clients))
        for k in self.live:
            self.actors[k] = self._new_actor(k)
        infos: list[ClientInfo] = []
        for _, (info, test_size) in self._each("start", self._setup_call):
            infos.append(info)
            self._test_size = test_size
        if len(infos) < num_clients:
            raise RuntimeError("clients were dropped while starting; a federation starts with all its clients")
        return infos

    def _setup_call(self, k: int, actor) -> Any:
        return actor.setup.remote(self._client_section, self._source_refs[k], self.config.eval_on == "clients")

    def _place(self, num_clients: int, *, local: bool) -> None:
        cfg = self.config
        current = get_current_placement_group()
        if current is not None:
            specs = current.bundle_specs
            if len(specs) < num_clients + 1:
                raise ValueError(f"this driver runs in a placement group of {len(specs)} bundles; a federation of "
                                 f"{num_clients} clients needs the driver's bundle 0 and client bundles "
                                 f"1..{num_clients}")
            for i in range(1, num_clients + 1):
                if specs[i].get("CPU", 0) < cfg.cpus_per_client or specs[i].get("GPU", 0) < cfg.gpus_per_client:
                    raise ValueError(f"bundle {i} of the enclosing placement group ({specs[i]}) is smaller than one "
                                     f"client (cpus_per_client={cfg.cpus_per_client}, "
                                     f"gpus_per_client={cfg.gpus_per_client})")
            self.placement_group, self._own_group = current, False
            self.bundle_of = {k: k + 1 for k in range(num_clients)}
            log.info("placing %d clients in bundles 1..%d of the enclosing placement group", num_clients, num_clients)
            return
        bundle = {"CPU": cfg.cpus_per_client, **({"GPU": cfg.gpus_per_client} if cfg.gpus_per_client else {})}
        need = {r: v * num_clients for r, v in bundle.items()}
        have = ray.cluster_resources()
        short = {r: (v, have.get(r, 0)) for r, v in need.items() if have.get(r, 0) + 1e-9 < v}
        if short:
            detail = ", ".join(f"{r}: {v:g} needed, {h:g} in the cluster" for r, (v, h) in short.items())
            if local:
                raise ValueError(f"{num_clients} clients need more than this machine offers ({detail}); lower "
                                 "cpus_per_client / gpus_per_client or num_clients")
            log.warning("the cluster cannot hold %d clients yet (%s); waiting up to %g s for nodes to join",
                        num_clients, detail, self.timeout)
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        if nodes and not any(all(res.get(r, 0) + 1e-9 >= v for r, v in bundle.items()) for res in nodes):
            largest = max(nodes, key=lambda res: (res.get("GPU", 0), res.get("CPU", 0)))
            raise ValueError(f"no node of the cluster can hold one client ({bundle}; the largest node has "
                             f"CPU {largest.get('CPU', 0):g}, GPU {largest.get('GPU', 0):g}): lower cpus_per_client / "
                             "gpus_per_client, or add nodes that large")
        group = placement_group([dict(bundle) for _ in range(num_clients)], strategy=cfg.placement_strategy)
        try:
            ray.get(group.ready(), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise RuntimeError(f"the placement group of {num_clients} client bundles {bundle} "
                               f"({cfg.placement_strategy}) was not placed within ray_timeout_s={self.timeout:g} s; "
                               f"cluster resources: {ray.cluster_resources()}") from None
        self.placement_group, self._own_group = group, True
        self.bundle_of = {k: k for k in range(num_clients)}

    def _new_actor(self, k: int):
        cfg = self.config
        threads = cfg.threads_per_client or max(1, int(cfg.cpus_per_client))
        strategy = PlacementGroupSchedulingStrategy(self.placement_group,
                                                    placement_group_bundle_index=self.bundle_of[k])
        return _RemoteShell.options(
            num_cpus=cfg.cpus_per_client, num_gpus=cfg.gpus_per_client, max_restarts=0, max_task_retries=0,
            scheduling_strategy=strategy,
        ).remote(k, threads=threads, device=cfg.device, gpu_share=cfg.gpus_per_client,
                 gpu_memory_cap=cfg.gpu_memory_cap)

    # -- calls on every client, with failures handled ---------------------------------------
    def _each(self, action: str, submit: Callable[[int, Any], Any],
              clients: list[int] | None = None, *, ordered: bool = True) -> Iterator[tuple[int, Any]]:
        """Call every live client (or ``clients``); yield ``(k, result)`` in client order, or with
        ``ordered=False`` as results arrive.

        In client order, results that arrive early are fetched (an error shows at
        once) but are views into the object store, touched only when consumed.
        """
        remaining = list(self.live if clients is None else clients)
        attempts = dict.fromkeys(remaining, 0)
        pending: dict[Any, tuple[int, float]] = {}
        self._in_flight = pending  # what is left of it when the run stops is settled at shutdown
        results: dict[int, Any] = {}

        def launch(k: int) -> None:
            pending[submit(k, self.actors[k])] = (k, time.monotonic() + self.timeout)

        for k in remaining:
            launch(k)
        while True:
            ready = remaining[:1] if ordered else list(remaining)
            settled = [k for k in ready if k in results or k not in self.live]
            if settled:
                for k in settled:
                    remaining.remove(k)
                    if k in results:
                        yield k, results.pop(k)
                continue
            if not remaining:
                return
            if not pending:
                raise RuntimeError(f"client {remaining[0]} has neither a result nor a call in flight")
            now = time.monotonic()
            wait_s = max(0.0, min(d for _, d in pending.values()) - now)
            done, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            for ref in done:
                kd, _ = pending.pop(ref)
                try:
                    results[kd] = ray.get(ref, timeout=self.timeout)
                except (ray.exceptions.RayError, ClientError) as exc:
                    if self._failed(kd, action, exc, attempts):
                        launch(kd)
            if not done:
                now = time.monotonic()
                for ref, (kd, deadline) in list(pending.items()):
                    if deadline <= now:
                        del pending[ref]
                        late = ClientError(kd, self._round, action,
                                           f"no answer within ray_timeout_s={self.timeout:g} s")
                        if self._failed(kd, action, late, attempts):
                            launch(kd)

    def _as_client_error(self, k: int, action: str, exc: BaseException) -> ClientError:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ClientError):
            return cause
        if isinstance(exc, ClientError):
            return exc
        if isinstance(exc, ray.exceptions.RayActorError):
            what, text = "its actor process died", str(exc)
        elif isinstance(exc, ray.exceptions.RayTaskError) and cause is not None:
            what, text = type(cause).__name__, str(cause)  # e.g. arguments that cannot be unpickled there
        else:
            what, text = type(exc).__name__, str(exc)
        lines = text.strip().splitlines()
        first = lines[0] if lines else ""
        return ClientError(k, self._round, action, f"{what}: {first}".rstrip(": "), "\n".join(lines[1:]))

    def _failed(self, k: int, action: str, exc: BaseException, attempts: dict[int, int]) -> bool:
        """Apply the failure policy to client ``k``; True: it was replaced (re-run the call), False: dropped."""
        cfg = self.config
        while True:
            err = self._as_client_error(k, action, exc)
            attempts[k] += 1
            if isinstance(err, ClientInputError) or cfg.on_client_failure == "abort":
                self._event(err, "abort")
                raise err
            if attempts[k] > cfg.max_client_retries:
                if cfg.on_client_failure == "drop":
                    self._event(err, "dropped")
                    self._drop(k)
                    return False
                self._event(err, "abort")
                err.add_note(f"client {k} failed {attempts[k]} times in this call (on_client_failure=retry, "
                             f"max_client_retries={cfg.max_client_retries})")
                raise err
            self._event(err, f"replaced (attempt {attempts[k]} of {cfg.max_client_retries})")
            try:
                self._replace(k)
                return True
            except (ray.exceptions.RayError, ClientError) as again:
                exc = again

    def _event(self, err: ClientError, outcome: str) -> None:
        self.events.append({"client": err.client_id, "round": err.round, "action": err.action, "error": err.error,
                            "outcome": outcome})
        log.warning("client %d failed in round %d (%s): %s -> %s", err.client_id, err.round, err.action, err.error,
                    outcome)

    def _settle(self, refs: list) -> None:
        """Fetch calls left in flight when a run stopped (another client's error, Ctrl+C), ignoring their
        outcome: Ray would otherwise print an "Unhandled error" traceback for each one that failed."""
        if not refs:
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception as exc:  # the run has already stopped for another reason
                log.debug("a call abandoned when the run stopped ended with %s", type(exc).__name__)

    def _kill(self, k: int) -> None:
        actor = self.actors.pop(k, None)
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already gone
                log.debug("kill of client %d's actor: %s", k, exc)

    def _drop(self, k: int) -> None:
        self._kill(k)
        self.live.remove(k)
        if not self.live:
            raise RuntimeError("every client has been dropped; the federation cannot go on")

    def _replace(self, k: int) -> None:
        """A new actor for client ``k`` with its shard, p, the stage's reference and c^k = 0 (global c next round)."""
        self._kill(k)
        actor = self.actors[k] = self._new_actor(k)
        calls = [self._setup_call(k, actor)]
        if self._positive_ratio is not None:
            calls.append(actor.configure.remote(self._positive_ratio))
        if self._reference_ref is not None:
            calls.append(actor.begin_stage.remote(self._reference_ref, True))
        for ref in calls:
            ray.get(ref, timeout=self.timeout)
        self._adopt_global_c.add(k)

    def _state_ref(self, state: GlobalState):
        """The object-store copy of ``state`` for the scoring calls that follow a round (evaluation on the
        clients' splits and on the test set, CODA's score sums): put once for all of them. A round puts its
        state afresh, since the driver changes a state in place only between scoring and the next round."""
        if self._put_state is not state:
            self._put_state, self._put_ref = state, ray.put(state)
        return self._put_ref

    # -- the Executor interface ---------------------------------------------------------------
    def configure(self, positive_ratio: np.ndarray) -> None:
        self._positive_ratio = np.asarray(positive_ratio)
        for _ in self._each("configure", lambda k, a: a.configure.remote(self._positive_ratio)):
            pass

    def begin_stage(self, reference: np.ndarray, reset_control_variates: bool) -> None:
        self._reference_ref = ref = ray.put(reference)
        for _ in self._each("begin_stage", lambda k, a: a.begin_stage.remote(ref, reset_control_variates)):
            pass

    def run_round(self, state: GlobalState, plan: RoundPlan, fold: Callable[[ClientUpdate], None],
                  clients: Sequence[int] | None = None) -> None:
        self._round = plan.round
        ref = ray.put(state)  # always fresh: the driver may have changed the state since it was last put
        self._put_state = None

        def call(k: int, actor) -> Any:
            return actor.local_round.remote(ref, plan, k in self._adopt_global_c)

        chosen = None if clients is None else [k for k in clients if k in self.live]
        for k, update in self._each("local_round", call, chosen, ordered=self.config.fold_order == "client"):
            fold(update)
            del update
            self._adopt_global_c.discard(k)

    def evaluate(self, state: GlobalState) -> list[Scores]:
        ref = self._state_ref(state)
        return [s for _, s in self._each("evaluate", lambda k, a: a.evaluate.remote(ref)) if s is not None]

    def score_test_set(self, state: GlobalState) -> Scores | None:
        """With ``eval_on: clients``: every live client scores a slice of the global test set, pooled here."""
        if self.config.eval_on != "clients" or self._test_size == 0:
            return None
        while True:
            clients = list(self.live)
            bounds = np.linspace(0, self._test_size, min(len(clients), self._test_size) + 1).astype(int)
            slices = {k: (int(a), int(b)) for k, a, b in zip(clients, bounds[:-1], bounds[1:], strict=False)}
            ref = self._state_ref(state)

            def call(k: int, actor, slices=slices, ref=ref) -> Any:
                return actor.score_test_slice.remote(ref, *slices[k])

            parts = list(self._each("evaluate", call, clients=list(slices)))
            if all(k in self.live for k in slices):  # a client dropped mid-call: slice again
                parts.sort(key=lambda p: slices[p[0]][0])
                return Scores(-1, np.concatenate([s.scores for _, s in parts]),
                              np.concatenate([s.labels for _, s in parts]))

    def score_moments(self, state: GlobalState) -> list[Moments]:
        ref = self._state_ref(state)
        return [m for _, m in self._each("score_moments", lambda k, a: a.score_moments.remote(ref))]

    def client_states(self) -> list[dict | None]:
        """Every client's state; None for a client that was dropped."""
        got = dict(self._each("client_states", lambda k, a: a.get_state.remote()))
        return [got.get(k) for k in range(len(self.bundle_of))]

    def restore_client_states(self, states: list[dict | None]) -> None:
        for k, s in enumerate(states):
            if s is None and k in self.live:
                log.warning("client %d was dropped before the checkpoint; it stays out", k)
                self._drop(k)
        for _ in self._each("restore_client_states", lambda k, a: a.set_state.remote(states[k])):
            pass

    @property
    def active_clients(self) -> int:
        return len(self.live)

    def client_info(self) -> dict[int, dict]:
        """Process id, node, placement group and device of every live client's actor."""
        return dict(self._each("where", lambda k, a: a.where.remote()))

    def shutdown(self) -> None:
        abandoned = list(self._in_flight)
        for k in list(self.actors):
            self._kill(k)
        self._settle(abandoned)
        if self._own_group and self.placement_group is not None:
            remove_placement_group(self.placement_group)
        self.placement_group, self._own_group = None, False
