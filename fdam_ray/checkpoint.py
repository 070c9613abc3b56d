"""Checkpoints: one typed record of a run at a round boundary, in a versioned file.

A :class:`Checkpoint` is everything a resumed run needs to continue the same
run: the driver loop's :class:`LoopState` (the global state, the stage's
proximal centre and running sum, byte, sample and time counters, the metric
history, the schedule position), every client's own state, the global p, the
torch RNG and the run's config.

On disk it is a nested structure of dicts, lists, strings, numbers and tensors
under a ``format`` tag naming the schema version (:data:`FORMAT`). Numpy arrays
are stored as tensors (tagged so they come back as arrays), and the file is
read with ``torch.load(weights_only=True)``, which refuses anything but tensors
and plain containers: opening a checkpoint never runs code from it. Writing
goes to a temporary file in the same folder, is flushed to disk, then renamed
over the old file, so a crash mid-write leaves the previous checkpoint intact.

The global state's vectors, the server's and the loop's fields are written and
read by their dataclass fields, so a field added to :class:`~fdam_ray.core.state.GlobalState`
(or to the server or loop state) needs no change here; a state vector added
with a default reads from older files as that default (any other field missing
from a file means a damaged file). A change of the layout itself
raises :data:`SCHEMA` and adds a reader to :data:`_READERS` for the old one.
A file of a schema this fdam-ray does not read (a newer one, or an old one no
longer read) is refused with one line naming the file, its version and the
versions read here.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from fdam_ray.algorithms import ServerState
from fdam_ray.core.schedules import Position
from fdam_ray.core.state import ClientState, GlobalState
from fdam_ray.files.torchload import safe_load, torch_load_failure

SCHEMA = 1  # the schema this fdam-ray writes
_PREFIX = "fdam-ray-checkpoint/"
FORMAT = f"{_PREFIX}{SCHEMA}"
_ARRAY = "__ndarray__"



class CheckpointError(ValueError):
    """A checkpoint file is missing, damaged, or of a schema this fdam-ray does not read."""


class DiskFullError(OSError):
    """A run folder's file could not be written for lack of space; the file's previous version is kept."""


_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException) -> OSError | None:
    """The "no space" error behind ``exc``, if that is what it is: torch reports a failed write of its zip
    writer as a RuntimeError ("unexpected pos"), with the file's OSError as its context."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _FULL:
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


_SCRATCH: ContextVar[Path | None] = ContextVar("fdam_scratch", default=None)


@contextmanager
def scratch_folder(folder: Path) -> Iterator[Path]:
    """While inside, :func:`write_atomically` writes its temporary files into ``folder`` (made if missing; it must
    be on the same filesystem as the files written) instead of beside the file. Used where another process copies
    the run folder while the run writes it (Ray Tune's sync of a trial's folder), so that a temporary file never
    appears there to vanish between that copy's listing and its read."""
    folder.mkdir(parents=True, exist_ok=True)
    token = _SCRATCH.set(folder)
    try:
        yield folder
    finally:
        _SCRATCH.reset(token)


def write_atomically(path: str | Path, write: Callable[[Any], None], what: str, *, private: bool = False) -> None:
    """Write a file through ``write(binary file)`` to a temporary file in its folder (or the
    :func:`scratch_folder` in effect), flush it to disk, then rename it over ``path``: a crash or a full disk
    mid-write leaves the previous file intact. A full disk is one :class:`DiskFullError` line naming the folder
    (the temporary file is removed). ``private``: readable by the owner only (a checkpoint); else as the umask
    says, like any file the run writes."""
    path = Path(path)
    folder = _SCRATCH.get() or path.parent
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        if not private:
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        full = disk_full(exc)
        if full is not None:
            then = ("the previous one is kept: free space there, then continue the run with --resume" if path.exists()
                    else "free space there, then run again")
            error = DiskFullError(f"no space left on {path.parent} (writing {what} '{path.name}'); {then}")
            error.errno = full.errno
            raise error from None
        raise


