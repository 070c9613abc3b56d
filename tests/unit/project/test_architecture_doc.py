"""docs/architecture.md follows the code: the paths, modules and symbols it names exist, its worked examples name
files and symbols that are there, and it names every subpackage and every top-level module of the package.

What is read of the page (inside backticks, and in its Python blocks):

- ``fdam_ray/a/b.py`` and ``fdam_ray/a/`` (also ``tests/...``, ``docs/...``): the file or folder exists;
- ``fdam_ray/a/b.py::Name`` or ``::Class.member``: defined in that file (by :mod:`ast`, without importing it: a
  def, a class, an assignment, an import it re-exports, or a member of the class or of one of its bases);
- ``fdam_ray.a.b.Name``: the same, the module found from the dotted name;
- ``Class.member`` where ``Class`` is a class of the package: some class of that name has the member;
- ``from fdam_ray.a import Name`` in a Python block: the name is there.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "fdam_ray"
DOC = ROOT / "docs" / "architecture.md"

_CODE = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"\b((?:fdam_ray|tests|docs)/(?:[\w/]*\.(?:py|md)|[\w/]*/))(?:::([\w.]+))?")
_DOTTED = re.compile(r"\bfdam_ray(?:\.\w+)+")
_MEMBER = re.compile(r"^([A-Z]\w*)\.(\w+)(?:\(.*\))?$")


def _doc() -> str:
    return DOC.read_text()


def _spans(text: str) -> list[str]:
    """What the page has in backticks, its fenced blocks left out (their imports are checked on their own)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return _CODE.findall(prose)


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _module_file(dotted: str) -> Path | None:
    """The file of module ``dotted`` (``fdam_ray.a.b``), or None."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _body_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body binds (defs, classes, assignments, imports), each with its node."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names[n.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:`, guarded imports
            names.update(_body_names(node.body))
    return names


@functools.cache
def _classes() -> dict[str, list[tuple[Path, ast.ClassDef]]]:
    """Every class of the package by its name."""
    found: dict[str, list[tuple[Path, ast.ClassDef]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append((path, node))
    return found


def _class_has(path: Path, cls: ast.ClassDef, member: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether ``cls`` (in ``path``) or one of its bases in the package defines ``member``."""
    if member in _body_names(cls.body):
        return True
    for base in cls.bases:
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        if name is None or name in seen:
            continue
        if any(_class_has(p, c, member, seen | {cls.name}) for p, c in _classes().get(name, [])):
            return True
    return False


def _resolves(path: Path, qualname: str, depth: int = 0) -> bool:
    """Whether ``qualname`` (``Name`` or ``Class.member``) is defined in the module file ``path``."""
    first, _, rest = qualname.partition(".")
    node = _body_names(_tree(path).body).get(first)
    if node is None:
        sub = _module_file(_dotted_of(path) + "." + first) if path.name == "__init__.py" else None
        return sub is not None and (not rest or _resolves(sub, rest, depth + 1))
    if isinstance(node, ast.ImportFrom) and depth < 5:  # a re-export: follow it into the package
        if node.module is None or not node.module.startswith("fdam_ray"):
            return not rest  # a name from elsewhere: it is there, its members are not ours to check
        target = _module_file(node.module)
        alias = next(a for a in node.names if (a.asname or a.name) == first)
        sub = _module_file(f"{node.module}.{alias.name}")
        if sub is not None:
            return not rest or _resolves(sub, rest, depth + 1)
        return target is not None and _resolves(target, ".".join([alias.name, *([rest] if rest else [])]), depth + 1)
    if not rest:
        return True
    if isinstance(node, ast.ClassDef):
        member, _, deeper = rest.partition(".")
        return _class_has(path, node, member) and not deeper
    return False


