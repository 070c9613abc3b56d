"""Flower's message flow in one process: a Grid whose nodes run the ClientApp in the caller's thread.

Flower's own simulation engine needs Ray's ``[simulation]`` extra, which would
change the Ray fdam-ray runs on; this grid needs nothing but Flower's Message
API. Each node has its own ``Context`` (node config and node state) as a
SuperNode gives it, messages go through the ClientApp's handlers and mods
(SecAgg+ included) and replies come back as on the deployment engine. It also
plays what a deployment does to a consortium: a node that leaves, a reply that
is lost, a node restarted with an empty state.
"""

from __future__ import annotations

from fdam_ray.flower import needs_flower  # noqa: F401 (first: without Flower, says what to install)

# isort: split
import copy
import dataclasses
import itertools
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


@dataclasses.dataclass
class _Run:
    run_id: int


class InProcessGrid(Grid):
    """Nodes with the given node configs, each running ``client_app``.

    ``lose_reply(message)``, when given, is asked for every message a node has handled: True drops the reply (the
    site did the work, the server never hears of it).
    """

    def __init__(self, client_app: ClientApp, node_configs: Iterable[Mapping[str, Any]], *, run_id: int = 1,
                 lose_reply: Callable[[Message], bool] | None = None) -> None:
        self.client_app = client_app
        self._run = _Run(run_id)
        # who sends the messages built in this process (set by Flower's own runtimes in theirs)
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SUPERLINK_NODE_ID, 0
        self._ids = itertools.count(101)
        self.contexts: dict[int, Context] = {}
        self.offline: set[int] = set()
        self.lose_reply = lose_reply
        self._replies: dict[str, Message] = {}
        for cfg in node_configs:
            self.add_node(cfg)

    def add_node(self, node_config: Mapping[str, Any]) -> int:
        node = next(self._ids)
        self.contexts[node] = Context(run_id=self._run.run_id, node_id=node, node_config=dict(node_config),
                                      state=RecordDict(), run_config={})
        return node

    def restart_node(self, node: int) -> int:
        """The node's SuperNode restarts: a new node id and an empty node state (files it wrote are kept)."""
        config = self.contexts.pop(node).node_config
        return self.add_node(config)

    def node_of_site(self, site: int) -> int:
        return next(n for n, c in self.contexts.items() if int(c.node_config["site"]) == site)

    # -- Grid -------------------------------------------------------------------------------
    def set_run(self, run: Any) -> None:
        self._run = _Run(run.run_id)
        TaskIdentity.run_id = run.run_id

    @property
    def run(self) -> Any:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.offline]

    def get_nodes(self) -> Iterable[Any]:
        return list(self.get_node_ids())

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            meta = msg.metadata.__dict__
            meta["_message_id"], meta["_src_node_id"], meta["_run_id"] = (str(uuid.uuid4()), SUPERLINK_NODE_ID,
                                                                         self._run.run_id)
            ids.append(msg.metadata.message_id)
            node = msg.metadata.dst_node_id
            if node in self.offline or node not in self.contexts:
                continue
            try:  # a node gets its own copy, as it would over the wire (a mod may change what it receives)
                reply = self.client_app(copy.deepcopy(msg), self.contexts[node])
            except Exception as exc:  # as a SuperNode does: the error travels back as the reply
                reply = Message(Error(code=1, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            if self.lose_reply is not None and self.lose_reply(msg):
                continue
            self._replies[msg.metadata.message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(list(self.push_messages(messages)))


def server_context(run_id: int = 1, run_config: Mapping[str, Any] | None = None) -> Context:
    """The ServerApp's context for a run on an :class:`InProcessGrid`."""
    return Context(run_id=run_id, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(),
                   run_config=dict(run_config or {}))