@dataclasses.dataclass
class LoopState:
    """What the driver loop carries between rounds (all of it goes into a checkpoint)."""

    server: ServerState
    bytes_up: int = 0
    bytes_down: int = 0
    samples: int = 0
    train_s: float = 0.0
    wall_offset: float = 0.0  # wall time of earlier sessions of a resumed run
    loss_sum: float = 0.0
    loss_rounds: int = 0
    next_eval: int = 0
    history: list[dict] = dataclasses.field(default_factory=list)
    position: Position = dataclasses.field(default_factory=Position)  # in the schedule, after the last round
    # with val_fraction > 0: the best validation AUC so far, its iteration and a copy of the global state there
    # (best_model.pt); older checkpoints read without them
    best_val_auc: float | None = None
    best_val_iteration: int | None = None
    best_val_state: GlobalState | None = None
    # str(round) -> its clients, for each round whose participants were not the plan's (a missed round deadline,
    # fdam_ray.executors.deadlines); written only when it holds one, and older checkpoints read it as empty
    participation: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # str(round) -> the clients that ran it as rebuilt clients (a fresh client from its shard, c^k = that round's
    # global c: an actor replaced, a site that lost its state); written only when it holds one, read as empty
    rebuilt: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    transfer: dict | None = None  # transfer_precision bf16/fp16: the broadcast's master and residual (transfer.py)
    privacy: dict | None = None  # dp: client: the accountant's state (privacy/accountant.py); None = no DP

    @property
    def state(self) -> GlobalState:
        return self.server.global_state


@dataclasses.dataclass
class Checkpoint:
    """A run at a round boundary: what :func:`save_checkpoint` writes and :func:`load_checkpoint` reads.

    Attributes:
        loop: the driver loop's state (global state, reference point, running sum, counters, history, position).
        clients: every client's own state (:class:`~fdam_ray.core.state.ClientState`), in client order: None for a
            dropped client, a ``rebuild`` marker for one that could not be placed when it was written. In the
            file each is the plain mapping :meth:`ClientState.to_dict` gives (the layout of every schema-1 file).
        positive_ratio: the global p, one per task.
        torch_rng: the driver's torch RNG state.
        config: the run's config (``Config.to_dict()``); None until the observer that writes the file adds it.
    """

    schema: ClassVar[int] = SCHEMA

    loop: LoopState
    clients: list[ClientState | None]
    positive_ratio: np.ndarray
    torch_rng: torch.Tensor
    config: dict | None = None

    def with_config(self, config: dict) -> Checkpoint:
        return dataclasses.replace(self, config=config)

    def unplaced_clients(self) -> list[int]:
        """The clients marked for a rebuild (their actors could not be placed when this was written)."""
        return [k for k, s in enumerate(self.clients) if s is not None and ClientState.of(s).rebuild]

    def to_payload(self) -> dict:
        """The file's payload in the layout of :data:`SCHEMA`."""
        clients = [None if s is None else ClientState.of(s).to_dict() for s in self.clients]
        return {"config": self.config, "loop": _loop_payload(self.loop), "clients": clients,
                "positive_ratio": self.positive_ratio, "torch_rng": self.torch_rng}

    @classmethod
    def from_payload(cls, payload: Any, path: str | Path) -> Checkpoint:
        """Read a payload of the current schema; anything not a run's state is a :class:`CheckpointError`
        naming ``path``."""
        _check_kinds(payload, _PAYLOAD, path, "")
        _check_kinds(payload["loop"], _LOOP, path, "run state's ")
        return cls(loop=_loop_from(payload["loop"], path), clients=[_client_from(s, path) for s in payload["clients"]],
                   positive_ratio=payload["positive_ratio"], torch_rng=payload["torch_rng"],
                   config=payload["config"])


# What a payload holds at its top and in its "loop" entry, and of what kind (the rest is read by dataclass fields).
_PAYLOAD: dict[str, type] = {"config": dict, "loop": dict, "clients": list, "positive_ratio": object,
                             "torch_rng": torch.Tensor}
_LOOP: dict[str, type] = {"state": dict, "history": list, "position": dict}  # (and, by their fields, the rest)
# Loop fields added to schema 1 after files of it were written: such a file reads them as None.
_LOOP_ADDED = ("best_val_auc", "best_val_iteration", "best_val_state", "transfer", "privacy")


