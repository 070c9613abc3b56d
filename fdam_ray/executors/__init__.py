"""Executors: how the clients of a federation run (in-process, or as Ray actors)."""

from __future__ import annotations

from fdam_ray.executors.base import Executor, ExecutorSection

__all__ = ["Executor", "ExecutorSection", "make_executor"]


def make_executor(name: str) -> Executor:
    if name == "inline":
        from fdam_ray.executors.inline import InlineExecutor

        return InlineExecutor()
    if name == "ray":
        from fdam_ray.executors.ray.executor import RayExecutor

        return RayExecutor()
    raise ValueError(f"executor {name!r} is not known (ray, inline)")
