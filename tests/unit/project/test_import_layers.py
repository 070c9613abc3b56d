"""The layer list of docs/architecture.md ("The map") is held here: no import of the package points up it.

The page lists the layers top to bottom in a fenced block, one ``layer: members`` line each; a member is a path
under ``fdam_ray/``: a module (``loop/client.py``) or a folder and all beneath it (``data/``), the longest member
that holds a module placing it. Every import of every module is walked with :mod:`ast` (at module level, inside
functions and under ``TYPE_CHECKING`` alike; absolute and relative), and one that points to a higher layer fails,
named by file, line and both layers, unless :data:`ALLOWED` names it with its reason. An entry of :data:`ALLOWED`
that no import needs any more fails too, so the list only shrinks.

The bare package (``import fdam_ray``, ``from fdam_ray import __version__``) is no edge: Python imports it before
any of its modules, and its ``__init__`` imports its parts only when a public name is first used.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "fdam_ray"
DOC = ROOT / "docs" / "architecture.md"

# (importer module, imported module): why the import points up, for now. Keep it short; it only shrinks.
ALLOWED: dict[tuple[str, str], str] = {}

def layers() -> list[tuple[str, list[str]]]:
    """(layer, members) top to bottom, read from the fenced block under "The map" whose lines are ``x: a b``."""
    text = DOC.read_text()
    section = text.split("## The map", 1)[1].split("\n## ", 1)[0]
    for block in re.findall(r"```\w*\n(.*?)```", section, flags=re.S):
        rows = [re.match(r"^\s*([\w-]+)\s*:\s*(\S.*?)\s*$", line) for line in block.splitlines() if line.strip()]
        if rows and all(rows):
            return [(m.group(1), m.group(2).split()) for m in rows if m]
    raise AssertionError("docs/architecture.md has no layer block (`layer: members` lines) under 'The map'")


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_of(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(path: Path, listed: list[tuple[str, list[str]]]) -> tuple[int, str] | None:
    """(rank from the top, layer) of the module file ``path``: the longest member that holds it."""
    rel = path.relative_to(PACKAGE).as_posix()
    best: tuple[int, int, str] | None = None
    for rank, (name, members) in enumerate(listed):
        for member in members:
            if rel == member or (member.endswith("/") and rel.startswith(member)):
                if best is None or len(member) > best[0]:
                    best = (len(member), rank, name)
    return None if best is None else (best[1], best[2])


def _resolve(name: str) -> str | None:
    """The package module ``name`` is, or is in (``fdam_ray.a.b.Name`` -> ``fdam_ray.a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import of the package in ``path``, wherever it is written."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base == "fdam_ray" or not base.startswith("fdam_ray"):
                continue  # the bare package (its __version__), or not ours
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("fdam_ray.")]
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.append((node.lineno, target))
    return found


def upward_imports() -> tuple[list[str], set[tuple[str, str]]]:
    """The upward imports not allowed (one line each), and the allowed ones that were seen."""
    listed = layers()
    wrong, used = [], set()
    for module, path in MODULES.items():
        here = layer_of(path, listed)
        assert here is not None
        for line, target in imports(module, path):
            there = layer_of(MODULES[target], listed)
            assert there is not None
            if there[0] >= here[0]:
                continue
            if (module, target) in ALLOWED:
                used.add((module, target))
                continue
            wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}: layer '{here[1]}' -> '{there[1]}' "
                         "(up the list in docs/architecture.md)")
    return wrong, used


def test_the_page_lists_layers_and_places_every_module():
    listed = layers()
    assert len(listed) >= 8 and listed[0][0] == "entry" and listed[-1][0] == "settings", [n for n, _ in listed]
    assert len({n for n, _ in listed}) == len(listed), "a layer is listed twice"
    unplaced = [str(p.relative_to(ROOT)) for p in MODULES.values() if layer_of(p, listed) is None]
    assert unplaced == [], f"docs/architecture.md's layer list places no layer for: {unplaced}"
    files = [p.relative_to(PACKAGE).as_posix() for p in MODULES.values()]
    stale = [m for _, members in listed for m in members
             if not any(f == m or (m.endswith("/") and f.startswith(m)) for f in files)]
    assert stale == [], f"the layer list names what is not there: {stale}"


def test_no_import_points_up_the_layer_list():
    wrong, _ = upward_imports()
    assert wrong == [], "imports that point up the layer list:\n" + "\n".join(wrong)


def test_every_allowed_upward_import_is_still_needed():
    _, used = upward_imports()
    assert sorted(set(ALLOWED) - used) == [], "these ALLOWED entries are no longer needed: remove them"


def test_the_walk_sees_imports_inside_functions_and_under_type_checking():
    seen = dict(imports("fdam_ray.cli", MODULES["fdam_ray.cli"]))
    assert "fdam_ray.assembly.recipe" in seen.values()  # imported inside a function
    assert "fdam_ray.loop.federation" in dict(imports("fdam_ray", MODULES["fdam_ray"])).values()  # TYPE_CHECKING
    relative = imports("fdam_ray.settings.factories", MODULES["fdam_ray.settings.factories"])
    assert all(t.startswith("fdam_ray.") for _, t in relative)
