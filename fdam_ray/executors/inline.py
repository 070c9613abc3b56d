"""All clients in the driver process, one after another, hosted by one model replica.

This is the debugging executor that replaces Ray's removed ``local_mode``:
client code runs in the caller's process and thread, so ``breakpoint()``, a
debugger or a profiler work in it. Its results are the reference the Ray
executor is tested against.

One :class:`~fdam_ray.client.TrainingReplica` runs every client (each keeps its
own shard, sampler position and control variate), so memory grows by a
client's state, not by a model, per client. Updates are folded in the groups a
Ray run with the same ``clients_per_actor`` folds them in (clients
``a*M .. a*M+M-1`` into one partial sum, the groups in order), so an inline run
equals a Ray run with ``fold_order: client`` to the bit, whatever
``clients_per_actor`` is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.client import Client, ClientSection, begin_stage_hosted, host_clients, resolve_device, run_hosted
from fdam_ray.data import DataSource
from fdam_ray.executors.base import Executor, ExecutorSection, actor_groups
from fdam_ray.state import ClientInfo, GlobalState, Moments, RoundPlan, Scores


class InlineExecutor(Executor):
    def __init__(self) -> None:
        self.clients: list[Client] = []
        self.groups: list[list[int]] = []

    def start(self, config: ExecutorSection, source: DataSource) -> list[ClientInfo]:
        if config.threads_per_actor:
            torch.set_num_threads(config.threads_per_actor)
        device = resolve_device(config.device)
        self.clients = host_clients(ClientSection.of(config), source, range(source.num_clients), device=device)
        self.groups = actor_groups(source.num_clients, config.clients_per_actor)
        return [c.info() for c in self.clients]

    def configure(self, positive_ratio: np.ndarray) -> None:
        for c in self.clients:
            c.configure(positive_ratio)

    def begin_stage(self, reference: np.ndarray, reset_control_variates: bool) -> None:
        begin_stage_hosted(self.clients, reference, reset_control_variates)

    def run_round(self, state: GlobalState, plan: RoundPlan, fold: Callable[[PartialSum], None],
                  clients: Sequence[int] | None = None) -> None:
        chosen = None if clients is None else set(clients)
        for group in self.groups:
            hosted = [self.clients[k] for k in group if chosen is None or k in chosen]
            if hosted:  # a partial sum per group, as the actor hosting the group returns it
                fold(run_hosted(hosted, state, plan))

    def evaluate(self, state: GlobalState) -> list[Scores]:
        return [s for s in (c.evaluate(state) for c in self.clients) if s is not None]

    def score_moments(self, state: GlobalState) -> list[Moments]:
        return [c.score_moments(state) for c in self.clients]

    def client_states(self) -> list[dict | None]:
        return [c.get_state() for c in self.clients]

    def restore_client_states(self, states: list[dict | None]) -> None:
        dropped = [k for k, s in enumerate(states) if s is None]
        if dropped:
            raise ValueError(f"client(s) {dropped} were dropped from the run being resumed; the inline executor "
                             "runs every client: resume it with executor=ray")
        for c, s in zip(self.clients, states, strict=True):
            c.set_state(cast(dict, s))  # None refused above

    @property
    def active_clients(self) -> int:
        return len(self.clients)

    def shutdown(self) -> None:
        self.clients = []
