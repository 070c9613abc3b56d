"""Reading one config value: a coercer per kind of field, each naming the field, the value and what is allowed.

A :class:`Field` is what :mod:`fdam_ray.config` generates from a section's
declaration (:func:`fdam_ray.settings.sections.setting`). Its ``kind`` picks the coercer
in :data:`COERCERS`; :func:`coerce` handles what every kind shares (text typed
as ``key=value``, null, the field's own ``check``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable
from typing import Any

import yaml

from fdam_ray.settings.factories import PYTHON_PREFIX, import_path_of, is_import_path, resolve
from fdam_ray.settings.redact import short
from fdam_ray.settings.sections import ENTROPY_FIELDS, ConfigError, fail
from fdam_ray.settings.yamlio import load_yaml


@dataclasses.dataclass(frozen=True)
class Field:
    """One config field as the table, ``fdam fields`` and the coercers see it (generated from its section).

    ``kind``: int, float, bool, str, batch (an int >= 0 or 'full'), int_list, str_list, factory (a name or
    module:attr), resource_list; int_auto and bool_auto (or 'auto').
    """

    name: str
    kind: str
    default: Any
    doc: str
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], bool] | None = None
    allowed: str = ""
    optional: bool = False
    section: str = ""
    resume: bool = False
    aliases: tuple[str, ...] = ()


class CommandLineText(str):
    """A value typed as ``key=value``: read as YAML for numbers, booleans and lists, kept as text for strings."""


def from_text(field: Field, text: CommandLineText) -> Any:
    """A ``key=value`` value as the field reads it: ``run_name=007`` stays "007", ``lr=1e-3`` is a number."""
    if text.strip() in ("", "null", "~", "None"):
        return None
    if field.kind == "str" or (field.kind == "str_list" and not text.lstrip().startswith("[")):
        return str(text)  # run_name=007 stays "007", data_root=2024 stays "2024"
    try:
        return load_yaml(text)
    except yaml.YAMLError:
        return str(text)


INT_BOUND = 2**63  # an integer field's values lie in [-INT_BOUND, INT_BOUND - 1]
ENTROPY_BOUND = 2**128  # ... but those of ENTROPY_FIELDS, which lie below this


def _with_allowed(what: str, field: Field) -> str:
    return what + (f" {field.allowed}" if field.allowed else "")


def _bool(field: Field, value: Any) -> Any:
    if isinstance(value, bool):
        return value
    raise fail(field.name, value, field.allowed or "true or false")


def _int(field: Field, value: Any) -> Any:
    if isinstance(value, bool):
        raise fail(field.name, value, "an integer")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise fail(field.name, value, _with_allowed("an integer", field))
    if field.name in ENTROPY_FIELDS:  # a seed's entropy: any size up to 128 bits
        if not -ENTROPY_BOUND < value < ENTROPY_BOUND:
            raise fail(field.name, value, f"an integer {field.allowed} and below 2**128" if field.allowed
                       else "an integer in (-2**128, 2**128)")
    elif not -INT_BOUND <= value < INT_BOUND:  # torch, NumPy and the files keep 64-bit integers
        raise fail(field.name, value, f"an integer {field.allowed} and below 2**63" if field.allowed
                   else "an integer in [-2**63, 2**63 - 1]")
    return value


def _float(field: Field, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(field.name, value, _with_allowed("a number", field))
    value = float(value)
    if not math.isfinite(value):
        raise fail(field.name, value, "a finite number")
    return value


# YAML 1.1 (PyYAML) reads a bare off/on (and no/yes) as false/true: a field whose choices hold the word takes it
_SWITCH_WORDS = {False: "off", True: "on"}


def _str(field: Field, value: Any) -> Any:
    choices = field.choices
    if isinstance(value, bool) and choices and _SWITCH_WORDS[value] in choices:
        return _SWITCH_WORDS[value]  # `dp: off`, `dp_eval: on` in a file or on the command line
    if not isinstance(value, str):
        raise fail(field.name, value, "a string" + (f", one of {', '.join(choices)}" if choices else ""))
    if choices and value not in choices:
        raise fail(field.name, value, f"one of {', '.join(choices)}{_did_you_mean(value, choices)}")
    return value


def _did_you_mean(value: str, names: tuple[str, ...]) -> str:
    if len(value) > 100:  # no name is so long; difflib would take seconds on a huge value
        return ""
    hint = difflib.get_close_matches(value, names, n=1)
    return f"; did you mean '{hint[0]}'?" if hint else ""


def _batch(field: Field, value: Any) -> Any:
    if value == "full":
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < INT_BOUND:
        raise fail(field.name, value, field.allowed)
    return value


def _int_list(field: Field, value: Any) -> Any:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                        and -INT_BOUND <= v < INT_BOUND for v in value):
        raise fail(field.name, value, "a list of integers in [-2**63, 2**63 - 1]")
    return tuple(value)


def _str_list(field: Field, value: Any) -> Any:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    empty_ok = field.default == ()
    if (not isinstance(value, (list, tuple)) or not (value or empty_ok)
            or not all(isinstance(v, str) for v in value)):
        raise fail(field.name, value, ("a list of names" if empty_ok else "a non-empty list of names")
                   + (f" from {', '.join(field.choices)}" if field.choices else ""))
    if field.choices and any(v not in field.choices for v in value):
        raise fail(field.name, value, f"each one of {', '.join(field.choices)}")
    return tuple(value)


def _factory(field: Field, value: Any) -> Any:
    """A built-in name, an import path ``module:attr`` that resolves here to a callable, or (``model`` in Python)
    the factory itself, kept as its import path when it has one."""
    names = field.choices or ()
    if isinstance(value, str):
        return _factory_name(field, value, names)
    if callable(value) and field.name == "model":
        return import_path_of(value) or value
    raise fail(field.name, value, f"one of {', '.join(names)}, or an import path module:attr"
               + (", or in Python the factory itself" if field.name == "model" else ""))


def _factory_name(field: Field, value: str, names: tuple[str, ...]) -> str:
    if value in names:
        return value
    if len(value) > _LONGEST_IMPORT_PATH:  # not matched or resolved: that alone would take seconds on a huge text
        raise fail(field.name, value, f"one of {', '.join(names)}, or an import path module:attr of at most "
                   f"{_LONGEST_IMPORT_PATH} characters")
    if value.startswith(PYTHON_PREFIX):
        raise ConfigError(
            f"config field '{field.name}': {short(value)} is a factory that was given in Python and cannot be "
            f"imported by name; give the callable again (fdam_ray.train(config, {field.name}=...), "
            f"fdam_ray.resume(run_dir, {field.name}=...)) or an import path module:attr")
    if is_import_path(value):
        try:
            resolve(value, field=f"config field '{field.name}'")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return value
    raise fail(field.name, value, f"one of {', '.join(names)}, or your own factory as an import path "
               f"module:attr{_did_you_mean(value, names)}")


_LONGEST_IMPORT_PATH = 1000


def _or_auto(plain: Callable[[Field, Any], Any]) -> Callable[[Field, Any], Any]:
    """A kind that also takes the text 'auto' (any other text is refused)."""

    def coerce_auto(field: Field, value: Any) -> Any:
        if value == "auto":
            return value
        if isinstance(value, str):
            raise fail(field.name, value, field.allowed)
        return plain(field, value)

    return coerce_auto


COERCERS: dict[str, Callable[[Field, Any], Any]] = {
    "bool": _bool, "int": _int, "float": _float, "str": _str, "batch": _batch, "int_list": _int_list,
    "str_list": _str_list, "factory": _factory, "int_auto": _or_auto(_int), "bool_auto": _or_auto(_bool),
}


def register_kind(kind: str, read: Callable[[str, Any], Any]) -> None:
    """Add a kind of field whose reading its owner knows (``read(field_name, value)``, raising a
    :class:`ConfigError`), so this module imports none of the parts it reads values for: the config, which
    composes every section, registers the kinds its sections declare (``resource_list``, ``deadline``).
    Registering the same reader again is a no-op; another reader for a kind already there is refused."""
    if _READERS.get(kind, read) is not read or (kind in COERCERS and kind not in _READERS):
        raise ValueError(f"kind '{kind}' is registered already")
    _READERS[kind] = read
    COERCERS[kind] = lambda field, value: read(field.name, value)


_READERS: dict[str, Callable[[str, Any], Any]] = {}


def coerce(field: Field, value: Any) -> Any:
    """``value`` as ``field`` holds it, or a :class:`ConfigError` naming the field, the value and what is allowed."""
    if isinstance(value, CommandLineText):
        value = from_text(field, value)
    if value is None:
        if field.optional:
            return None
        if field.default == ():  # a list that may be empty (trackers=)
            return ()
        raise fail(field.name, value, f"a value is required; {field.allowed or field.kind}".rstrip("; "))
    value = COERCERS[field.kind](field, value)
    if field.check is not None and value != "auto" and not field.check(value):
        raise fail(field.name, value, field.allowed)
    return value