def _client_from(values: Any, path: str | Path) -> ClientState | None:
    """A client's state from the file's layout (None: a dropped client)."""
    if values is None:
        return None
    if not isinstance(values, dict):
        raise CheckpointError(f"checkpoint '{path}' is damaged: a client's state is a {type(values).__name__}, not "
                              "a mapping")
    return ClientState.from_dict(values)


def _check_kinds(payload: Any, kinds: dict[str, type], path: str | Path, where: str) -> None:
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint '{path}' is damaged: it holds a {type(payload).__name__}, not a run's "
                              "state")
    for key, kind in kinds.items():
        if key not in payload or not isinstance(payload[key], kind):
            raise CheckpointError(f"checkpoint '{path}' is damaged: its {where}'{key}' entry is missing or not a "
                                  f"{kind.__name__}")


def _key(server_field: str) -> str:
    """The ``loop`` entry's key of a server-state field (the global state is ``state``)."""
    return "state" if server_field == "global_state" else server_field


def _loop_payload(loop: LoopState) -> dict:
    """The ``loop`` entry: one flat mapping (state, reference, ref_sum, ref_count, the counters, history, position),
    each part by its dataclass fields."""
    out = {_key(name): value for name, value in _fields(loop.server).items()}
    out["state"] = _fields(loop.state)
    out.update((name, value) for name, value in _fields(loop).items()
               if name != "server" and not (name in _LOOP_ADDED and value is None)  # unset: written as before
               and not (name in ("participation", "rebuilt") and not value))
    out["position"] = _fields(loop.position)
    if loop.best_val_state is not None:
        out["best_val_state"] = _fields(loop.best_val_state)
    return out


def _fields(obj: Any) -> dict:
    """A dataclass's fields by name, values as they are (not copied)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


_T = TypeVar("_T")


def _build(cls: type[_T], values: dict, path: str | Path, what: str, *, defaults: bool = False) -> _T:
    """``cls`` from ``values`` by its fields. Every field must be in the file, except, with ``defaults``, one that has
    a default (a state vector added since the file was written); a field missing, or a value the file holds that
    ``cls`` has no field for, is a one-line :class:`CheckpointError`."""
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise CheckpointError(f"checkpoint '{path}' holds {what} this fdam-ray does not know: {', '.join(unknown)}")
    missing = [n for n, f in known.items() if n not in values and not (
        defaults and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING))]
    if missing:
        raise CheckpointError(f"checkpoint '{path}' is damaged: its {what} lacks {', '.join(missing)}")
    return cls(**values)


def _loop_from(payload: dict, path: str | Path) -> LoopState:
    values = dict(payload)
    server = {f.name: values.pop(_key(f.name)) for f in dataclasses.fields(ServerState) if _key(f.name) in values}
    server["global_state"] = _build(GlobalState, server["global_state"], path, "global state", defaults=True)
    values["position"] = _build(Position, values["position"], path, "schedule position")
    for name in _LOOP_ADDED:  # absent from files written before they were added
        values.setdefault(name, None)
    values.setdefault("participation", {})
    values.setdefault("rebuilt", {})
    if isinstance(values["best_val_state"], dict):
        values["best_val_state"] = _build(GlobalState, values["best_val_state"], path, "best state", defaults=True)
    return _build(LoopState, {"server": _build(ServerState, server, path, "server state"), **values}, path,
                  "run state")


# -- the file ---------------------------------------------------------------------------------------------------

# Readers of the payloads of every schema this fdam-ray reads (an older layout gets a function that reads it).
_READERS: dict[int, Callable[[Any, Path], Checkpoint]] = {SCHEMA: Checkpoint.from_payload}
READS = tuple(sorted(_READERS))


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {_ARRAY: torch.from_numpy(np.ascontiguousarray(obj).copy())}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    return obj


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_ARRAY}:
            return obj[_ARRAY].numpy()
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def save_checkpoint(path: str | Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` (with its config) to ``path`` atomically (temp file, fsync, rename)."""
    if checkpoint.config is None:
        raise ValueError("a checkpoint is written with the run's config (Checkpoint.with_config)")
    payload = {"format": FORMAT, "payload": _encode(checkpoint.to_payload())}
    write_atomically(path, lambda fh: torch.save(payload, fh), "the checkpoint", private=True)


