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
"""

from __future__ import annotations

from fdam_ray.executors.ray.transports.base import Round, Transport


class StarTransport(Transport):
    """Classic calls; partial sums folded at the driver in arrival order or (``fold_order: client``) actor order."""

    name = "star"
    serves = ("classic", "star")

    def run_round(self, round: Round) -> None:
        fleet = self.fleet
        for _, partial in fleet.each("local_round", round.call, round.targets,
                                     ordered=self.config.fold_order == "client"):
            fleet.folded(partial, round.fold)
            del partial
