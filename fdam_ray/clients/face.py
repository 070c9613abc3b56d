"""The client face of a plug: what a mechanism that acts on a run (differential privacy today) does where the
clients run, as one object that travels to every client (docs/architecture.md, "Plugs").

A :class:`ClientFace` is built on the driver (or, on a Flower site, from the run config the server sent) and
handed to the executor in :attr:`fdam_ray.executors.base.ExecutorSetup.face`; every executor gives it to the
replica and the clients it hosts, and knows nothing else of it. The replica asks it once
(:meth:`ClientFace.check_replica`); each client asks it for its own :class:`ClientGuard` (a client's own state of
the mechanism: its noise's keys, say), which wraps the client's work at four places: a round's start, the batch
sampler, the local step, and the change the client sends. The defaults here change nothing, so a run without
a mechanism is the plain run, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from fdam_ray.core.state import ClientUpdate, GlobalState, RoundPlan


class ClientGuard:
    """One client's part of the mechanism (the default: nothing)."""

    def begin_round(self, round_index: int, plan: RoundPlan | None = None) -> None:
        """Round ``round_index`` starts on this client, asked by ``plan`` (what a plug set in it for the round,
        :meth:`~fdam_ray.loop.plug.Plug.round_plan`: adaptive clipping's C_r)."""

    def sampler(self, split: Any, default: Callable[[], Any]) -> Any:
        """The client's batch sampler of its training ``split``: ``default()`` unless the mechanism draws its own
        batches."""
        return default()

    def step(self, replica: Any, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor | None:
        """One local step on the batch ``(x, y)`` of ``replica`` (a :class:`~fdam_ray.clients.client.TrainingReplica`)
        done by the mechanism, returning the minibatch loss; None: the replica's own step runs."""
        return None

    def update(self, update: ClientUpdate, start: GlobalState) -> ClientUpdate:
        """What the client sends of its round's ``update`` (its round started from ``start``)."""
        return update


NO_GUARD = ClientGuard()


class ClientFace:
    """A mechanism's face on the clients (the default: no mechanism). Must pickle (it travels to Ray actors)."""

    # whether a client's update carries its clipped change (v^k - v, alpha^k - alpha) instead of its end point,
    # and no control variate (a bridge that moves updates, Flower's, forms its sums accordingly)
    sends_changes: bool = False

    def check_replica(self, replica: Any) -> None:
        """Refuse a replica (its network, its precision) the mechanism cannot run on; one line."""

    def check_client(self, num_train: int, label: str) -> None:
        """Refuse a client the mechanism cannot run (its ``num_train`` training samples); one line."""

    def guard(self, client_id: int, device: torch.device) -> ClientGuard:
        """Client ``client_id``'s own guard (the default shares one that does nothing)."""
        return NO_GUARD


NO_FACE = ClientFace()
