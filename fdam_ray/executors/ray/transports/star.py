"""``transport: classic, reduce: star``: one classic Ray call per actor, every partial sum folded at the driver.

The driver puts the global state in the object store once (flat numpy
buffers, read without a copy by actors on the same node), calls
``local_round`` on every actor hosting a client of the round, and passes each
actor's partial sum to ``fold`` as soon as it arrives (``ray.wait``), so the
driver maps one partial sum at a time whatever K is. Float sums depend on
their order, so such a run matches the inline executor to float32 rounding
(about 1e-7 relative), not bit for bit. ``fold_order: client`` folds in actor
order instead, which is client order (a sum that arrives early waits in the
object store, not in driver memory): runs are then bit-for-bit repeatable and
equal to the inline executor's with the same ``clients_per_actor``, at the
price of waiting for a late low-numbered actor. Failures are recovered inside
the call (:meth:`~fdam_ray.executors.ray.fleet.Fleet.each`).

With a round deadline (:mod:`fdam_ray.executors.deadlines`) the driver waits for the
calls until the deadline (:meth:`~fdam_ray.executors.ray.transports.base.Transport.gather`)
and folds those that ended in time, in actor order with ``fold_order:
client``, else in arrival order; an actor that failed among them is recovered
after the round, as under ``reduce: node``.
"""

from __future__ import annotations

import time

import ray

from fdam_ray.executors.errors import ClientError
from fdam_ray.executors.ray.transports.base import Round, Transport
from fdam_ray.features.capabilities import CAPABILITIES

_FAILURES = (ray.exceptions.RayError, ClientError)


class StarTransport(Transport):
    """Classic calls; partial sums folded at the driver in arrival order or (``fold_order: client``) actor order."""

    capabilities = CAPABILITIES["classic", "star"]

    def run_round(self, round: Round) -> None:
        if round.deadline is not None:
            self._run_by_deadline(round)
            return
        fleet = self.fleet
        for _, partial in fleet.each("local_round", round.call, round.targets,
                                     ordered=self.config.fold_order == "client"):
            fleet.folded(partial, round.fold)
            del partial

    def _run_by_deadline(self, round: Round) -> None:
        fleet = self.fleet
        started = time.monotonic()
        refs = {a: round.call(a, fleet.actors[a]) for a in sorted(round.targets)}
        fleet.in_flight = dict.fromkeys(refs.values(), (0, 0.0))
        arrived = self.gather(round, refs, started)
        fleet.in_flight = {}
        failed: dict[int, BaseException] = {}
        for a in sorted(arrived) if self.config.fold_order == "client" else arrived:
            try:
                partial = ray.get(refs[a], timeout=fleet.timeout)
            except _FAILURES as exc:
                failed[a] = exc
                continue
            fleet.folded(partial, round.fold)
            del partial
        self.recover(round, failed)
