"""All clients in the driver process, one after another.

This is the debugging executor that replaces Ray's removed ``local_mode``:
client code runs in the caller's process and thread, so ``breakpoint()``, a
debugger or a profiler work in it. Its results are the reference the Ray
executor is tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from fdam_ray.client import Client, ClientSection, resolve_device
from fdam_ray.data import DataSource
from fdam_ray.executors.base import Executor, ExecutorSection
from fdam_ray.state import ClientInfo, ClientUpdate, GlobalState, Moments, RoundPlan, Scores


class InlineExecutor(Executor):
    def __init__(self) -> None:
        self.clients: list[Client] = []

    def start(self, config: ExecutorSection, source: DataSource) -> list[ClientInfo]:
        if config.threads_per_client:
            torch.set_num_threads(config.threads_per_client)
        device = resolve_device(config.device)
        client = ClientSection.of(config)
        self.clients = [Client(client, source, k, device=device) for k in range(source.num_clients)]
        return [c.info() for c in self.clients]

    def configure(self, positive_ratio: np.ndarray) -> None:
        for c in self.clients:
            c.configure(positive_ratio)

    def begin_stage(self, reference: np.ndarray, reset_control_variates: bool) -> None:
        for c in self.clients:
            c.begin_stage(reference, reset_control_variates)

    def run_round(self, state: GlobalState, plan: RoundPlan, fold: Callable[[ClientUpdate], None],
                  clients: Sequence[int] | None = None) -> None:
        for c in self.clients if clients is None else [self.clients[k] for k in clients]:
            fold(c.local_round(state, plan))

    def evaluate(self, state: GlobalState) -> list[Scores]:
        return [s for s in (c.evaluate(state) for c in self.clients) if s is not None]

    def score_moments(self, state: GlobalState) -> list[Moments]:
        return [c.score_moments(state) for c in self.clients]

    def client_states(self) -> list[dict]:
        return [c.get_state() for c in self.clients]

    def restore_client_states(self, states: list[dict | None]) -> None:
        dropped = [k for k, s in enumerate(states) if s is None]
        if dropped:
            raise ValueError(f"client(s) {dropped} were dropped from the run being resumed; the inline executor "
                             "runs every client: resume it with executor=ray")
        for c, s in zip(self.clients, states, strict=True):
            c.set_state(s)

    @property
    def active_clients(self) -> int:
        return len(self.clients)

    def shutdown(self) -> None:
        self.clients = []
