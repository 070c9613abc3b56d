"""The private and experimental Ray names the package relies on exist in the installed Ray, in its range."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import ray

from fdam_ray.executors.ray import compat

PACKAGE = Path(compat.__file__).resolve().parents[2]


def test_the_installed_ray_is_in_the_range_the_compat_module_states():
    assert compat.version_in_range(ray.__version__), (ray.__version__, compat.SUPPORTED)


@pytest.mark.parametrize("version,inside", [("2.60.0", True), ("2.60.3", True), ("2.59.1", False),
                                            ("2.61.0", False), ("3.0.0", False)])
def test_the_range_check_reads_its_bounds(version, inside):
    assert compat.version_in_range(version, (">=2.60", "<2.61")) is inside


@pytest.mark.parametrize("module,name", compat.PRIVATE_NAMES)
def test_every_private_name_exists_in_the_installed_ray(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


def test_the_compile_arguments_and_the_actor_id_attribute_exist():
    from ray.actor import ActorHandle
    from ray.dag import DAGNode

    parameters = inspect.signature(DAGNode.experimental_compile).parameters
    assert set(compat.COMPILE_ARGUMENTS) <= set(parameters)
    assert hasattr(ActorHandle, compat.ACTOR_ID_ATTRIBUTE)
    from ray._raylet import GcsClient, InnerGcsClient  # GcsClient forwards to its inner client

    assert hasattr(GcsClient, "__getattr__") and hasattr(InnerGcsClient, "internal_kv_get")


def test_the_compat_module_lists_every_private_module_it_imports():
    listed = {m for m, _ in compat.PRIVATE_NAMES}
    tree = ast.parse(Path(compat.__file__).read_text())
    used = {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "_private"}
    assert used and used <= listed


def test_no_module_outside_compat_touches_a_private_ray_name():
    """``ray._x`` modules, and underscore attributes or keywords of Ray objects, appear only in compat.py."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [ast.unparse(node)]
            if any(n.startswith("ray.") and any(p.startswith("_") for p in n.split(".")[1:]) for n in names):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if isinstance(node, ast.keyword) and node.arg in compat.COMPILE_ARGUMENTS:
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.value.lineno}")
    assert offenders == []
