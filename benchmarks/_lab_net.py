"""The fault lab's network: node addresses on loopback, their links shaped by netlab, a link cut and healed.

``benchmarks/faults.py`` takes netlab's folder (``--netlab ../shared/netlab``); nothing here is imported by
the package or the default tests. Each node of the lab has its own address 127.0.0.N; a process of a node
sends from it through netlab's LD_PRELOAD shim (:meth:`Links.env`), so the node's links are the tc filters
netlab installs between node addresses. A cut moves the filters of one node's links (both directions) to a
class whose queue is a ``blackhole`` qdisc: every packet on them is dropped, as on a pulled cable; a heal
puts them back. (This kernel has no tc actions, so ``action drop`` is not available.)
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

CUT_CLASS = "7e57:ff"  # netlab's root handle 7e57:; minor ff: no node address (they are 2..254) uses it
CUT_QDISC = "2ff:"


def load_netlab(folder: str | Path) -> ModuleType:
    """netlab's ``netcluster`` module from its folder (one line when the folder does not hold it)."""
    folder = Path(folder).resolve()
    if not (folder / "netcluster.py").is_file():
        raise SystemExit(f"--netlab {folder}: no netcluster.py there (give the folder of ../shared/netlab)")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    import netcluster  # type: ignore[import-not-found]

    return netcluster


def _tc(*args: str) -> str:
    out = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out.stdout


def _hex_ip(ip: str) -> str:
    return "".join(f"{int(p):02x}" for p in ip.split("."))


class Links:
    """The lab's node addresses with netlab's shaping up (``rate`` per node), and cuts of a node's links.

    Args:
        netcluster: netlab's module (:func:`load_netlab`).
        ips: the node addresses (127.0.0.N, two or more).
        rate: every node's ingress rate (netlab's ``Shaping``).
    """

    def __init__(self, netcluster: ModuleType, ips: Sequence[str], rate: str = "1gbit") -> None:
        self.nc = netcluster
        self.ips = list(ips)
        self.shaping = netcluster.Shaping(self.ips, rate)
        self.shim = netcluster.build_shim()
        self.cut_now: set[str] = set()
        self._lock = threading.Lock()

    def up(self) -> Links:
        self.shaping.up()
        _tc("class", "add", "dev", "lo", "parent", "7e57:", "classid", CUT_CLASS, "htb", "rate", "1gbit",
            "quantum", "65536")
        _tc("qdisc", "add", "dev", "lo", "parent", CUT_CLASS, "handle", CUT_QDISC, "blackhole")
        return self

    def down(self) -> None:
        self.shaping.down()  # removes the root qdisc: every class and filter with it

    def __enter__(self) -> Links:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def env(self, ip: str, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a process of node ``ip``: it sends from that address."""
        env = dict(os.environ if base is None else base)
        parts = [p for p in env.get("LD_PRELOAD", "").split() if "srcbind.so" not in p]
        env["LD_PRELOAD"] = " ".join([str(self.shim), *parts])
        env["NETCLUSTER_SRC"] = ip
        return env

    def _filters(self) -> list[tuple[str, str, str]]:
        """netlab's filters: (handle, source hex, destination hex)."""
        text = _tc("filter", "show", "dev", "lo", "parent", "7e57:")
        found = []
        for block in re.split(r"\n(?=filter )", text):
            h = re.search(r"fh (\S+::\S+) ", block)
            m = re.findall(r"match ([0-9a-f]{8})/ffffffff at (12|16)", block)
            if h and len(m) == 2:
                where = {at: value for value, at in m}
                found.append((h.group(1), where["12"], where["16"]))
        return found

    def _route(self, ip: str, cut: bool) -> None:
        mine = _hex_ip(ip)
        by_hex = {_hex_ip(a): a for a in self.ips}
        changed = 0
        for handle, src, dst in self._filters():
            if mine not in (src, dst) or src not in by_hex or dst not in by_hex:
                continue
            flow = CUT_CLASS if cut else self.shaping.classid(by_hex[dst])
            _tc("filter", "replace", "dev", "lo", "parent", "7e57:", "protocol", "ip", "prio", "1", "handle",
                handle, "u32", "match", "ip", "src", f"{by_hex[src]}/32", "match", "ip", "dst",
                f"{by_hex[dst]}/32", "flowid", flow)
            changed += 1
        if changed != 2 * (len(self.ips) - 1):
            raise RuntimeError(f"cutting {ip}: {changed} of {2 * (len(self.ips) - 1)} links found in tc's filters")

    def cut(self, ip: str) -> None:
        """Drop every packet between node ``ip`` and the other nodes (both directions)."""
        with self._lock:
            self._route(ip, cut=True)
            self.cut_now.add(ip)

    def heal(self, ip: str) -> None:
        with self._lock:
            self._route(ip, cut=False)
            self.cut_now.discard(ip)

    def cut_for(self, ip: str, seconds: float) -> threading.Thread:
        """Cut ``ip``'s links now and heal them after ``seconds``, in a thread (returned, started)."""
        self.cut(ip)

        def later() -> None:
            time.sleep(seconds)
            self.heal(ip)

        thread = threading.Thread(target=later, name=f"heal-{ip}", daemon=True)
        thread.start()
        return thread

    def dropped(self) -> int:
        """Packets dropped by cuts so far."""
        text = _tc("-s", "qdisc", "show", "dev", "lo")
        m = re.search(rf"qdisc blackhole {CUT_QDISC} .*?\n\s*Sent \d+ bytes \d+ pkt \(dropped (\d+)", text, re.S)
        return int(m.group(1)) if m else 0


# -- what a process holds -------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                out.setdefault(ppid, []).append(int(entry.name))
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children, found, todo = _children(), [pid], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def holds(pid: int) -> tuple[int, int]:
    """(resident bytes, open file descriptors) of ``pid`` and the processes below it; (0, 0) when gone."""
    rss = fds = 0
    for p in tree(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            found = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{p}/status").read_text())
            if found is None:  # a zombie holds no memory
                continue
            rss += int(found.group(1)) * 1024
            fds += len(os.listdir(f"/proc/{p}/fd"))
    return rss, fds


def _children_pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def _is_ours(pid: int) -> bool:
    """A live (not zombie) process whose command line names Flower, Ray or fdam."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return any(word in cmd for word in ("flwr", "flower-", "raylet", "gcs_server", "ray::", "fdam"))
