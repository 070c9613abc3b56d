"""Ray in one place: only ``executors/ray/``, ``tuning/`` and the CLI import Ray.

Every module of the package is parsed (not imported) and every import in it,
at module level, inside functions or under ``TYPE_CHECKING``, is checked; so
is ``importlib.import_module("ray...")``. Everything else reaches Ray through
functions of :mod:`fdam_ray.executors.ray` (or of :mod:`fdam_ray.tuning`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fdam_ray

PACKAGE = Path(fdam_ray.__file__).resolve().parent
ALLOWED = ("executors/ray/", "tuning/", "cli.py")


def ray_imports(source: str) -> list[int]:
    """Line numbers of the imports of Ray (``ray`` or ``ray.*``) anywhere in ``source``."""

    def is_ray(name: str | None) -> bool:
        return name is not None and (name == "ray" or name.startswith("ray."))

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(is_ray(a.name) for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and is_ray(node.module):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and is_ray(node.args[0].value)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")):
            lines.append(node.lineno)
    return sorted(lines)


def modules() -> list[str]:
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def test_only_the_ray_executor_tuning_and_the_cli_import_ray():
    outside = {m: ray_imports((PACKAGE / m).read_text()) for m in modules() if not m.startswith(ALLOWED)}
    assert {m: lines for m, lines in outside.items() if lines} == {}
    inside = [m for m in modules() if m.startswith(ALLOWED) and ray_imports((PACKAGE / m).read_text())]
    assert "executors/ray/executor.py" in inside and "tuning/sweep.py" in inside  # the walk sees Ray imports


@pytest.mark.parametrize("source,found", [
    ("import ray", [1]),
    ("import numpy\nfrom ray.util import placement_group", [2]),
    ("def f():\n    import ray.exceptions as e\n    return e", [2]),
    ("if TYPE_CHECKING:\n    from ray import ObjectRef", [2]),
    ("import importlib\nimportlib.import_module('ray.dag')", [2]),
    ("import rayon\nfrom raytest import x\nfrom . import ray", []),
])
def test_the_check_finds_every_kind_of_ray_import(source, found):
    assert ray_imports(source) == found
