"""A multi-node Ray cluster on one machine: a head and worker nodes, each with its own raylet and object store.

``ray.cluster_utils.Cluster`` starts every node as separate processes on this
machine, so objects really cross node boundaries (through the object manager)
and a node can be removed mid-run (``remove_node`` kills its raylet and the
workers on it). Every node has fractional CPUs, a ``site_<i>`` custom
resource and a small object store, so three workers fit next to the tests.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import ray
from ray.cluster_utils import Cluster
from raytest import TEST_PATH

from fdam_ray.executors.ray.compat import loopback_node

OBJECT_STORE_BYTES = 150 * 1024 * 1024


def process_auth_mode() -> str:
    """The token-authentication mode this process's Ray uses, for the nodes it starts to agree with it.

    Ray reads it once per process: a Ray session this process ran before (another test module) leaves token
    mode on inside the process while the environment it restored no longer says so.
    """
    from fdam_ray.executors.ray.compat import token_auth_enabled

    return "token" if token_auth_enabled() else "disabled"


LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def multi_node_cluster(workers: int = 3, cpus_per_worker: float = 2, head_cpus: float = 1) -> Iterator[Cluster]:
    """A head (``head_cpus``, resource ``head``) plus ``workers`` nodes (``cpus_per_worker``, resource
    ``site_<i>``), with this process connected as the driver; everything is shut down at the end."""
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TEST_PATH, saved.get("PYTHONPATH")) if p)
    os.environ["RAY_AUTH_MODE"] = process_auth_mode()
    with loopback_node():  # every node listens on 127.0.0.1 only
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "resources": {"head": 1}, "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False, "node_ip_address": LOOPBACK})
    try:
        cluster.sites = {i: add_loopback_node(cluster, num_cpus=cpus_per_worker, resources={f"site_{i}": 1},
                                              object_store_memory=OBJECT_STORE_BYTES)
                         for i in range(workers)}  # site -> its node, for remove_node
        with loopback_node():  # else Ray turns the head's 127.0.0.1 into the machine's address
            ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def add_loopback_node(cluster: Cluster, **node_args):
    """``cluster.add_node(**node_args)`` for a node listening on 127.0.0.1 only."""
    with loopback_node():
        return cluster.add_node(node_ip_address=LOOPBACK, **node_args)


def node_ids_by_site() -> dict[str, str]:
    """site resource name -> Ray node id, for the nodes alive now."""
    out = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for name in node.get("Resources", {}):
                if name.startswith("site_"):
                    out[name] = node["NodeID"]
    return out