def schema_of(data: Any, path: str | Path) -> int:
    """The schema version of a file's contents; one line naming ``path`` if it is not one this fdam-ray reads."""
    tag = data.get("format") if isinstance(data, dict) else None
    match = re.fullmatch(re.escape(_PREFIX) + r"(\d+)", tag) if isinstance(tag, str) else None
    if match is None or "payload" not in data:
        raise CheckpointError(f"'{path}' is not an fdam-ray checkpoint ({FORMAT})")
    version = int(match.group(1))
    if version not in _READERS:
        reads = ", ".join(map(str, READS))
        why = "a newer fdam-ray wrote it; upgrade fdam-ray to resume it" if version > SCHEMA else \
            "an older fdam-ray wrote it, and this one no longer reads that schema"
        raise CheckpointError(f"checkpoint '{path}' has schema version {version}, which this fdam-ray does not "
                              f"read (it reads version {reads}): {why}")
    return version


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint` (no arbitrary unpickling)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at '{path}'")
    if not path.is_file():  # a device or a FIFO would be read without end
        raise CheckpointError(f"checkpoint '{path}' is not a regular file")
    try:
        data = safe_load(path)
    except Exception as exc:  # a truncated zip, a pickle of foreign objects, ...
        raise CheckpointError(
            f"checkpoint '{path}' cannot be read (damaged, truncated or not an fdam-ray checkpoint): "
            f"{torch_load_failure(exc)}"
        ) from None
    version = schema_of(data, path)
    try:
        return _READERS[version](_decode(data["payload"]), path)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a value of the wrong kind deep inside
        raise CheckpointError(f"checkpoint '{path}' is damaged: {type(exc).__name__}: {exc}") from None



def check_fits(checkpoint: Checkpoint, path: str | Path, fresh: GlobalState) -> None:
    """Every state vector of ``checkpoint`` has the size and kind of this run's model (``fresh``, its initial
    global state): the global state, the stage's centre and running sum, the best validation state and each
    client's control variates; else a :class:`CheckpointError` naming the entry (torch would fail mid-resume, or
    an entry of another kind would resume silently)."""
    want = {name: value for name, value in fresh.vectors().items() if value is not None}
    want.update({name: want[corrected] for name, corrected in _CORRECTS.items() if corrected in want})
    loop = checkpoint.loop
    entries: list[tuple[str, str, Any, np.ndarray, np.dtype]] = []  # (whose, entry, value, like, dtype)
    for state, whose in [(loop.state, "global state"), (loop.best_val_state, "best validation state")]:
        vectors = {} if state is None else state.vectors()
        entries += [(whose, name, value, want[name], want[name].dtype) for name, value in vectors.items()
                    if value is not None and name in want]
    entries += [("server state", "reference", loop.server.reference, want["v"], want["v"].dtype),
                ("server state", "ref_sum", loop.server.ref_sum, want["v"], np.dtype(np.float64))]
    for k, client in enumerate(checkpoint.clients):
        control = None if client is None else ClientState.of(client).control
        entries += [(f"client {k}'s state", name, value, want[name], want[name].dtype)
                    for name, value in zip(_CORRECTS, control or (), strict=False)
                    if value is not None and name in want]
    for whose, name, value, like, dtype in entries:
        if not isinstance(value, np.ndarray) or value.shape != like.shape or value.dtype != dtype:
            shown = f"{value.dtype} of shape {value.shape}" if isinstance(value, np.ndarray) else type(value).__name__
            raise CheckpointError(f"checkpoint '{path}' is damaged: its {whose}'s '{name}' entry is {shown}; this "
                                  f"run's model needs {dtype} of shape {like.shape}")


# a control variate has the size and kind of the vector it corrects (control vectors in declaration order)
_CORRECTS = {f.name: f.metadata["corrects"] for f in dataclasses.fields(GlobalState) if f.metadata.get("corrects")}
