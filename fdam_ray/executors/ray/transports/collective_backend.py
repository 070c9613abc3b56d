"""Which backend a collective group of actors reduces by, and where its store listens (``transport: collective``).

The choice reads only where each member runs (its node, device and GPU ids, as
the fleet placed it) and ``collective_backend``: NCCL when every member holds
a GPU of its own; a shared-memory block on one node (``shm``, :mod:`.shared`)
or one per node with the nodes' leaders reducing among themselves (``hier``,
:mod:`.hierarchy`); every member on one GPU with ``collective_backend: device``
(:mod:`.device_block`); else gloo.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fdam_ray.executors.ray.placement import node_addresses
from fdam_ray.executors.ray.transports.device_block import DEVICE, device_block_usable
from fdam_ray.executors.ray.transports.hierarchy import BACKEND as HIERARCHICAL
from fdam_ray.executors.ray.transports.shared import supported as shared_memory_supported

log = logging.getLogger(__name__)

Where = Mapping[str, Any]  # where a member runs: node_id, device, gpu_ids (the fleet's where_of entry)


def choose_backend(wheres: Sequence[Where], collective_backend: str) -> str:
    """NCCL when every member holds a GPU and no two share one (NCCL takes one rank per GPU); else, with
    ``collective_backend: auto``, when the machine supports shared memory
    (:func:`~fdam_ray.executors.ray.transports.shared.supported`), ``shm`` when every member is on one node and
    ``hier`` when they span several (:mod:`.hierarchy`); with ``collective_backend: device`` and every member
    on one GPU, ``device`` (:mod:`.device_block`: CUDA IPC handles, not host memory); else gloo. ``wheres``:
    the members', in rank order."""
    gpus = [(w.get("node_id"), tuple(w.get("gpu_ids") or ())) for w in wheres
            if str(w.get("device", "cpu")).startswith("cuda") and w.get("gpu_ids")]
    if len(gpus) == len(wheres) and len(set(gpus)) == len(gpus):
        return "nccl"
    one_node = len({w.get("node_id") for w in wheres}) == 1
    if collective_backend == DEVICE:
        ids = [f"cuda/{w.get('node_id')}/{tuple(w.get('gpu_ids') or ())}"
               if str(w.get("device", "cpu")).startswith("cuda") else f"cpu/{w.get('node_id')}" for w in wheres]
        if device_block_usable(ids, cuda_available=True):
            return DEVICE
        log.warning("collective_backend=device needs every actor on one GPU (they are on %d devices, %s); "
                    "reducing as with auto", len(set(ids)), "GPUs" if ids[0].startswith("cuda") else "CPUs")
    if collective_backend in ("auto", DEVICE) and shared_memory_supported():
        return "shm" if one_node else HIERARCHICAL
    return "gloo"


def store_host(wheres: Sequence[Where]) -> str:
    """Where the group's store listens: the loopback when every member is on one node, else the lowest rank's
    node address (``wheres``: the members', in rank order)."""
    nodes = {w.get("node_id") for w in wheres}
    if len(nodes) == 1:
        return "127.0.0.1"
    return node_addresses().get(wheres[0].get("node_id", ""), "") or "127.0.0.1"
