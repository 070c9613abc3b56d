"""fdam-ray on Flower's deployment engine: the same algorithm modules behind a Flower ServerApp and ClientApp.

A Ray cluster is one trust domain; a consortium of hospitals is not. Flower's
deployment engine lets each site run a SuperNode that connects out to one
SuperLink (TLS, node authentication, secure aggregation), and this package runs
fdam-ray's federation over it:

- the server side is :class:`~fdam_ray.loop.federation.Federation` itself (stages,
  eta_g, the global control variate c, CODA's alpha step, client sampling and
  weights of docs/algorithms.md s.3b), given a :class:`FlowerExecutor` that
  moves each round's state and updates as Flower messages instead of Ray calls
  (:mod:`.executor`);
- the site side is :class:`~fdam_ray.clients.client.Client` (the local solver, c^k,
  sampler position, stage reference), rebuilt for every message from what the
  site keeps in the node's state and in a file of its own (:mod:`.site`);
- with SecAgg+ (:mod:`.secagg`) the server receives only the sums of the
  sites' updates;
- each site number is bound to the public key of the node that took it
  (:mod:`.identity`), and every node runs the server's fdam-ray version.

Importing this package needs no Flower: its config section (:mod:`.section`) is checked by every fdam-ray run,
a simulation of the study included. Every other module of it needs Flower (fdam-ray's ``flower`` extra,
:func:`fdam_ray.files.extras.extra_hint` says how to add it) and says so when it is missing; the rest of fdam_ray
imports only :mod:`.section`. :mod:`.certs` (a consortium's certificates and node keys) needs only
``cryptography``; sites are bound to their nodes' public keys by :mod:`.identity`.
"""

from __future__ import annotations

import os

# Flower reports usage events to its own server unless told not to, read once when flwr is imported: a
# consortium's processes talk to its SuperLink only. FLWR_TELEMETRY_ENABLED=1 in the environment turns them on.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from fdam_ray.executors.flower_section import FlowerSection, split_config

__all__ = ["FlowerSection", "split_config"]
