"""Typed failures of clients, of their placement and of the connection to a Ray cluster (importable without Ray)."""

from __future__ import annotations

from fdam_ray.features.sites import client_label, client_labels


class ClientError(RuntimeError):
    """A client (or the actor hosting it and others) failed: which, in which round, doing what, and the
    traceback where it happened.

    ``str(error)`` is one line; the client's own traceback is in ``traceback``
    and is also attached as a note, so an uncaught error prints it.

    Attributes:
        client_id: k in 0..K-1.
        round: the round being run (0 before the first one).
        action: what the client was asked to do (``start``, ``local_round``, ``evaluate``, ...).
        error: the original exception as ``Type: message`` (or what happened to the process).
        traceback: the original traceback text ('' when the process died or did not answer).
        actor: the index of the actor hosting the client (None when not known).
        clients: every client that actor hosts (a failure of the actor is a failure of all of them).
        of_actor: the actor failed as a whole (its process died, or it did not answer), not one client's code.
        names: the clients' names (``client_names``) the message shows them by; None: their indices.
    """

    names: tuple[str, ...] | None = None

    def __init__(self, client_id: int, round: int, action: str, error: str, traceback: str = "",
                 actor: int | None = None, clients: tuple[int, ...] = (), of_actor: bool = False) -> None:
        super().__init__(client_id, round, action, error, traceback, actor, clients, of_actor)
        self.client_id = client_id
        self.round = round
        self.action = action
        self.error = error
        self.traceback = traceback
        self.actor = actor
        self.clients = tuple(clients) or (client_id,)
        self.of_actor = of_actor
        if traceback:
            self.add_note(f"client {client_id}'s traceback:\n{traceback.rstrip()}")

    def __str__(self) -> str:
        if len(self.clients) > 1 and self.of_actor:
            hosted = client_labels(self.clients, self.names)
            return f"actor {self.actor} (clients {hosted}) failed in round {self.round} ({self.action}): {self.error}"
        who = client_label(self.client_id, self.names)
        return f"client {who} failed in round {self.round} ({self.action}): {self.error}"

    def __reduce__(self):
        return type(self), (self.client_id, self.round, self.action, self.error, self.traceback, self.actor,
                            self.clients, self.of_actor)


class ClientInputError(ClientError, ValueError):
    """A client rejected its input (a ``ValueError`` in client code: bad data or config)."""


def client_error(client_id: int, round: int, action: str, exc: BaseException, traceback: str) -> ClientError:
    """The typed error for ``exc`` raised in client code."""
    cls = ClientInputError if isinstance(exc, ValueError) else ClientError
    return cls(client_id, round, action, f"{type(exc).__name__}: {exc}", traceback)


class ClusterConnectionError(ConnectionError, ValueError):
    """The Ray cluster named by ``address`` / ``RAY_ADDRESS`` cannot be used as given (with what to change)."""


class PlacementError(RuntimeError):
    """Clients cannot be placed (again) on the nodes the cluster has: which, and what they ask for.

    Raised mid-run (the nodes left after a node loss cannot hold a lost actor),
    it stops the run with a checkpoint of the state the round started from,
    which ``--resume`` continues once the cluster can hold every client again.
    """
