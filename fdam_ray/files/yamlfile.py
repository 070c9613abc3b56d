"""Reading a YAML file (a config, a search space, a run folder's record) as fdam-ray reads YAML
(:mod:`fdam_ray.settings.yamlio`), from a local path or a URI of shared storage (:mod:`fdam_ray.files.locations`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from fdam_ray.files.locations import local_path_of, read_uri_text
from fdam_ray.settings.redact import clip
from fdam_ray.settings.sections import ConfigError
from fdam_ray.settings.yamlio import MAX_FILE_BYTES, DuplicateKeyError, KeyNotTextError, TooLargeError, load_yaml


def _read_local_text(path: Path, what: str) -> str:
    """The text of a local file, read only when it is a regular file of at most :data:`MAX_FILE_BYTES`."""
    shown = f"'{clip(path)}'"
    mode = os.stat(path).st_mode  # FileNotFoundError, PermissionError: the caller's one line
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a file")
        raise ConfigError(f"{what} {shown} is {kind}, not a regular file; give a YAML file")
    with open(path, "rb") as fh:
        data = fh.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{what} {shown} is larger than {MAX_FILE_BYTES // (1 << 20)} MiB; "
                          "a config or search-space file is a few kB")
    return data.decode("utf-8")


def read_yaml_file(path: str | Path, what: str) -> Any:
    """Read a YAML file; any problem (missing, not a regular file, over 1 MiB, not UTF-8, not YAML, a key given
    twice or not text, an alias bomb) is one :class:`ConfigError` naming ``what`` and the file."""
    shown = f"'{clip(path)}'"
    local = local_path_of(path)  # a plain path or a file:// URI: checked to be a regular file before it is opened
    try:
        text = read_uri_text(str(path), MAX_FILE_BYTES) if local is None else _read_local_text(local, what)
    except FileNotFoundError:
        raise ConfigError(f"{what} {shown} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {shown} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{what} {shown} cannot be read: {clip(exc.strerror or exc)}") from None
    try:
        return load_yaml(text)
    except (DuplicateKeyError, KeyNotTextError, TooLargeError) as exc:
        raise ConfigError(f"{what} {shown}: {exc}") from None
    except yaml.YAMLError as exc:
        detail = clip(" ".join(str(exc).split()), 300)
        raise ConfigError(f"{what} {shown} is not valid YAML: {detail}") from None