def _dotted_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _dotted_resolves(dotted: str) -> bool:
    """``fdam_ray.a.b`` (a module) or ``fdam_ray.a.b.Name[.member]``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is not None:
            return cut == len(parts) or _resolves(path, ".".join(parts[cut:]))
    return False


def _references() -> tuple[list[tuple[str, str | None]], list[str], list[str]]:
    """The page's (path, symbol) references, its dotted names and its ``Class.member`` names."""
    paths, dotted, members = [], [], []
    for span in _spans(_doc()):
        paths += [(m.group(1), m.group(2)) for m in _PATH.finditer(span)]
        if "/" not in span:
            dotted += _DOTTED.findall(span)
        m = _MEMBER.match(span.strip())
        if m and m.group(1) in _classes():
            members.append(f"{m.group(1)}.{m.group(2)}")
    return paths, dotted, members


def test_the_page_is_read_at_all():
    paths, dotted, members = _references()
    assert len(paths) > 60 and len(dotted) >= 3 and len(members) > 20, (len(paths), len(dotted), len(members))


def test_every_path_the_page_names_exists_and_every_symbol_after_it_is_defined_there():
    paths, _, _ = _references()
    missing = sorted({p for p, _ in paths if not (ROOT / p).exists()})
    assert missing == [], f"docs/architecture.md names paths that are not there: {missing}"
    undefined = sorted(f"{p}::{s}" for p, s in paths if s is not None and not _resolves(ROOT / p, s))
    assert undefined == [], f"docs/architecture.md names symbols that are not defined where it says: {undefined}"


def test_every_dotted_name_the_page_uses_is_defined():
    _, dotted, _ = _references()
    assert [d for d in dotted if not _dotted_resolves(d)] == []


def test_every_class_member_the_page_names_exists_on_a_class_of_that_name():
    _, _, members = _references()
    wrong = [m for m in members
             if not any(_class_has(p, c, m.split(".")[1]) for p, c in _classes()[m.split(".")[0]])]
    assert wrong == [], f"docs/architecture.md names members no class of that name has: {wrong}"


def test_the_imports_of_the_pages_code_blocks_are_there():
    blocks = re.findall(r"```python\n(.*?)```", _doc(), flags=re.S)
    assert len(blocks) >= 3
    wrong = []
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fdam_ray"):
                names = [f"{node.module}.{a.name}" for a in node.names]
                wrong += [n for n in names if not _dotted_resolves(n)]
    assert wrong == []


def test_three_worked_examples_each_name_the_files_and_symbols_to_touch():
    sections = re.split(r"^### Worked example", _doc(), flags=re.M)[1:]
    assert len(sections) == 3, "three worked examples: an algorithm, a transport, a dataset"
    for section in sections:
        body = re.split(r"^##? ", section, flags=re.M)[0]
        refs = [m for span in _spans(body) for m in _PATH.finditer(span)]
        files = {m.group(1) for m in refs if m.group(1).startswith("fdam_ray/")}
        symbols = {m.group(2) for m in refs if m.group(2)}
        assert len(files) >= 3 and len(symbols) >= 3, (section.splitlines()[0], files, symbols)


def test_every_subpackage_and_every_top_level_module_is_on_the_page():
    text = _doc()
    subpackages = sorted(p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__init__.py")
                         if p.parent != PACKAGE)
    assert {"flower", "executors/ray/transports", "outputs", "tuning", "data", "algorithms"} <= set(subpackages)
    unnamed = [s for s in subpackages if f"fdam_ray/{s}/" not in text and f"{s.rpartition('/')[2]}/" not in text]
    assert unnamed == [], f"docs/architecture.md does not say what these subpackages are: {unnamed}"
    modules = sorted(p.name for part in ("", "assembly", "loop", "core", "clients", "features", "settings", "files")
                     for p in (PACKAGE / part).glob("*.py") if p.name != "__init__.py" or not part)
    assert {"cli.py", "federation.py", "state.py", "sections.py"} <= set(modules)
    unnamed = [m for m in modules if not re.search(rf"(?<![\w/]){re.escape(m)}", text)]
    assert unnamed == [], f"docs/architecture.md does not place these modules: {unnamed}"
    flower = sorted(p.name for p in (PACKAGE / "flower").glob("*.py"))
    assert [m for m in flower if m not in text] == [], "docs/architecture.md maps flower/ file by file"


def test_the_limits_the_page_states_point_at_the_test_that_holds_them():
    text = _doc()
    assert "tests/unit/project/test_limits.py" in text and "500 lines" in text and "complexity 25" in text
