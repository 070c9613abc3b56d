"""Typed failures of clients and of the connection to a Ray cluster (importable without Ray)."""

from __future__ import annotations


class ClientError(RuntimeError):
    """A client failed: which one, in which round, doing what, and the traceback where it happened.

    ``str(error)`` is one line; the client's own traceback is in ``traceback``
    and is also attached as a note, so an uncaught error prints it.

    Attributes:
        client_id: k in 0..K-1.
        round: the round being run (0 before the first one).
        action: what the client was asked to do (``start``, ``local_round``, ``evaluate``, ...).
        error: the original exception as ``Type: message`` (or what happened to the process).
        traceback: the original traceback text ('' when the process died or did not answer).
    """

    def __init__(self, client_id: int, round: int, action: str, error: str, traceback: str = "") -> None:
        super().__init__(client_id, round, action, error, traceback)
        self.client_id = client_id
        self.round = round
        self.action = action
        self.error = error
        self.traceback = traceback
        if traceback:
            self.add_note(f"client {client_id}'s traceback:\n{traceback.rstrip()}")

    def __str__(self) -> str:
        return f"client {self.client_id} failed in round {self.round} ({self.action}): {self.error}"

    def __reduce__(self):
        return type(self), (self.client_id, self.round, self.action, self.error, self.traceback)


class ClientInputError(ClientError, ValueError):
    """A client rejected its input (a ``ValueError`` in client code: bad data or config)."""


def client_error(client_id: int, round: int, action: str, exc: BaseException, traceback: str) -> ClientError:
    """The typed error for ``exc`` raised in client code."""
    cls = ClientInputError if isinstance(exc, ValueError) else ClientError
    return cls(client_id, round, action, f"{type(exc).__name__}: {exc}", traceback)


class ClusterConnectionError(ConnectionError, ValueError):
    """The Ray cluster named by ``address`` / ``RAY_ADDRESS`` cannot be used as given (with what to change)."""
