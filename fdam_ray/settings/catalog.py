"""The field table of ``fdam fields``, stored beside the package so that listing fields stays light.

Each config field is declared in the section class of the code that reads it
(:mod:`fdam_ray.config`), and that code imports torch, NumPy and scikit-learn:
building the live table takes seconds. ``fdam fields`` and ``fdam fields -h``
only show the table, so they read ``fields.json`` (next to this module), which
holds each field's section, name, default, meaning and allowed values as text.
The file is written from the live sections by ``python -m
fdam_ray.catalog_writer`` and a unit test checks that it equals them, so it
cannot drift. Selecting and formatting are the same functions for the live
table (:func:`fdam_ray.config.describe_fields`) and the stored one.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol, TypeVar

from fdam_ray.settings.names import Names
from fdam_ray.settings.redact import short
from fdam_ray.settings.sections import ConfigError

log = logging.getLogger(__name__)

STORED = Path(__file__).with_name("fields.json")


class Row(NamedTuple):
    """One line of ``fdam fields``: what it shows of a field, as text."""

    section: str
    name: str
    default: str
    doc: str
    allowed: str


class Named(Protocol):
    """What selecting needs of a field: its section, name and meaning (a :class:`Row` or a config ``Field``)."""

    @property
    def section(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def doc(self) -> str: ...


T = TypeVar("T", bound=Named)


def select(fields: Iterable[T], sections: Sequence[str], terms: Sequence[str] = ()) -> list[T]:
    """The fields ``fdam fields TERM ...`` lists: for each term (case-insensitive), the fields of the section it
    names (one of ``sections``), else those with the term in their name or starting a word of their meaning; with
    several terms, the fields every term selects."""
    chosen = list(fields)
    for term in terms:
        word = term.lower().strip()
        if word in sections:
            chosen = [f for f in chosen if f.section == word]
            continue
        pattern = re.compile(rf"(?<![\w-]){re.escape(word)}", re.IGNORECASE)
        chosen = [f for f in chosen if word in f.name.lower() or pattern.search(f.doc)]
    return chosen


def describe(rows: Sequence[Row], sections: Sequence[str], terms: Sequence[str] = ()) -> str:
    """A plain-text table of ``rows`` (or those ``terms`` select): name, default, meaning and what is allowed; a
    term that selects nothing is a :class:`ConfigError` naming the ``sections``."""
    chosen = select(rows, sections, terms)
    if not chosen:
        raise ConfigError(f"no config field matches {short(' '.join(terms))}; give a section ({', '.join(sections)}) "
                          "or a word of a field's name or meaning, or nothing for every field")
    return "\n".join(f"{r.name:<24} {r.default:<10} {r.doc}" + (f" [{r.allowed}]" if r.allowed else "")
                     for r in chosen)


def stored() -> tuple[list[str], list[Row]]:
    """(the section names in order, the rows) of ``fields.json``."""
    data = json.loads(STORED.read_text(encoding="utf-8"))
    return list(data["sections"]), [Row(*row) for row in data["fields"]]


def stored_names() -> Names:
    """What reading config keys needs (:class:`~fdam_ray.settings.names.Names`), from ``fields.json``: ``fdam
    train`` checks every key's name with it before torch is imported."""
    data = json.loads(STORED.read_text(encoding="utf-8"))
    names = data["names"]
    fields = frozenset(row[1] for row in data["fields"] if "." not in row[1])  # flower.<name>: not a top-level key
    return Names(fields, dict(names["aliases"]), frozenset(names["renamed"]),
                 frozenset(names["records"]))


def describe_stored(terms: Sequence[str] = ()) -> str:
    """:func:`describe` of the stored table: what ``fdam fields`` prints, without importing the sections."""
    sections, rows = stored()
    return describe(rows, sections, terms)
