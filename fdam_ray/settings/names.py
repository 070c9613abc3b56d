"""Config keys to field names: sections flattened (``model: {name: cnn}``, ``model.weights=W``), an unknown key
named in one line with the field it most likely means, a key given twice on the command line refused.

The rules take the names as a :class:`Names` table, so that :mod:`fdam_ray.config` applies them with the live
fields and ``fdam train`` with the stored table (:mod:`fdam_ray.settings.catalog`) before torch is imported: the
same key gives the same message either way.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from fdam_ray.settings.redact import clip, short
from fdam_ray.settings.sections import ConfigError
from fdam_ray.settings.yamlio import kind_of


@dataclasses.dataclass(frozen=True)
class Names:
    """What reading keys needs to know of the fields.

    Attributes:
        fields: every field's name.
        aliases: names people reach for (and the paper's symbols) -> the field they mean (suggestions only).
        renamed: old names still read (as their new fields).
        records: top-level keys of a config file that are no field (the versions record, the ``flower`` section).
    """

    fields: frozenset[str]
    aliases: Mapping[str, str]
    renamed: frozenset[str] = frozenset()
    records: frozenset[str] = frozenset()

    @property
    def section_keys(self) -> frozenset[str]:
        """Keys whose mapping is a section of fields: the names that start other fields' names (``model``,
        ``lr``, ``pretrain``, ``client_data``)."""
        return frozenset("_".join(parts[:i]) for name in self.fields for parts in [name.split("_")]
                         for i in range(1, len(parts)))


def flatten_sections(values: Mapping[str, Any], names: Names,
                     spelled: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """Sections to flat names: ``model: {name: cnn, weights: W}`` or ``model.weights=W`` -> ``model_weights``.

    A section's ``name`` key sets the field named like the section (``model``). A mapping given to a field that
    starts no other field's name (``model_width: {width: 16}``, from an alias or an anchor) is that field's
    value, refused by the field in one line naming it, not read as fields ``model_width_width``.
    ``spelled`` gets, for each name made from a section and one of its keys, how the user wrote them.
    """
    sections = names.section_keys
    out: dict[str, Any] = {}
    for key, value in values.items():
        check_name(key)
        if isinstance(value, Mapping) and (key in sections or key not in names.fields or set(value) == {"name"}):
            for sub, v in value.items():
                check_name(sub, key)
                out[_joined(key, sub, spelled)] = v
        elif "." in key:
            section, _, sub = key.partition(".")
            if section in names.fields and section not in sections and sub != "name":
                raise ConfigError(f"config key '{clip(key, 80)}': '{section}' is a field, not a section; give "
                                  f"{section}=VALUE (see `fdam fields {section}`)")
            out[_joined(section, sub, spelled)] = value
        else:
            out[key] = value
    return out


def _joined(section: str, sub: str, spelled: dict[str, tuple[str, str]] | None) -> str:
    """The flat name of key ``sub`` of section ``section`` (``name``: the section's own field)."""
    if sub == "name":
        return section
    flat = f"{section}_{sub}"
    if spelled is not None:
        spelled[flat] = (section, sub)
    return flat


def check_name(key: Any, section: str = "") -> None:
    """A config key is text (a field or section name); ``1: 2`` or ``null: x`` is one line naming it."""
    if not isinstance(key, str):
        where = f" in section '{clip(section, 80)}'" if section else ""
        raise ConfigError(f"config key {short(key, 60)}{where} is {kind_of(key)}, not a field name; keys "
                          "are field names, written as text (see `fdam fields`)")


def unknown_key(key: str, spelled: Mapping[str, tuple[str, str]], names: Names) -> ConfigError:
    """The error of a key that is no field, naming it as the user wrote it (a section's key: the section too)."""
    section, sub = spelled.get(key, ("", ""))
    if sub in names.fields:  # model: {model_width: 16}
        inside = sub[len(section) + 1:] if sub.startswith(f"{section}_") else ""
        return ConfigError(f"config key '{clip(sub, 80)}' under '{clip(section, 80)}' is a field of its own, not a "
                           f"key of section '{clip(section, 80)}': give it at the top level"
                           + (f", or as '{inside}' under '{section}'" if inside else ""))
    hint = nearest_field(key, names)
    extra = f"; did you mean '{hint}'?" if hint else ""
    where = "" if not section else f" (key '{clip(sub, 80)}' under '{clip(section, 80)}'" + (
        ")" if section in names.section_keys else ", which is no section of fields)")
    return ConfigError(f"unknown config field '{clip(key, 80)}'{where}{extra} (see `fdam fields` for the list)")


def nearest_field(key: str, names: Names) -> str | None:
    """The field an unknown key most likely means (a near spelling of a field or of a common other name)."""
    if len(key) > 100:  # no field is named so long; difflib would take seconds on a huge key
        return None
    lowered = key.lower()
    if lowered in names.aliases:
        return names.aliases[lowered]
    hint = difflib.get_close_matches(lowered, [*sorted(names.fields), *names.aliases], n=1)
    return None if not hint else names.aliases.get(hint[0], hint[0])


def check_keys(values: Mapping[str, Any], names: Names) -> dict[str, Any]:
    """``values`` (a config file's mapping with the command line's keys) as flat field names; a key that is no
    field is the one-line :func:`unknown_key` error."""
    spelled: dict[str, tuple[str, str]] = {}
    given = flatten_sections({k: v for k, v in values.items() if k not in names.records}, names, spelled)
    for key in given:
        if key not in names.fields and key not in names.renamed:
            raise unknown_key(key, spelled, names)
    return given


def once_each(items: Iterable[str], names: Names) -> None:
    """Command-line ``key=value`` items name each field once (``seed=1 seed=2``, or ``model.weights=a
    model_weights=b``, is refused in one line, as a YAML file's duplicate key is)."""
    seen: dict[str, str] = {}
    for item in items:
        key = item.partition("=")[0].strip()
        flat = next(iter(flatten_sections({key: None}, names)), key)
        if flat in seen:
            raise ConfigError(f"config field '{clip(flat, 80)}' is given twice on the command line "
                              f"({clip(seen[flat], 80)}, {clip(item, 80)}): give it once")
        seen[flat] = item
