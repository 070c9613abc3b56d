"""The Python API page (docs/reference/api.md), without building the site: the docstrings of every object it renders
read as Google-style docstrings (what mkdocs.yml tells mkdocstrings), with no Sphinx role left raw (``:func:`x```
would be printed as it is), each module it renders lists its members (so a module's internal helpers stay off the
page and its table of contents), and the entry points document every parameter. The objects are found as
mkdocstrings finds them: griffe reads the source, the page's ``:::`` lines and ``members`` lists choose, and a
member shown brings its public members (``filters: ["!^_"]``). tests/project/test_docs.py builds the site itself."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/reference/api.md"
ROLE = re.compile(r":(func|class|meth|attr|mod|data|exc|obj|param|returns?|raises|rtype|type)[ :]\S*")
DIRECTIVE = re.compile(r"^::: ([\w.]+)\n((?:[ \t]+.*\n)*)", re.M)
ENTRY_POINTS = ["fdam_ray.api.train", "fdam_ray.api.train_arrays", "fdam_ray.api.train_datasets",
                "fdam_ray.api.load_model", "fdam_ray.assembly.recipe.resume", "fdam_ray.assembly.recipe.run"]


@pytest.fixture(scope="module")
def package():
    return griffe.load("fdam_ray", search_paths=[str(ROOT)], allow_inspection=False, resolve_aliases=True)


def find(package, path: str):
    obj = package[path.removeprefix("fdam_ray.")]
    return obj.final_target if obj.is_alias else obj


def public(obj) -> list:
    """The members mkdocstrings shows of a class (or a module without a members list): public, defined there."""
    return [m for name, m in obj.members.items() if not name.startswith("_") and not m.is_alias]


def rendered(package) -> dict[str, object]:
    """Every object the page renders, by the path it is shown under."""
    shown: dict[str, object] = {}

    def add(path: str, obj) -> None:
        shown[path] = obj
        if obj.is_class:
            for member in public(obj):
                add(f"{path}.{member.name}", member)

    for match in DIRECTIVE.finditer(PAGE.read_text(encoding="utf-8")):
        path, options = match.groups()
        obj = find(package, path)
        shown[path] = obj
        listed = re.search(r"members:\s*\[(.*?)\]", options)
        names = [n.strip() for n in listed.group(1).split(",")] if listed else None
        if obj.is_module:
            assert names, f"api.md renders every member of {path}: list the public ones (members: [...])"
            for name in names:
                add(f"{path}.{name}", find(package, f"{path}.{name}"))
        else:
            add(path, obj)
    return shown


def test_the_page_renders_the_entry_points_and_no_internal_helper(package):
    shown = rendered(package)
    assert set(ENTRY_POINTS) <= set(shown) and "fdam_ray.optim.PrimalDualSGD" in shown
    assert len(shown) > 60
    assert not any(p.rsplit(".", 1)[-1].startswith("_") for p in shown)
    hidden = {"fdam_ray.objectives.number_argument", "fdam_ray.objectives.check_batch", "fdam_ray.optim.heavy_ball_",
              "fdam_ray.models.record_problem", "fdam_ray.optim.ArgumentTypeError"}
    assert not hidden & set(shown)


def test_no_rendered_docstring_holds_a_raw_sphinx_role(package):
    raw = {path: ROLE.findall(obj.docstring.value) for path, obj in rendered(package).items()
           if obj.docstring and ROLE.search(obj.docstring.value)}
    assert not raw, raw


def test_every_rendered_docstring_parses_as_google_style_without_a_warning(package):
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("griffe")
    logger.addHandler(handler)
    try:
        for obj in rendered(package).values():
            if obj.docstring:
                obj.docstring.parse("google")
    finally:
        logger.removeHandler(handler)
    assert not warnings, warnings
    assert "docstring_style: google" in (ROOT / "mkdocs.yml").read_text()


def test_the_entry_points_document_every_parameter_and_what_they_return(package):
    for path in ENTRY_POINTS:
        obj = find(package, path)
        sections = {s.kind.value: s for s in obj.docstring.parse("google")}
        documented = {p.name for p in sections["parameters"].value} if "parameters" in sections else set()
        wanted = {p.name for p in obj.parameters if p.name not in ("self", "cls")}
        assert documented == wanted, (path, wanted - documented, documented - wanted)
        assert "returns" in sections, path
