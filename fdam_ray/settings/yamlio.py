"""YAML as fdam-ray reads it: config files, ``key=value`` values, search spaces and saved run folders.

``1e-3`` is a number (YAML 1.2, as every programming language reads it; PyYAML
follows YAML 1.1, where it is a string), and a key given twice is an error.

Hostile files are refused before they cost memory: a file is read
(:func:`fdam_ray.files.yamlfile.read_yaml_file`) only when it is a regular file
of at most :data:`MAX_FILE_BYTES` (``/dev/zero``, a FIFO or a folder is one line
naming it), a document whose aliases would expand to more
than :data:`MAX_EXPANDED_NODES` values (an alias bomb) or refer to themselves is
refused, and every mapping key must be text (``1: 2`` names the key and its line). A merge key
(``<<: *defaults``) is read as YAML defines it: the mapping's own keys win over merged ones.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from fdam_ray.settings.redact import short

MAX_FILE_BYTES = 1 << 20  # 1 MiB: a config or space file is a few kB
MAX_EXPANDED_NODES = 1_000_000  # values a document may hold with its aliases expanded (a 1 MiB file has fewer)
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """YAML as people write config values: ``1e-3`` is a number, and a key given twice is an error.

    PyYAML follows YAML 1.1, where a float needs a dot (``1.0e-3``) and ``1e-3``
    is a string; YAML 1.2 and every programming language read it as a number.
    """

    def compose_document(self) -> Any:
        node = super().compose_document()
        _check_expanded_size(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """A mapping whose keys are text, each given once; a merge key (``<<: *defaults``) adds the keys of the
        mappings it names where the mapping does not give them itself, as YAML defines it."""
        self._check_keys(node)
        return super().construct_mapping(node, deep=deep)  # SafeConstructor's: merged keys first, its own win

    def _check_keys(self, node: yaml.MappingNode) -> None:
        """Every key of ``node`` and of the mappings it merges is text, and none is given twice in one mapping
        (a key a mapping gives over one it merges is YAML's override, not a repeat). A node is checked before
        PyYAML's ``flatten_mapping`` folds merged keys into it, once."""
        if getattr(node, "_fdam_keys_checked", False):
            return
        node._fdam_keys_checked = True
        seen: set = set()
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:  # not a key: what follows is merged
                merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for sub in merged:
                    if isinstance(sub, yaml.MappingNode):
                        self._check_keys(sub)
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise KeyNotTextError(key, key_node.start_mark.line + 1)
            if key in seen:
                raise DuplicateKeyError(key, key_node.start_mark.line + 1)
            seen.add(key)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: Any, line: int) -> None:
        super().__init__(f"key {short(key)} is given twice (again on line {line})")
        self.key, self.line = key, line


class KeyNotTextError(yaml.YAMLError):
    """A mapping key that is not text (``1: 2``, ``null: x``): fdam-ray's keys are names."""

    def __init__(self, key: Any, line: int) -> None:
        shown = "null" if key is None else short(key, 60)
        super().__init__(f"key {shown} on line {line} is {kind_of(key)}, not a name; keys are field names, "
                         "written as text")
        self.key, self.line = key, line


def kind_of(value: Any) -> str:
    """What a key that is not text is, in words (for the messages that refuse it)."""
    kinds = ((bool, "true/false"), (int, "an integer"), (float, "a number"), (list, "a list"), (dict, "a mapping"))
    if value is None:
        return "null"
    return next((word for kind, word in kinds if isinstance(value, kind)), f"a {type(value).__name__}")


class TooLargeError(yaml.YAMLError):
    """A document whose aliases expand beyond :data:`MAX_EXPANDED_NODES` values, refer to themselves, or nest
    deeper than Python can follow."""


def _check_expanded_size(root: yaml.Node | None) -> None:
    """Refuse a node graph that, with its aliases expanded, holds more than :data:`MAX_EXPANDED_NODES` values
    (each shared node counted once per use, computed once per node) or that contains itself."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in on_path:
            raise TooLargeError("an alias refers to a collection it is inside of (a value that contains itself)")
        on_path.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children: list = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > MAX_EXPANDED_NODES:
                raise TooLargeError(f"its aliases expand to more than {MAX_EXPANDED_NODES:,} values (an alias bomb?)")
        on_path.discard(key)
        sizes[key] = total
        return total

    if root is not None:
        size(root)


def load_yaml(text: str) -> Any:
    """Parse YAML text the way every fdam-ray file and ``key=value`` is read (see :class:`_Loader`); any problem,
    a too deep nesting or a number Python cannot hold included, is a ``yaml.YAMLError``."""
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: plain data only
    except RecursionError:
        raise TooLargeError("it nests deeper than can be read") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise TooLargeError(f"a value cannot be read: {str(exc).split(';')[0]}") from None
