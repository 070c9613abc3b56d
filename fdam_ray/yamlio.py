"""YAML as fdam-ray reads it: config files, ``key=value`` values, search spaces and saved run folders.

``1e-3`` is a number (YAML 1.2, as every programming language reads it; PyYAML
follows YAML 1.1, where it is a string), and a key given twice is an error.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from fdam_ray.sections import ConfigError


class _Loader(yaml.SafeLoader):
    """YAML as people write config values: ``1e-3`` is a number, and a key given twice is an error.

    PyYAML follows YAML 1.1, where a float needs a dot (``1.0e-3``) and ``1e-3``
    is a string; YAML 1.2 and every programming language read it as a number.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: PyYAML reports it
            if key in seen:
                raise DuplicateKeyError(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: Any, line: int) -> None:
        super().__init__(f"key '{key}' is given twice (again on line {line})")
        self.key, self.line = key, line


def load_yaml(text: str) -> Any:
    """Parse YAML text the way every fdam-ray file and ``key=value`` is read (see :class:`_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: plain data only


def read_yaml_file(path: str | Path, what: str) -> Any:
    """Read a YAML file; any problem (missing, not UTF-8, not YAML, a key given twice) is one
    :class:`ConfigError` naming ``what`` and the file."""
    from fdam_ray.locations import is_uri, read_uri_text

    try:
        text = read_uri_text(str(path)) if is_uri(str(path)) else Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} '{path}' does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{what} '{path}' cannot be read: {exc.strerror or exc}") from None
    try:
        return load_yaml(text)
    except DuplicateKeyError as exc:
        raise ConfigError(f"{what} '{path}': {exc}") from None
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"{what} '{path}' is not valid YAML: {detail}") from None
