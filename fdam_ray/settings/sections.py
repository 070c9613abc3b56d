"""Typed sections of a config: each consumer takes the fields it uses, not the whole config.

A section is a frozen dataclass declared next to the code that reads it. Each
config field is declared once, in the section that owns it, with
:func:`setting` (its default, meaning, allowed values); a section that reads a
field another section owns names it with :func:`shared`. The field table,
``fdam fields``, the CLI's ``key=value`` keys and Tune's search-space keys are
all generated from these declarations (:mod:`fdam_ray.config`), and
:class:`~fdam_ray.config.Config` inherits every section, so a type checker sees
each field. A section is cut from a validated config (or a wider section) with
:meth:`Section.of`, so no value is checked or defaulted twice; its cross-field
rules are its :meth:`Section.check`, which :func:`~fdam_ray.config.build_config`
calls.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, ClassVar, Self

from fdam_ray.settings.redact import short

SETTING = "fdam_ray.setting"  # metadata key of a field a section owns
# Fields whose value undoes a protection (the privacy noise's seed removes the noise): kept in the run folder only
# (config.yaml is the owner's, 0600), never sent to an experiment tracker or uploaded with an artifact.
SECRET_FIELDS = frozenset({"dp_noise_seed"})
# Integer fields read as NumPy SeedSequence entropy (any size; the fresh privacy secret is 128 bits): bounded by
# 2**128, not by the 64 bits of every other integer field.
ENTROPY_FIELDS = frozenset({"dp_noise_seed"})


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


def fail(name: str, value: Any, allowed: str) -> ConfigError:
    """The one-line error of a bad value: the field, the value (shortened and redacted: never the whole of a big
    value) and what is allowed."""
    return ConfigError(f"config field '{name}': {short(value)} is not allowed ({allowed})")


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a section declares of a field it owns, besides its name, type and default.

    ``kind`` is the coercer a value goes through (see :data:`fdam_ray.config.COERCERS`); None = read from the
    field's type. ``check`` is a rule on the coerced value and ``allowed`` says it in words for error messages.
    ``resume`` marks a field that may differ when a run is resumed (it changes how a run runs, not what it
    computes); ``aliases`` are other names people reach for (only for suggestions).
    """

    doc: str
    kind: str | None = None
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], bool] | None = None
    allowed: str = ""
    resume: bool = False
    aliases: tuple[str, ...] = ()


def setting(default: Any, doc: str, *, kind: str | None = None, choices: tuple[str, ...] | None = None,
            check: tuple[Callable[[Any], bool], str] | Callable[[Any], bool] | None = None, allowed: str = "",
            resume: bool = False, aliases: tuple[str, ...] = ()) -> Any:
    """Declare a config field owned by this section: ``lr: float = setting(0.1, "eta, local step size.",
    check=POSITIVE)``. ``check`` is a rule, or a (rule, allowed text) pair such as :data:`POSITIVE`."""
    rule = check[0] if isinstance(check, tuple) else check
    allowed = allowed or (check[1] if isinstance(check, tuple) else "")
    meta = Setting(doc, kind, choices, rule, allowed, resume, aliases)
    return dataclasses.field(default=default, metadata={SETTING: meta})


def shared() -> Any:
    """A field another section owns (declared there with :func:`setting`), read by this section too."""
    return dataclasses.field()


# Common rules of numbers, as (rule, allowed text) pairs for :func:`setting`'s ``check``.
POSITIVE = (lambda v: v > 0, "> 0")
NONNEGATIVE = (lambda v: v >= 0, ">= 0")
AT_LEAST_ONE = (lambda v: v >= 1, ">= 1")
FRACTION = (lambda v: 0 < v < 1, "in (0, 1)")
EACH_ONCE = (lambda v: len(set(v)) == len(v), "each once")


class Section:
    """Base of the typed config sections (subclasses are frozen, keyword-only dataclasses)."""

    name: ClassVar[str] = ""  # the section's name in ``fdam fields NAME``

    @classmethod
    def of(cls, config: Section) -> Self:
        """The section's fields read off ``config`` (a :class:`~fdam_ray.config.Config` or a wider section): each
        declared field, by name, never a default (a field ``config`` lacks is an AttributeError)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def check(self) -> None:
        """The section's rules across its fields (each field alone is checked when it is read); raises
        :class:`ConfigError` naming the field, its value and what is allowed."""


def owned_fields(cls: type) -> list[dataclasses.Field]:
    """The fields ``cls`` itself declares with :func:`setting` (not those it shares or inherits)."""
    own = inspect.get_annotations(cls)
    return [f for f in dataclasses.fields(cls) if f.name in own and SETTING in f.metadata]


def shared_names(cls: type) -> list[str]:
    """The fields ``cls`` itself declares with :func:`shared`."""
    own = inspect.get_annotations(cls)
    return [f.name for f in dataclasses.fields(cls) if f.name in own and SETTING not in f.metadata]


_WARNED: set[str] = set()


def warn_once(log: Any, message: str) -> None:
    """Log ``message`` as a warning once per process: a section's check runs on every config built (a resume, a
    two-stage run's stage 1, each Tune trial), for a combination that may be meant but is likely a mistake."""
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)
