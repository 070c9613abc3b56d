"""``fdam fields`` reads a stored table (fdam_ray/settings/fields.json): it equals the live sections' table and
prints what the live table prints."""

from __future__ import annotations

import json

import pytest

from fdam_ray import catalog_writer
from fdam_ray.config import FIELDS, SECTIONS, ConfigError, describe_fields
from fdam_ray.executors.flower_section import FlowerSection
from fdam_ray.settings import catalog


def flower_fields():
    import dataclasses

    return dataclasses.fields(FlowerSection)

STALE = ("fdam_ray/settings/fields.json differs from the sections: rewrite it with "
         "python -m fdam_ray.catalog_writer")


def test_the_stored_table_is_the_live_one():
    sections, rows = catalog.stored()
    assert sections == [*SECTIONS, "flower"], STALE  # the flower: section last (a consortium's server reads it)
    assert [r.name for r in rows] == [f.name for f in FIELDS] + [f"flower.{f.name}" for f in flower_fields()], STALE
    assert json.loads(catalog.STORED.read_text(encoding="utf-8")) == catalog_writer.live(), STALE


@pytest.mark.parametrize("terms", [(), ("schedule",), ("privacy", "noise"), ("lr",), ("SEED",), ("executor",)])
def test_the_stored_table_prints_what_the_live_one_prints(terms):
    assert catalog.describe_stored(terms) == describe_fields(terms), STALE


def test_a_section_selects_exactly_its_own_fields_in_declared_order():
    listed = [line.split()[0] for line in catalog.describe_stored(["schedule"]).splitlines()]
    assert listed == list(SECTIONS["schedule"])
    everything = [line.split()[0] for line in catalog.describe_stored().splitlines()]
    assert everything == [f.name for f in FIELDS] + [f"flower.{f.name}" for f in flower_fields()]
    assert [line.split()[0] for line in catalog.describe_stored(["flower"]).splitlines()] == everything[-10:]


def test_a_term_that_selects_nothing_names_the_sections():
    with pytest.raises(ConfigError, match=r"no config field matches 'zzz'; give a section \(algorithm, schedule"):
        catalog.describe_stored(["zzz"])


def test_written_table_reads_back_as_the_live_one(tmp_path):
    path = tmp_path / "fields.json"
    catalog_writer.write(path)
    assert json.loads(path.read_text(encoding="utf-8")) == catalog_writer.live()
    assert len(path.read_text(encoding="utf-8").splitlines()) == len(FIELDS) + len(flower_fields()) + 4  # one a line
