"""Patient reads of compiled-graph channels (``channel_wait: sleep``): a wait polls as Ray does while it is young,
then sleeps between checks, so an idle actor does not hold a core. Used by the compiled transport's driver side and
its actors (:mod:`.compiled_actor`), so it sits apart from both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fdam_ray.executors.ray import compat

# channel_wait=sleep: how long a wait polls before it sleeps (the gaps inside a loop of rounds are shorter), the
# first pause after that, the longest pause while a wait is short, and the longest pause as a fraction of the
# time already waited
SPIN_S = 0.05
FIRST_PAUSE_S = 20e-6
PAUSE_CAP_S = 200e-6
PAUSE_OF_WAIT = 0.02
_patience = {"on": False, "installed": False}


def patient_read(ray_read: Callable[[Any, float | None], Any], channel: Any, timeout: float | None) -> Any:
    """Read ``channel`` as ``ray_read(channel, timeout)`` would, but sleep once a wait has lasted ``SPIN_S``.

    For its first ``SPIN_S`` a wait is Ray's own (polling: the quickest hand-over, and the gaps inside a loop
    of rounds are shorter); after that it checks with a zero timeout and sleeps between checks, with pauses
    that start at ``FIRST_PAUSE_S`` and double up to the larger of ``PAUSE_CAP_S`` and ``PAUSE_OF_WAIT``
    times the time this channel has been waited on. A wait that the caller splits into several reads (Ray's
    read loop asks again every ``read_iteration_timeout``, 0.1 s) counts as one: it goes on with the wait's
    start and its last pause (an idle graph's actor checks about 33 times a second, where starting each read's
    pauses afresh made it 140). Raises Ray's timeout error at the
    deadline, and whatever ``ray_read`` raises.
    """
    from ray.exceptions import RayChannelTimeoutError

    now = time.monotonic()
    deadline = None if timeout is None or timeout < 0 else now + timeout
    since = getattr(channel, "_fdam_waiting_since", None) or now
    channel._fdam_waiting_since = since
    pause = getattr(channel, "_fdam_pause", None) or FIRST_PAUSE_S  # a wait split into reads backs off as one
    while True:
        poll = max(0.0, SPIN_S - (now - since))  # Ray's polling while the wait is young
        if deadline is not None:
            poll = min(poll, max(0.0, deadline - now))
        try:
            value = ray_read(channel, poll)
        except RayChannelTimeoutError:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                channel._fdam_pause = pause
                raise  # the caller's next read goes on with the same wait: `since` and the pause are kept
            if now - since >= SPIN_S:
                time.sleep(pause if deadline is None else min(pause, deadline - now))
                pause = min(2 * pause, max(PAUSE_CAP_S, PAUSE_OF_WAIT * (now - since)))
            continue
        except BaseException:
            channel._fdam_waiting_since = channel._fdam_pause = None
            raise
        channel._fdam_waiting_since = channel._fdam_pause = None
        return value


def patient_reads(on: bool) -> bool:
    """Make this process's reads of compiled-graph channels sleep between checks (``on``, see
    :func:`patient_read`) or poll as Ray does. Returns whether reads are patient now (False where this Ray
    has no shared-memory channel to wrap)."""
    if not _patience["installed"]:
        _patience["installed"] = compat.wrap_channel_read(_read)
        if not _patience["installed"]:  # pragma: no cover - a Ray without compiled graphs' shared-memory channels
            return False
    _patience["on"] = on
    return on


def _read(ray_read: Callable[[Any, float | None], Any], channel: Any, timeout: float | None) -> Any:
    """A channel read: patient (:func:`patient_read`) while this process's reads are patient, else Ray's."""
    if not _patience["on"]:
        return ray_read(channel, timeout)
    return patient_read(ray_read, channel, timeout)
