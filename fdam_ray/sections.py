"""Typed sections of a config: each consumer takes the fields it uses, not the whole config.

The one table of fields stays :data:`fdam_ray.config.FIELDS` (with its single
:func:`~fdam_ray.config.build_config` and its error messages). A section is a
frozen dataclass, declared next to the code that reads it, whose field names
are config field names and whose annotations are their types; it is cut from a
validated config (or from a larger section) with :meth:`Section.of`, so no
value is checked or defaulted twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self


class Section:
    """Base of the typed config sections (subclasses are frozen dataclasses)."""

    @classmethod
    def of(cls, config: Any) -> Self:
        """The section's fields read off ``config`` (a :class:`~fdam_ray.config.Config` or a wider section)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]
