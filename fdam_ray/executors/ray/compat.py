"""Every private or experimental Ray API the package uses, in one module, with the Ray versions it was tested on.

Ray's public API (``ray.remote``, ``ray.get``, placement groups, scheduling
strategies, ``ray.nodes``) is used where it is needed; what Ray does not
promise to keep (underscore modules and attributes, the experimental
compiled graphs and their shared-memory channels) is reached only through
the functions below, so a Ray upgrade that moves one of them breaks here and
in ``tests/executors/test_ray_compat.py``, which checks that every name listed in
:data:`PRIVATE_NAMES` exists in the installed Ray. Each function degrades the
way the code relied on before: a missing probe is skipped, a missing token
helper falls back to the environment variable.

:data:`SUPPORTED` is the range the package was tested on (Ray 2.60), and
its requirement in ``setup.cfg`` is the same range: the private names may
differ outside it. Importing the Ray executor (:mod:`fdam_ray.executors.ray`)
calls :func:`check_ray_version`, which refuses another Ray in one line.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

SUPPORTED = (">=2.60", "<2.61")  # the Ray versions these names were checked against

# (module, attribute) of every private or experimental Ray name used below; the compat test imports each.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("ray._raylet", "GcsClient"),
    ("ray._raylet", "InnerGcsClient"),
    ("ray._private.authentication.authentication_token_setup", "_enable_token_auth"),
    ("ray._private.authentication.authentication_utils", "is_token_auth_enabled"),
    ("ray._common.utils", "get_ray_address_file"),
    ("ray._private.services", "ConsolePopen"),
    ("ray._private.services", "get_node"),
    ("ray._private.utils", "detect_fate_sharing_support"),
    ("ray._private.ray_constants", "ENABLE_RAY_CLUSTER"),
    ("ray._private.state", "state"),
    ("ray.experimental.internal_kv", "_internal_kv_get"),
    ("ray.experimental.channel.shared_memory_channel", "Channel"),
    ("ray.dag", "InputNode"),
    ("ray.dag", "MultiOutputNode"),
)
# underscore keyword arguments of DAGNode.experimental_compile, and the private attribute of an ActorHandle, used below
COMPILE_ARGUMENTS = ("_submit_timeout", "_buffer_size_bytes", "_max_inflight_executions")
ACTOR_ID_ATTRIBUTE = "_actor_id"


def version_in_range(version: str, supported: tuple[str, ...] = SUPPORTED) -> bool:
    """Whether ``version`` (``major.minor.patch``) satisfies every ``>=x.y`` / ``<x.y`` bound of ``supported``."""

    def key(text: str) -> tuple[int, ...]:
        return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())

    have = key(version)
    for bound in supported:
        op, limit = (">=", bound[2:]) if bound.startswith(">=") else ("<", bound[1:])
        if (op == ">=" and have < key(limit)) or (op == "<" and have >= key(limit)):
            return False
    return True


class RayVersionError(ImportError, ValueError):
    """The installed Ray is outside :data:`SUPPORTED` (a ValueError too, so the CLI reports it in one line)."""


def check_ray_version(version: str | None = None) -> str:
    """The installed Ray's version (or ``version``), checked to be in :data:`SUPPORTED`; raises
    :class:`RayVersionError` naming it and the range otherwise. Reads the installed metadata: imports no Ray."""
    wanted = ",".join(SUPPORTED)
    if version is None:
        try:
            version = importlib.metadata.version("ray")
        except importlib.metadata.PackageNotFoundError:
            raise RayVersionError(f"the Ray executor needs Ray {wanted}, which is not installed: pip install "
                                  f"'ray[default,tune]{wanted}' (or use executor=inline)") from None
    if not version_in_range(version):
        raise RayVersionError(f"the Ray executor supports Ray {wanted} (the Ray versions it was tested on); Ray "
                              f"{version} is installed: pip install 'ray[default,tune]{wanted}' (or use "
                              "executor=inline)")
    return version


def _private(module: str, name: str) -> Any:
    """``module.name`` from :data:`PRIVATE_NAMES`; raises ImportError where this Ray lacks it."""
    try:
        return getattr(importlib.import_module(module), name)
    except AttributeError as exc:
        raise ImportError(f"{module}.{name}: {exc}") from None


# -- clusters and authentication ----------------------------------------------------------------------------
def gcs_probe(address: str, timeout_s: float) -> Callable[[], None] | None:
    """A call that asks the GCS at ``address`` for a key (raising Ray's ``AuthenticationError`` when it
    refuses this process's credentials), or None where this Ray has no such client."""
    try:
        inner = _private("ray._raylet", "InnerGcsClient")
    except ImportError:
        inner = None
    if inner is not None and hasattr(inner, "standalone"):  # its connection bounded too (GcsClient waits 30 s)

        def bounded() -> None:
            inner.standalone(address, None, int(timeout_s * 1000)).internal_kv_get(b"fdam-probe", None,
                                                                                   timeout=timeout_s)

        return bounded
    try:
        gcs_client = _private("ray._raylet", "GcsClient")
    except ImportError:
        return None

    def probe() -> None:
        gcs_client(address=address).internal_kv_get(b"fdam-probe", None, timeout=timeout_s)

    return probe


def enable_token_auth() -> bool:
    """Switch token authentication on in Ray's cached config for this process (Ray reads ``RAY_AUTH_MODE``
    once); False where this Ray has no such switch (the caller then sets the variable)."""
    try:
        enable = _private("ray._private.authentication.authentication_token_setup", "_enable_token_auth")
    except ImportError:
        return False
    enable()
    return True


def token_auth_enabled() -> bool:
    """Whether this process's Ray uses token authentication."""
    return bool(_private("ray._private.authentication.authentication_utils", "is_token_auth_enabled")())


def ray_address_file() -> str | None:
    """The file where ``ray start`` records the address of the cluster it started on this machine (None
    where this Ray does not say)."""
    try:
        return str(_private("ray._common.utils", "get_ray_address_file")(None))
    except ImportError:
        return None


def start_loopback_ray(**start: Any) -> None:
    """``ray.init(address="local", **start)`` with the node's address 127.0.0.1, so that every process of the
    private instance (GCS, raylet, agents, dashboard, workers) listens there only (:func:`loopback_node`)."""
    import ray

    with loopback_node(), quiet_default_token_auth():
        ray.init(address="local", _node_ip_address="127.0.0.1", **start)


class StartTimedOut(TimeoutError):
    """A private local Ray that did not start within the caller's bound (:func:`bounded_start`)."""


@contextlib.contextmanager
def bounded_start(deadline: float, started: list[Any]) -> Iterator[None]:
    """While a private local Ray starts from this process: its fixed waits end at ``deadline`` (a
    ``time.monotonic()`` value) instead, and its server processes sit apart from this process's group.

    - Ray waits a fixed 30 s for its GCS to publish its port (``RAY_gcs_server_port_wait_time_s``, set here to
      the time left unless the user set it) and a fixed 30 s for the raylet to register (a loop over
      ``services.get_node``, which here retries until ``deadline`` and then raises :class:`StartTimedOut`).
    - Every process Ray starts itself (GCS, raylet, monitor, dashboard; the raylet then starts the workers and
      agents in its own session) is started in a session of its own and appended to ``started`` (its
      ``Popen``), so that a signal to this process's group (a scheduler's SIGTERM to the job) does not reach
      them, and a failed start can stop them by pid. Only where the kernel ends them with this process (Linux's
      parent-death signal): elsewhere Ray's reaper ends them by process group, which they then must share.
    """
    try:
        services = importlib.import_module("ray._private.services")
        popen = _private("ray._private.services", "ConsolePopen")
        get_node = _private("ray._private.services", "get_node")
        apart = bool(_private("ray._private.utils", "detect_fate_sharing_support")())
    except ImportError:  # a Ray without these names: it starts, and waits, as it does
        yield
        return

    class ApartPopen(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if apart:
                kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)
            started.append(self)

    def waiting_get_node(*args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return get_node(*args, **kwargs)
            except RuntimeError:  # not registered yet
                if time.monotonic() >= deadline:
                    raise StartTimedOut("the raylet did not register with the GCS in time") from None
                time.sleep(0.2)

    variable = "RAY_gcs_server_port_wait_time_s"
    own_wait = variable not in os.environ
    if own_wait:
        os.environ[variable] = str(max(1, math.ceil(deadline - time.monotonic())))
    setattr(services, "ConsolePopen", ApartPopen)  # noqa: B010 (private names mypy does not see)
    setattr(services, "get_node", waiting_get_node)  # noqa: B010
    try:
        yield
    finally:
        setattr(services, "ConsolePopen", popen)  # noqa: B010
        setattr(services, "get_node", get_node)  # noqa: B010
        if own_wait:
            os.environ.pop(variable, None)


@contextlib.contextmanager
def quiet_default_token_auth() -> Iterator[None]:
    """While a private local Ray starts: token authentication switched on as Ray does by default, without the
    warning Ray prints each time it does so itself.

    With ``RAY_AUTH_MODE`` unset, ``ray.init`` starting a new instance sets it to ``token`` and warns ("Token
    authentication is enabled for this Ray cluster...") on every run. For the instance fdam starts, which
    only this user's processes reach on 127.0.0.1, that line says nothing to act on; switching token mode on
    here first gives the same instance (the variable set, Ray's cached config told) and no warning. A mode the
    user set is left as it is, and joining a cluster (not this function) keeps Ray's warnings.
    """
    if "RAY_AUTH_MODE" not in os.environ:
        enable_token_auth()  # where this Ray lacks the switch, Ray enables it itself and warns
    yield


@contextlib.contextmanager
def loopback_node() -> Iterator[None]:
    """While a private local Ray starts: its node address stays 127.0.0.1.

    ``ray.init(_node_ip_address="127.0.0.1")`` alone turns the loopback address into the machine's network
    address, and then every server binds all interfaces; Ray keeps 127.0.0.1 where it thinks clusters are off
    (``ENABLE_RAY_CLUSTER``, the ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` variable its processes read), which is
    set for the start only: this process and the processes Ray starts meanwhile (which start its workers).
    """
    try:
        before = _private("ray._private.ray_constants", "ENABLE_RAY_CLUSTER")
    except ImportError:  # a Ray without the switch: it binds as it does
        yield
        return
    constants = importlib.import_module("ray._private.ray_constants")
    variable = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    saved = os.environ.get(variable)
    setattr(constants, "ENABLE_RAY_CLUSTER", False)  # noqa: B010 (a private name mypy does not see)
    os.environ[variable] = "0"
    try:
        yield
    finally:
        setattr(constants, "ENABLE_RAY_CLUSTER", before)  # noqa: B010
        if saved is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = saved


def autoscaler_configured() -> bool:
    """Whether the connected cluster has an autoscaler that may add nodes (a placement the nodes of now cannot
    hold may then still be placed): autoscaler v2's cluster config with node groups, or autoscaler v1's status
    naming node types of a config (a cluster of ``ray start`` nodes mirrors each node as a type ``node_<id>``
    and launches nothing). False where neither can be read."""
    import json

    try:
        config = _private("ray._private.state", "state").get_cluster_config()
        if config is not None and any(g.max_count for g in config.node_group_configs):
            return True
    except Exception:  # a Ray without autoscaler v2's state
        pass
    try:
        raw = _private("ray.experimental.internal_kv", "_internal_kv_get")("__autoscaling_status")
        report = (json.loads(raw) if raw else {}).get("autoscaler_report") or {}
    except Exception:
        return False
    types = set((report.get("node_type_mapping") or {}).values())
    return bool(report.get("pending_launches") or report.get("pending_nodes")
                or any(not str(t).startswith("node_") for t in types))


# -- compiled graphs ------------------------------------------------------------------------------------------
def actor_id(handle: Any) -> str:
    """The hex id of the actor behind ``handle`` (a replaced actor has a new one)."""
    return getattr(handle, ACTOR_ID_ATTRIBUTE).hex()


def compile_graph(bind: Callable[[Any], list], *, submit_timeout_s: float, buffer_bytes: int) -> Any:
    """The compiled graph ``input -> bind(input) -> one output each``, one execution in flight at a time,
    with channels of ``buffer_bytes`` and ``submit_timeout_s`` to wait for a free input channel."""
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as message:
        dag = MultiOutputNode(bind(message))
    arguments: dict[str, Any] = dict(zip(COMPILE_ARGUMENTS, (submit_timeout_s, int(buffer_bytes), 1), strict=True))
    return dag.experimental_compile(**arguments)


def wrap_channel_read(read: Callable[[Callable[[Any, float | None], Any], Any, float | None], Any]) -> bool:
    """Route every read of a compiled graph's shared-memory channel in this process through
    ``read(ray_read, channel, timeout)`` (once per process; later calls keep the first wrapper). Returns False
    where this Ray has no such channel."""
    try:
        channel = _private("ray.experimental.channel.shared_memory_channel", "Channel")
    except ImportError:  # pragma: no cover - a Ray without compiled graphs' shared-memory channels
        return False
    if getattr(channel.read, "_fdam_wrapped", False):
        return True
    ray_read = channel.read

    def wrapped(self: Any, timeout: float | None = None) -> Any:
        return read(ray_read, self, timeout)

    wrapped.__doc__ = ray_read.__doc__
    wrapped._fdam_wrapped = True  # type: ignore[attr-defined]
    channel.read = wrapped
    return True
