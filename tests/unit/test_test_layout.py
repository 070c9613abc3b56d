"""The test tree itself: pytest imports test files by their basename (rootdir-relative packages are not used),
so two files of one name in tests/ and tests/unit/ stop the whole run at collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_has_a_name_of_its_own():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert len(names) > 50
    assert [n for n, count in names.items() if count > 1] == []
