"""Run configuration: one flat set of plain names shared by YAML files, the CLI and Tune.

Each field is declared once, in the section class of the code that reads it
(`fdam_ray.settings.sections.setting`: type, default, meaning with the paper's
symbol, allowed values). [`Config`][fdam_ray.config.Config] inherits every section, so a type
checker sees each field; the field table [`FIELDS`][fdam_ray.config.FIELDS], ``fdam fields``, the
CLI's ``key=value`` keys and Tune's search-space keys are generated from the
sections (`SECTION_CLASSES`). [`build_config`][fdam_ray.config.build_config] is the only way to make
a [`Config`][fdam_ray.config.Config]: it rejects unknown keys, coerces types
(`fdam_ray.settings.coercion`), applies the chosen algorithm's preset defaults for
fields the user left unset, checks every value and then each section's rules
across its fields, raising [`ConfigError`][fdam_ray.config.ConfigError] (a ``ValueError``) that names
the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from fdam_ray.algorithms import AlgorithmSection
from fdam_ray.algorithms.local import LocalStepSection
from fdam_ray.algorithms.presets import PRESETS, Preset
from fdam_ray.clients.client import ClientSection
from fdam_ray.core.schedules import ScheduleSection
from fdam_ray.data.balanced import SamplingSection
from fdam_ray.data.sections import CHESTXRAY_SOURCES, DATASET_NAMES, ChestXraySection, DataSection, SyntheticSection
from fdam_ray.executors.base import ExecutorSection
from fdam_ray.executors.deadlines import DeadlineSection, deadline_value
from fdam_ray.executors.ray_section import RaySection, resource_list
from fdam_ray.executors.transfer import TransferSection
from fdam_ray.features.precision import PrecisionSection
from fdam_ray.features.sites import SiteSection
from fdam_ray.files.versions import VERSIONS_KEY
from fdam_ray.files.yamlfile import read_yaml_file
from fdam_ray.loop.evaluation import ValidationSection
from fdam_ray.loop.pretrain_section import PretrainSection
from fdam_ray.models import MODEL_NAMES, ModelSection
from fdam_ray.outputs import OutputSection
from fdam_ray.privacy.section import PrivacySection
from fdam_ray.settings import catalog
from fdam_ray.settings.coercion import CommandLineText, Field, coerce, from_text, register_kind
from fdam_ray.settings.factories import python_name
from fdam_ray.settings.names import Names, flatten_sections, once_each, unknown_key
from fdam_ray.settings.names import nearest_field as names_nearest
from fdam_ray.settings.redact import clip, short
from fdam_ray.settings.sections import (
    AT_LEAST_ONE,
    NONNEGATIVE,
    SETTING,
    ConfigError,
    Section,
    Setting,
    fail,
    owned_fields,
    setting,
    shared_names,
)
from fdam_ray.settings.yamlio import load_yaml

__all__ = ["CHESTXRAY_SOURCES", "DATASET_NAMES", "FIELDS", "FIELD_BY_NAME", "MODEL_NAMES", "RENAMED_PER_ACTOR",
           "RESUME_MAY_CHANGE", "SECTIONS", "SECTION_CLASSES", "CommandLineText", "Config", "ConfigError", "Field",
           "RunSection", "build_config", "describe_fields", "field_type", "load_config_file", "load_yaml",
           "nearest_field", "parse_overrides", "read_text_value", "read_yaml_file", "row_of", "select_fields",
           "typed_value"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSection(Section):
    """What the driver loop reads of a run beyond the other sections: its seed and how often it scores."""

    name = "run"

    seed: int = setting(0, "Seed of model init, partitions and sampling.", check=NONNEGATIVE)
    eval_every: int = setting(100, "Evaluate the global model every this many iterations (at round ends).",
                              check=AT_LEAST_ONE, resume=True)


# Every section, in the order of `fdam fields` (a section's own fields in the order it declares them).
SECTION_CLASSES: tuple[type[Section], ...] = (
    AlgorithmSection, ScheduleSection, DataSection, SyntheticSection, ChestXraySection, ModelSection,
    PretrainSection, ClientSection, LocalStepSection, SamplingSection, PrecisionSection, RunSection, ValidationSection,
    ExecutorSection, RaySection, DeadlineSection, TransferSection, OutputSection, SiteSection, PrivacySection,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(AlgorithmSection, ScheduleSection, SyntheticSection, ChestXraySection, ModelSection, PretrainSection,
             ClientSection, LocalStepSection, SamplingSection, PrecisionSection, RunSection, ValidationSection,
             ExecutorSection, RaySection, DeadlineSection, TransferSection, OutputSection, SiteSection,
             PrivacySection):
    """A validated run configuration (every section's fields); build it with
    [`build_config`][fdam_ray.config.build_config]."""

    name = "config"

    def to_dict(self) -> dict[str, Any]:
        """The values as data, in the order of [`FIELDS`][fdam_ray.config.FIELDS]; a factory given in Python is recorded
        by its name (``python:module.name``)."""
        values = dataclasses.asdict(self)
        return {f.name: _plain(values[f.name]) for f in FIELDS}

    def replace(self, **changes: Any) -> Config:
        """A new config with ``changes``, validated as [`build_config`][fdam_ray.config.build_config] validates any; the
        fields the user named ([`names`][fdam_ray.config.Config.names]) are this config's and those changed."""
        new = build_config({**dataclasses.asdict(self), **changes})
        object.__setattr__(new, "_named", self._named_fields() | new._named_fields() & set(changes))
        return new

    def names(self, field: str) -> bool:
        """Whether the user named ``field`` (given it a value, the default's included) rather than left it out."""
        return field in self._named_fields()

    def _named_fields(self) -> frozenset[str]:
        return self.__dict__.get("_named", frozenset())

    def check(self) -> None:
        """Every section's rules across its fields, in the order of `SECTION_CLASSES`."""
        for cls in SECTION_CLASSES:
            cls.of(self).check()


def _plain(value: Any) -> Any:
    return python_name(value) if callable(value) else value


# Kinds whose reading lives with the section that declares them (settings/ imports no part of the package).
register_kind("resource_list", resource_list)
register_kind("deadline", deadline_value)

# Kinds read off a field's type; "batch" and "factory" are declared (an int or a str with rules of their own).
_KIND_OF_TYPE: dict[Any, str] = {int: "int", float: "float", bool: "bool", str: "str", tuple[int, ...]: "int_list",
                                 tuple[str, ...]: "str_list", tuple[dict, ...]: "resource_list",
                                 int | str: "int_auto", bool | str: "bool_auto"}


def field_type(field: Field) -> Any:
    """The Python type of a field's validated value, as its section declares it (``X | None`` when optional)."""
    owner = next(cls for cls in SECTION_CLASSES if cls.name == field.section)
    return typing.get_type_hints(owner)[field.name]


def _without_none(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    if type(None) not in args:
        return hint, False
    rest = [a for a in args if a is not type(None)]
    return functools.reduce(operator.or_, rest), True


def _field_of(cls: type[Section], field: dataclasses.Field, hints: dict[str, Any]) -> Field:
    meta: Setting = field.metadata[SETTING]
    plain, optional = _without_none(hints[field.name])
    kind = meta.kind or _KIND_OF_TYPE.get(plain)
    if kind is None:
        raise TypeError(f"{cls.__name__}.{field.name}: no kind of config field for type {plain}; declare kind=")
    return Field(field.name, kind, field.default, meta.doc, meta.choices, meta.check, meta.allowed, optional,
                 cls.name, meta.resume, meta.aliases)


def _fields_of_sections() -> tuple[Field, ...]:
    """The field table: each section's own fields; a field declared twice, or shared but declared nowhere, is a
    programming error raised at import."""
    fields: list[Field] = []
    for cls in SECTION_CLASSES:
        hints = typing.get_type_hints(cls)
        fields += [_field_of(cls, f, hints) for f in owned_fields(cls)]
    names = [f.name for f in fields]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TypeError(f"config fields declared by more than one section: {', '.join(twice)}")
    orphans = [f"{cls.__name__}.{n}" for cls in SECTION_CLASSES for n in shared_names(cls) if n not in names]
    if orphans:
        raise TypeError(f"shared config fields that no section declares: {', '.join(orphans)}")
    return tuple(fields)


FIELDS: tuple[Field, ...] = _fields_of_sections()
FIELD_BY_NAME = {f.name: f for f in FIELDS}

# `fdam fields SECTION`: the fields each section declares.
SECTIONS: dict[str, tuple[str, ...]] = {cls.name: tuple(f.name for f in owned_fields(cls)) for cls in SECTION_CLASSES}

# Fields that may differ when a run is resumed (they change how it runs, not what it computes).
RESUME_MAY_CHANGE = frozenset(f.name for f in FIELDS if f.resume)

# Resource fields named per client before clients could share an actor: read as the per-actor field when each
# actor hosts one client (the same thing then), refused otherwise (the user must say what an actor gets).
RENAMED_PER_ACTOR = {"cpus_per_client": "cpus_per_actor", "gpus_per_client": "gpus_per_actor",
                     "threads_per_client": "threads_per_actor"}

# Names people reach for, and the paper's symbols, mapped to the field they mean (only for suggestions).
_OTHER_NAMES = {alias: f.name for f in FIELDS for alias in f.aliases}
# What reading keys knows of the fields (fdam_ray.settings.names; `fdam train` reads the same from fields.json).
NAMES = Names(frozenset(FIELD_BY_NAME), _OTHER_NAMES, frozenset(RENAMED_PER_ACTOR), frozenset({VERSIONS_KEY, "flower"}))
_SECTION_KEYS = NAMES.section_keys


def _flatten_sections(values: Mapping[str, Any], spelled: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """:func:`fdam_ray.settings.names.flatten_sections` with this fdam-ray's fields."""
    return flatten_sections(values, NAMES, spelled)


def nearest_field(key: str) -> str | None:
    """The field an unknown key most likely means (a near spelling of a field or of a common other name)."""
    return names_nearest(key, NAMES)


def build_config(values: Mapping[str, Any] | None = None, **overrides: Any) -> Config:
    """Make a validated [`Config`][fdam_ray.config.Config] from a mapping (and keyword overrides).

    Fields the user does not set take the algorithm preset's default, then the
    field's own default. Nested sections are accepted and flattened (see
    `_flatten_sections`). Each section's rules across its fields
    (`check`) run last. Raises
    [`ConfigError`][fdam_ray.config.ConfigError] on the first bad value.
    """
    given = _given(values, overrides)
    algorithm = coerce(FIELD_BY_NAME["algorithm"], given.get("algorithm", FIELD_BY_NAME["algorithm"].default))
    preset = PRESETS[algorithm]
    merged = {field.name: _value(field, given, preset) for field in FIELDS}
    for name, value in preset.fixed.items():
        if name in given and merged[name] != value:
            raise fail(name, merged[name], f"algorithm '{algorithm}' requires {name} = {short(value)}")
        merged[name] = value
    config = Config(**merged)
    config.check()
    if values and "flower" in values:  # the sites it names are the study's
        from fdam_ray.executors.flower_section import split_config  # imports no Flower

        split_config(values)[1].check_sites(config.num_clients)
    object.__setattr__(config, "_named", frozenset(given))  # not a field: what the user named, for Config.names
    return config


def _given(values: Mapping[str, Any] | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The user's keys as flat field names (old names read as their new ones); an unknown key is an error. A run's
    ``config.yaml`` read back keeps the versions it ran under (:data:`VERSIONS_KEY`): a record, not a field."""
    # the `flower:` section is read by fdam_ray.flower (a consortium's settings); a simulation of the study checks it
    # (a broken one is the same study's error: one line naming the field) and then ignores it
    if values and "flower" in values:
        from fdam_ray.executors.flower_section import split_config  # imports no Flower

        split_config(values)
    values = {k: v for k, v in (values or {}).items() if k not in NAMES.records}
    spelled: dict[str, tuple[str, str]] = {}
    given = _flatten_sections(values, spelled)
    given.update(_flatten_sections(overrides, spelled))
    given = _read_renamed(given)
    for key in given:
        if key not in FIELD_BY_NAME:
            raise unknown_key(key, spelled, NAMES)
    return given


def _value(field: Field, given: Mapping[str, Any], preset: Preset) -> Any:
    """A field's value: the user's, else the algorithm preset's default, else the field's own default."""
    if field.name in given:
        return coerce(field, given[field.name])
    if field.name in preset.defaults:
        return coerce(field, preset.defaults[field.name])
    return field.default if field.default is None else coerce(field, field.default)


def _read_renamed(given: dict[str, Any]) -> dict[str, Any]:
    """``cpus_per_client`` & co. as ``cpus_per_actor`` & co. when every actor hosts one client; else an error."""
    old = [k for k in RENAMED_PER_ACTOR if k in given]
    if not old:
        return given
    m = coerce(FIELD_BY_NAME["clients_per_actor"], given.get("clients_per_actor", 1))
    out = dict(given)
    for key in old:
        new = RENAMED_PER_ACTOR[key]
        if new in given:
            raise ConfigError(f"config fields '{key}' and '{new}' are both given; '{key}' is the old name of "
                              f"'{new}': give '{new}' only")
        if m != 1:
            raise ConfigError(f"config field '{key}' is now '{new}' (resources are reserved per actor, and "
                              f"clients_per_actor = {m} clients share one): set '{new}' instead")
        # coerced under the name the user gave, so an error names it
        out[new] = coerce(dataclasses.replace(FIELD_BY_NAME[new], name=key), out.pop(key))
    return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["lr=0.1", "run_name=007"]`` -> ``{"lr": "0.1", "run_name": "007"}`` as `CommandLineText`;
    [`build_config`][fdam_ray.config.build_config] reads each by its field's type (``lr`` -> 0.1, ``run_name`` ->
    "007")."""
    once_each(items, NAMES)
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{clip(item, 80)}' is not of the form key=value")
        out[key.strip()] = CommandLineText(raw)
    return out


def typed_value(key: str, value: Any) -> Any:
    """A command-line value as the field ``key`` reads it (plain YAML for names that are not fields)."""
    field = FIELD_BY_NAME.get(_flatten_sections({key: None}).popitem()[0])
    if isinstance(value, CommandLineText) and field is not None:
        return from_text(field, value)
    return read_text_value(value)


def read_text_value(value: Any) -> Any:
    """A command-line value read as YAML (for settings that are not config fields, such as tune options)."""
    if isinstance(value, CommandLineText):
        try:
            return load_yaml(value) if value.strip() else None
        except yaml.YAMLError:
            return str(value)
    return value


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML config file into a mapping (validated later by [`build_config`][fdam_ray.config.build_config])."""
    data = read_yaml_file(path, "config file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{clip(path)}' must hold a mapping of field: value, not {type(data).__name__}")
    return data


def select_fields(terms: list[str] | tuple[str, ...] = ()) -> list[Field]:
    """The fields ``fdam fields TERM ...`` lists (:func:`fdam_ray.settings.catalog.select` over :data:`FIELDS`)."""
    return catalog.select(FIELDS, list(SECTIONS), terms)


def row_of(field: Field) -> catalog.Row:
    """What ``fdam fields`` shows of ``field``, as text (a row of the stored table ``settings/fields.json``)."""
    allowed = ", ".join(field.choices) if field.choices else field.allowed
    if field.kind == "factory":
        allowed += ", or module:attr"
    return catalog.Row(field.section, field.name, str(field.default), field.doc, allowed)


def catalog_table() -> tuple[list[str], list[catalog.Row]]:
    """(section names, rows) of ``fdam fields``: every field of :data:`FIELDS`, then the ``flower:`` section's
    (``flower.<name>``: read by a consortium's server, checked by every run)."""
    from fdam_ray.executors.flower_section import SECTION_KEY, catalog_rows  # imports no Flower

    return [*SECTIONS, SECTION_KEY], [*(row_of(f) for f in FIELDS), *(catalog.Row(*r) for r in catalog_rows())]


def describe_fields(terms: list[str] | tuple[str, ...] = ()) -> str:
    """A plain-text table of every field (or those ``terms`` select), its default and its meaning (for `fdam
    fields`); a term that selects nothing is a [`ConfigError`][fdam_ray.config.ConfigError] naming the sections."""
    sections, rows = catalog_table()
    return catalog.describe(rows, sections, terms)
