"""Your own code named in a config: ``module:attr`` import paths to factories (a model, a dataset).

A config names a factory by its import path, ``my_pkg.models:build``: the module
is imported and ``attr`` (dots allowed, ``Outer.build``) read from it. The path is
resolved where the config is built (so a bad path fails before any client
starts) and again in every process that runs a client, which must therefore be
able to import the module too (installed, on ``PYTHONPATH``, or shipped with
Ray's ``runtime_env={"working_dir": ...}``). A module of the current folder is
found without ``PYTHONPATH=.`` (:func:`import_module`) and shipped to a cluster
joined by address.

In Python a factory may also be given as the callable itself;
:func:`import_path_of` finds the path of one that can be imported by name, and
:func:`python_name` names one that cannot (a lambda, a local function, a
function of the ``__main__`` script) in what a run folder records.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable
from typing import Any

_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

# What a run folder records for a factory given in Python that cannot be imported by name.
PYTHON_PREFIX = "python:"

ON_EVERY_NODE = ("every process that runs a client imports it: install the package there, put its folder on "
                 "PYTHONPATH, or ship it with Ray's runtime_env={'working_dir': ...}")


def is_import_path(value: Any) -> bool:
    """Whether ``value`` is written like an import path ``module:attr``."""
    return isinstance(value, str) and bool(_PATH.fullmatch(value))


def resolve(path: str, *, field: str, here: str = "") -> Callable:
    """The callable ``path`` (``module:attr``) names; any failure is one ValueError naming ``field`` and the path.

    ``here`` says where the import runs (e.g. "on client 3's process"), for the message.
    """
    module_name, _, attr = path.partition(":")
    where = f" {here}" if here else ""
    try:
        obj: Any = import_module(module_name)
    except (Exception, SystemExit) as exc:  # ImportError, an error raised while the module runs, or sys.exit
        if isinstance(exc, SystemExit):
            raise ValueError(f"{field}: importing module '{module_name}' of '{path}'{where} called "
                             f"{describe_error(exc)}{raised_at(exc)}; a module a factory lives in must not exit "
                             "when imported (put script code under `if __name__ == \"__main__\":`)") from None
        raise ValueError(f"{field}: cannot import module '{module_name}' of '{path}'{where} "
                         f"({describe_error(exc)}); {ON_EVERY_NODE}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field}: module '{module_name}' has no attribute '{attr}' (from '{path}'{where})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{field}: '{path}' is a {type(obj).__name__}, not a callable factory")
    return obj


def import_module(name: str) -> Any:
    """``importlib.import_module(name)``, finding a module of the current folder too.

    ``python -m`` and ``python script.py`` put a folder on ``sys.path``, but the ``fdam`` console script puts
    its own ``bin`` folder there, so ``model=mymod:make`` would fail in the very folder ``mymod.py`` is in
    until ``PYTHONPATH=.``. When the module is not found and the current folder holds it (``name.py`` or a
    package folder), that folder is added at the end of ``sys.path`` (installed packages keep precedence) and
    the import tried again. Ray workers of this machine find it too: Ray puts the driver's current folder on
    their ``sys.path``; a cluster joined by address is sent such modules (:func:`current_folder_modules`).
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = name.partition(".")[0]
        here = os.getcwd()
        if exc.name != top or not _holds_module(here, top) or _on_path(here):
            raise
    sys.path.append(here)
    _ADDED_FOLDERS.add(here)
    importlib.invalidate_caches()
    return importlib.import_module(name)


# Folders import_module put on sys.path (the current folder of a command that named one of its modules).
_ADDED_FOLDERS: set[str] = set()


def current_folder_modules() -> list[str]:
    """The files (``name.py``) and package folders of the modules imported from a folder :func:`import_module`
    added to ``sys.path``: what a cluster on other machines needs shipped (Ray's ``py_modules``), since their
    workers have no such folder."""
    found = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if "." in name or not isinstance(path, str) or not os.path.isabs(path) or not os.path.isfile(path):
            continue  # a submodule (its top module is shipped), a built-in, or a module naming no file of its own
        folder, base = os.path.split(path)
        if folder in _ADDED_FOLDERS and base.endswith(".py") and base != "__init__.py":
            found.add(os.path.join(folder, base))
        elif base == "__init__.py" and os.path.dirname(folder) in _ADDED_FOLDERS:
            found.add(folder)
    return sorted(found)


def _holds_module(folder: str, name: str) -> bool:
    return os.path.isfile(os.path.join(folder, f"{name}.py")) or os.path.isdir(os.path.join(folder, name))


def _on_path(folder: str) -> bool:
    """Whether ``folder`` is on ``sys.path`` already ('' is the current folder)."""
    real = os.path.realpath(folder)
    return any(os.path.realpath(p or os.curdir) == real for p in sys.path)


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


MAX_DETAIL = 300  # characters of an error message of your own code quoted in a one-line error


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of an error raised by your own code, on one line and shortened (``sys.exit(code)``
    for SystemExit)."""
    if isinstance(exc, SystemExit):
        return f"sys.exit({exc.code!r})"
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= MAX_DETAIL else text[: MAX_DETAIL - 3] + "..."


_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the fdam_ray package
_LIBRARY_DIRS = tuple({sysconfig.get_path(name) for name in ("stdlib", "purelib", "platlib")} - {None})


def raised_at(exc: BaseException) -> str:
    """`` (at file:line in function)``: where in your own code ``exc`` was raised: the innermost frame of its
    traceback outside fdam_ray and outside installed libraries (else outside fdam_ray), or '' when none is."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(_OWN_DIR + os.sep)]
    yours = [f for f in frames if not f.filename.startswith("<")
             and not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS)]
    if not frames:
        return ""
    frame = (yours or frames)[-1]
    return f" (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
