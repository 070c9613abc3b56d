"""Your own code named in a config: ``module:attr`` import paths to factories (a model, a dataset).

A config names a factory by its import path, ``my_pkg.models:build``: the module
is imported and ``attr`` (dots allowed, ``Outer.build``) read from it. The path is
resolved where the config is built (so a bad path fails before any client
starts) and again in every process that runs a client, which must therefore be
able to import the module too (installed, on ``PYTHONPATH``, or shipped with
Ray's ``runtime_env={"working_dir": ...}``).

In Python a factory may also be given as the callable itself;
:func:`import_path_of` finds the path of one that can be imported by name, and
:func:`python_name` names one that cannot (a lambda, a local function, a
function of the ``__main__`` script) in what a run folder records.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

# What a run folder records for a factory given in Python that cannot be imported by name.
PYTHON_PREFIX = "python:"

ON_EVERY_NODE = ("every process that runs a client imports it: install the package there, put its folder on "
                 "PYTHONPATH, or ship it with Ray's runtime_env={'working_dir': ...}")


def is_import_path(value: Any) -> bool:
    """Whether ``value`` is written like an import path ``module:attr``."""
    return isinstance(value, str) and bool(_PATH.match(value))


def resolve(path: str, *, field: str, here: str = "") -> Callable:
    """The callable ``path`` (``module:attr``) names; any failure is one ValueError naming ``field`` and the path.

    ``here`` says where the import runs (e.g. "on client 3's process"), for the message.
    """
    module_name, _, attr = path.partition(":")
    where = f" {here}" if here else ""
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error raised while the module runs
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ValueError(f"{field}: cannot import module '{module_name}' of '{path}'{where} ({detail}); "
                         f"{ON_EVERY_NODE}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field}: module '{module_name}' has no attribute '{attr}' (from '{path}'{where})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{field}: '{path}' is a {type(obj).__name__}, not a callable factory")
    return obj


def import_path_of(fn: Callable) -> str | None:
    """``module:qualname`` of a function or class that importing by that name gives back, else None.

    Functions of the ``__main__`` script, lambdas and local functions have none: a
    client process would not find them by name (they travel by value instead).
    """
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    path = f"{module}:{qualname}"
    if not is_import_path(path):
        return None
    try:
        found = resolve(path, field="factory")
    except ValueError:
        return None
    return path if found is fn else None


def python_name(fn: Callable) -> str:
    """What a run folder records for a factory given in Python that cannot be imported by name."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{PYTHON_PREFIX}{module}.{qualname}"
