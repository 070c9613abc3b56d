"""Names that become folders or imports are checked as a whole: a trailing line break or a path that leaves
its folder is refused, not matched on its first line."""

from __future__ import annotations

import pytest

from fdam_ray.config import ConfigError
from fdam_ray.settings.factories import is_import_path
from fdam_ray.tuning.space import TuneOptions


@pytest.mark.parametrize("value", ["os:getcwd\n", "os:getcwd\nx", "os:\ngetcwd", " os:getcwd"])
def test_an_import_path_is_matched_whole(value):
    assert not is_import_path(value)


def test_a_plain_import_path_is_still_one():
    assert is_import_path("my_pkg.models:build")


@pytest.mark.parametrize("name", ["../x", "..", "a/b", "a\\b", "sweep\n", "x\u200by"])
def test_a_sweep_name_that_leaves_its_storage_path_is_refused(name):
    with pytest.raises(ConfigError, match="tune option 'name'"):
        TuneOptions(name=name)


def test_a_plain_sweep_name_is_kept():
    assert TuneOptions(name="paper_grid-2").name == "paper_grid-2"
