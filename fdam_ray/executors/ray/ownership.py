"""Whose is a Ray address record, and whose is the process listening at the address it names.

``ray start`` writes the address of the cluster it started into
``ray_current_cluster`` in Ray's temp folder (``/tmp/ray`` by default), a folder
every user of the machine may write to. A driver given no address that joined
whatever that file names would run its code, and send its token, to any
listener another user planted there. So such a record is trusted only when the
file is a regular file of this user and every socket listening at the address
it names is this user's too: a process running as this user (which can read
this user's files, the token included, anyway). Anything that cannot be
checked counts as not this user's.

The listener's owner is read from ``/proc/net/tcp`` and ``/proc/net/tcp6``
(Linux: each socket's uid), else from ``psutil`` where it is installed; the
address is never connected to before it is trusted.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def this_user() -> int:
    """The user id files and listeners must have to be trusted (this process's real uid)."""
    return os.getuid()


def record_owner_problem(path: str | Path) -> str | None:
    """None when ``path`` is a regular file (not a link) of this user; else what is wrong with it."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"cannot read it ({exc.strerror or exc})"
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != this_user():
        return f"it belongs to user id {info.st_uid}, not to this user ({this_user()})"
    return None


def _proc_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address of a ``/proc/net/tcp[6]`` field (hex, 32-bit words in host byte order, little-endian here)."""
    raw = b"".join(bytes.fromhex(text[i:i + 8])[::-1] for i in range(0, len(text), 8))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _proc_listeners(port: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]] | None:
    """(bound address, owner uid) of every socket listening on ``port``; None where /proc/net has no tables."""
    found: list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]] = []
    tables = 0
    for name in ("tcp", "tcp6"):
        try:
            lines = Path("/proc/net", name).read_text().splitlines()[1:]
        except OSError:
            continue
        tables += 1
        for line in lines:
            fields = line.split()
            if len(fields) < 8 or fields[3] != _LISTEN:
                continue
            host, _, port_hex = fields[1].partition(":")
            if int(port_hex, 16) == port:
                found.append((_proc_address(host), int(fields[7])))
    return found if tables else None


def _psutil_listeners(port: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]] | None:
    """As :func:`_proc_listeners`, through psutil; None where it is missing or cannot name an owner."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        found = []
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                if conn.pid is None:
                    return None  # a listener whose process is hidden from this user
                found.append((ipaddress.ip_address(conn.laddr.ip), psutil.Process(conn.pid).uids().real))
        return found
    except Exception:  # access denied (macOS without root), a process gone meanwhile
        return None


def _is_local_address(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``addr`` is an address of this machine (a socket can be bound to it)."""
    family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(addr), 0))
        return True
    except OSError:
        return False


def listener_owner_problem(host: str, port: int) -> str | None:
    """None when ``host:port`` is an address of this machine where only this user's processes listen; else why
    it is not (or cannot be told to be). Nothing is sent to the address."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return f"'{host[:60]}' is not an IP address of this machine"
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if not _is_local_address(addr):
        return f"{addr} is not an address of this machine"
    listeners = _proc_listeners(port)
    if listeners is None:
        listeners = _psutil_listeners(port)
    if listeners is None:
        return "the owner of the process listening there cannot be told on this system"
    serving = [uid for bound, uid in listeners if bound.is_unspecified or bound == addr]
    if not serving:
        return "nothing listens there"
    others = sorted({uid for uid in serving if uid != this_user()})
    if others:
        return f"the process listening there runs as user id {others[0]}, not as this user ({this_user()})"
    return None
