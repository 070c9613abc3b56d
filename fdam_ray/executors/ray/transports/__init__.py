"""The transports of the Ray executor: how a round travels between the driver and the actors.

    base.py      the interface (run a round, recover a broken one, rest between rounds, close) and a Round
    star.py      classic calls, every actor's partial sum folded at the driver     transport=classic reduce=star
    node.py      classic calls, the actors of a node folded there first            transport=classic reduce=node
    compiled.py  the round as one Ray Compiled Graph                               transport=compiled reduce=star
                 ... with the actors of a node merged there inside the graph       transport=compiled reduce=node
    collective.py  the actors all-reduce their sums and apply the server step     transport=collective reduce=star
                   (group.py: an actor's side of it)

    compiled_actor.py, collective_actor.py  the actors' side of compiled and collective (parts of the actor shell)

A transport goes by the config's ``(transport, reduce)`` pair it serves, here
as everywhere. Adding one is one module with a :class:`Transport` subclass,
its declaration in :data:`fdam_ray.features.capabilities.CAPABILITIES` (the
pair it serves and what it refuses; the config's checks, the refusals and the
transport table of docs/explanation/transports.md follow from it), the class's ``capabilities`` pointing at it,
and one entry in :data:`REGISTRY`.
"""

from __future__ import annotations

from fdam_ray.executors.ray.transports.base import Round, Transport
from fdam_ray.executors.ray.transports.collective import CollectiveTransport
from fdam_ray.executors.ray.transports.compiled import CompiledNodeTransport, CompiledTransport
from fdam_ray.executors.ray.transports.node import NodeTransport
from fdam_ray.executors.ray.transports.star import StarTransport
from fdam_ray.features.capabilities import refused_pairs

__all__ = ["REFUSED", "REGISTRY", "Round", "Transport", "transport_for"]

REGISTRY: dict[tuple[str, str], type[Transport]] = {cls.serves: cls for cls in (
    StarTransport, NodeTransport, CompiledTransport, CompiledNodeTransport, CollectiveTransport)}

# (transport, reduce) pairs of the config that no transport runs, and why (the config refuses them first)
REFUSED: dict[tuple[str, str], str] = refused_pairs()


def transport_for(transport: str, reduce: str) -> type[Transport]:
    """The transport class that runs the config's ``transport`` with its ``reduce``; a one-line ValueError for a
    pair none runs."""
    if (transport, reduce) in REFUSED:
        raise ValueError(REFUSED[transport, reduce])
    if (transport, reduce) in REGISTRY:
        return REGISTRY[transport, reduce]
    served = ", ".join(f"transport={t} reduce={r}" for t, r in (cls.serves for cls in REGISTRY.values()))
    raise ValueError(f"no transport runs transport={transport} with reduce={reduce} (there are: {served})")
