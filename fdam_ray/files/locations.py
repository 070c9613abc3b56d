"""Where outputs go: local folders, storage URIs, and runs started by ``ray job submit --working-dir``.

A relative ``out_dir`` (or ``tune.storage_path``) normally means a folder under
the current directory. Inside a Ray job submitted with a working directory,
the current directory is Ray's temporary copy of that directory on the head
node, which Ray deletes once the job is over: a run folder there would be lost.
So inside such a job a relative path is taken under the home directory of the
user the job runs as, and the first line of the job's log says where (and
that an absolute path on shared storage chooses another place).

A storage URI (``s3://bucket/sweeps``, ``gs://...``, ``file:///...``) is
never turned into a local path: Ray Tune reads and writes it through its own
filesystem layer, and so do the few files ``fdam tune`` keeps next to it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from pathlib import Path

from fdam_ray.settings.redact import redact

log = logging.getLogger(__name__)

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
JOB_CONFIG_VARIABLE = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray for the entrypoint of a submitted job
_said: set[str] = set()


def is_uri(path: str | os.PathLike) -> bool:
    """Whether ``path`` names storage by URI (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and bool(_URI.match(path))


def local_path_of(path: str | os.PathLike) -> Path | None:
    """The local path a ``file://`` URI or a plain path names; None for remote storage."""
    text = str(path)
    if text.startswith("file://"):
        return Path(text[len("file://"):])
    return None if is_uri(text) else Path(text)


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def job_working_dir() -> Path | None:
    """The temporary working directory of a ``ray job submit --working-dir`` job this process runs, or None."""
    raw = os.environ.get(JOB_CONFIG_VARIABLE)
    if not raw:
        return None
    try:
        runtime_env = (json.loads(raw) or {}).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    return Path.cwd() if isinstance(runtime_env, dict) and runtime_env.get("working_dir") else None


def output_root(path: str | os.PathLike, field: str) -> Path:
    """The local folder a relative or absolute output path means here (see the module docstring).

    Outside a Ray job the path is returned as given (relative to the current directory).
    """
    given = Path(path).expanduser()
    if given.is_absolute() or job_working_dir() is None:
        return given
    chosen = Path.home() / given
    if field not in _said:
        _said.add(field)
        log.warning("running as a Ray job in Ray's temporary copy of the working directory (%s), which Ray deletes "
                    "after the job: %s=%s is relative, so outputs go under %s on host %s; set %s to an absolute "
                    "path on shared storage to choose where", Path.cwd(), field, redact(path), redact(chosen),
                    socket.gethostname(),
                    field)
    return chosen


def where(path: str | os.PathLike) -> str:
    """``path`` as a user should read it in a message: absolute, with the host when inside a Ray job; a URI with
    its credentials replaced by ``***`` (see :func:`fdam_ray.settings.redact.redact`)."""
    if is_uri(str(path)):
        return redact(path)
    text = str(Path(path).absolute())
    return f"{text} (on host {socket.gethostname()})" if job_working_dir() is not None else text


def open_storage(uri: str):
    """(pyarrow filesystem, path in it) for a storage URI, as Ray Tune resolves its ``storage_path``."""
    import pyarrow.fs

    return pyarrow.fs.FileSystem.from_uri(uri)


class RemoteFolder:
    """A folder named by a storage URI, read and written through pyarrow's filesystems (as Ray Tune does)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")
        try:
            self.fs, self.path = open_storage(self.uri)
        except (OSError, ValueError) as exc:  # an unknown scheme, no credentials, an unreachable endpoint
            raise OSError(f"storage '{redact(uri)}' cannot be opened: {_first_line(exc)}") from None

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except (OSError, ValueError) as exc:
            raise OSError(f"storage '{redact(self.uri)}': cannot {what}: {_first_line(exc)}") from None

    def exists(self, name: str = "") -> bool:
        import pyarrow.fs

        info = self._call("look up", self.fs.get_file_info, join_uri(self.path, name) if name else self.path)
        return info.type != pyarrow.fs.FileType.NotFound

    def read_text(self, name: str, limit: int | None = None) -> str:
        """The text of the file ``name``; with ``limit``, a file of more bytes is an OSError saying so."""

        def read() -> bytes:
            with self.fs.open_input_stream(join_uri(self.path, name)) as fh:
                return fh.read() if limit is None else fh.read(limit + 1)

        data = self._call(f"read {name}", read)
        if limit is not None and len(data) > limit:
            raise OSError(f"storage '{redact(self.uri)}': {name} is larger than {limit:,} bytes")
        return data.decode("utf-8")

    def write_text(self, name: str, text: str) -> None:
        def write() -> None:
            self.fs.create_dir(self.path, recursive=True)
            with self.fs.open_output_stream(join_uri(self.path, name)) as fh:
                fh.write(text.encode("utf-8"))

        self._call(f"write {name}", write)

    def remove(self, name: str) -> None:
        if self.exists(name):
            self._call(f"remove {name}", self.fs.delete_file, join_uri(self.path, name))

    def upload(self, local: Path, names: list[str]) -> None:
        """Copy the files ``names`` of the local folder ``local`` into this folder."""
        for name in names:
            if (local / name).is_file():
                data = (local / name).read_bytes()

                def write(data: bytes = data, name: str = name) -> None:
                    with self.fs.open_output_stream(join_uri(self.path, name)) as fh:
                        fh.write(data)

                self._call(f"write {name}", write)


def read_uri_text(uri: str, limit: int | None = None) -> str:
    """The text of the file a storage URI names (FileNotFoundError if there is none); with ``limit``, at most that
    many bytes (more is an OSError)."""
    parent, _, name = uri.rstrip("/").rpartition("/")
    folder = RemoteFolder(parent)
    if not folder.exists(name):
        raise FileNotFoundError(redact(uri))
    return folder.read_text(name, limit)


def _first_line(exc: BaseException) -> str:
    """The first line of an error's text, redacted (a filesystem's error may repeat the URI with its key)."""
    lines = str(exc).splitlines()
    return redact(lines[0] if lines else type(exc).__name__)
