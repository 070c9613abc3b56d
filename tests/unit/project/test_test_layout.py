"""The test tree itself: pytest imports test files by their basename (rootdir-relative packages are not used),
so two files of one name in tests/ and tests/unit/ stop the whole run at collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def test_every_test_file_has_a_name_of_its_own():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert len(names) > 50
    assert [n for n, count in names.items() if count > 1] == []


PACKAGE = TESTS.parent / "fdam_ray"
OWN_TIERS = {"e2e", "project", "toplevel", "fixtures", "unit"}  # tiers of their own, not parts of the package


def test_every_test_folder_mirrors_a_part_of_the_package():
    parts = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert {"algorithms", "loop", "executors", "features", "settings"} <= parts
    folders = {p.parent.relative_to(TESTS) for p in TESTS.rglob("test_*.py")}
    stray = sorted(str(f) for f in folders
                   if f.parts[-1] not in parts | OWN_TIERS or (f.parts[0] != "unit" and len(f.parts) > 1))
    assert stray == [], f"test folders that name no part of fdam_ray/: {stray}"
    assert not [p for p in TESTS.glob("test_*.py")], "a test file sits at tests/ itself, outside every part"
    assert not [p for p in (TESTS / "unit").glob("test_*.py")], "a unit test sits outside every part of tests/unit"
