"""Whether an object can travel to the processes that run the clients (Ray's own pickler decides)."""

from __future__ import annotations

from ray import cloudpickle

from fdam_ray.settings.factories import describe_error


class _Discard:
    """A file that keeps nothing: pickling into it measures whether an object can be pickled, without a copy."""

    def write(self, data: bytes) -> int:
        return len(data)


def unpicklable(obj: object) -> str | None:
    """Why Ray could not send ``obj`` to another process (its cloudpickle's error, one line), or None if it can."""
    try:
        cloudpickle.CloudPickler(_Discard(), protocol=5).dump(obj)
    except Exception as exc:  # PicklingError, TypeError ("cannot pickle '_thread.lock' object"), ...
        return describe_error(exc)
    return None
