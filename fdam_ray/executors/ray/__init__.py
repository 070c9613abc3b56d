"""The Ray executor and everything else in the package that imports Ray (besides ``tuning/`` and the CLI).

    executor.py    RayExecutor: wires placement, the fleet and the chosen transport
    placement.py   bundles, placement groups (own or a Tune trial's), site pinning, node addresses
    fleet.py       the actors and the clients each hosts; calls on every actor with the failure policy
    actor.py       the actor shell: receives, calls the clients, returns
    transports/    how a round travels: star, node, compiled (a registry, one interface)
    session.py     getting a Ray instance (reuse, connect, or start a local one); one-off tasks
    compat.py      every private or experimental Ray API, and the Ray versions they were tested on

The package is named ``ray`` inside ``fdam_ray.executors``; absolute imports
(``import ray``) still reach Ray itself.
"""

from fdam_ray.executors.ray.compat import check_ray_version

check_ray_version()  # before any module here imports Ray: another Ray version is refused in one line
