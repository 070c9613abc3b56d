"""Who writes a run or sweep folder now: an exclusive lock held for as long as a run (or a sweep's driver)
writes it.

A second writer (``--resume`` on a run that is still going, or a new run into
its folder) would interleave records and corrupt ``metrics.jsonl``; a second
driver on a live sweep would restore its trials while they run, fail them and
then rewrite its results as failed. Either is refused, naming the holder. The
lock is an ``flock`` on ``<folder>/.lock``, which the kernel drops when its
process ends however it ends, so the file a killed run leaves behind never
blocks its resume.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from datetime import datetime
from pathlib import Path

LOCK_FILE = ".lock"


class RunFolderInUse(ValueError):
    """Another process writes this run folder now."""


class RunLock:
    """An exclusive ``flock`` on ``<run>/.lock`` for as long as a run writes its folder.

    The file also says who holds it (pid, host, start time) for the message a second
    writer gets. The kernel drops the lock when its process ends, however it ends, so
    the file a killed run leaves behind never blocks a resume.
    """

    def __init__(self, folder: Path, what: str = "run folder") -> None:
        self.path = Path(folder) / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderInUse(in_use_message(folder, _holder_text(self.path), what)) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": f"{datetime.now():%Y-%m-%d %H:%M:%S}"}).encode())
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _holder_text(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text(encoding="utf-8"))
        return f"process {info['pid']} on host {info['host']} (since {info['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def in_use_message(folder: Path, holder: str, what: str = "run folder") -> str:
    work = "sweep" if what.startswith("sweep") else "run"
    return (f"{what} '{folder}' is in use by {holder}; a second writer would corrupt it: wait for that {work} to "
            "end or stop it, then continue it with --resume")


def check_not_in_use(folder: str | Path, what: str = "run folder") -> None:
    """Raise :class:`RunFolderInUse` when a live process holds ``folder``'s lock (it is left as it is)."""
    lock = Path(folder) / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return  # no lock file: nobody has written here since locks exist
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunFolderInUse(in_use_message(Path(folder), _holder_text(lock), what)) from None
    finally:
        os.close(fd)  # closing drops a lock this call took
