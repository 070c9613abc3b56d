"""The all-reduce of ``transport: collective`` for members on one node: one block of shared memory.

When every member of the group runs on one node (and not under NCCL), a
socket all-reduce copies every state through the kernel several times; here
the members map one file in ``/dev/shm`` instead and reduce as follows:

1. each member writes its partial sum into its own slot (its fold can write
   there directly) and its small float64 row (weights, counts, flags);
2. barrier; every member reads the small rows (one non-zero term per slot, so
   their sum is exact) and sums its own slice of the slots, in rank order,
   into a result buffer (rank order is the driver's fold order, so the sums
   are those of a classic ``fold_order: client`` round bit for bit);
3. it finishes its slice there (the server step is elementwise), barrier, and
   every member reads the whole new state from the result buffer.

Two result buffers are used in turn: the state a round starts from may live
in one while the next is written. A barrier is a counter per member in the
block and a FIFO per member beside it: a member bumps its own counter; the
one that finds every counter there writes a byte to each other member's
FIFO. A waiting member yields the CPU in a loop for :data:`SPIN_S` (most
waits end within it), then sleeps in ``select`` on its own FIFO until woken
(no CPU spent on a long wait) and looks again.
Every wait is bounded by the group's timeout and checks the other members'
processes every :data:`CHECK_EVERY_S`: a member that died, or that marked
the block broken on its way out, ends the wait with :class:`SharedBroken`.

The block's file and FIFOs are created by the lowest rank and unlinked as
soon as every member has opened them, so nothing is left in ``/dev/shm`` when
a member is killed. The block's pages are allocated when it is made
(``posix_fallocate``): a ``/dev/shm`` too small for it is found then (the
group falls back to gloo), never as a bus error in the middle of a round.
The counters are plain aligned 8-byte stores, which x86-64 keeps in order
(:func:`supported`).
"""

from __future__ import annotations

import os
import platform
import select
import sys
import time
import uuid

import numpy as np

SHM_DIR = "/dev/shm"
SPIN_S = 0.01  # a wait first yields the CPU in a loop for this long (a wake through the FIFO costs a reschedule)
CHECK_EVERY_S = 0.05  # how often a wait looks at the other members' processes, the broken mark and the clock
_HEADER = 8  # int64 words before the per-member ones: [0] broken (the others are spare)
_ALIGN = 64


class SharedBroken(RuntimeError):
    """A member of the block died, marked it broken, or did not reach a barrier in time."""


def supported() -> bool:
    """Whether this machine can host a block: Linux (``/dev/shm``, ``/proc``) on x86-64 (ordered stores)."""
    return sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def block_bytes(world: int, small: int, n: int) -> int:
    """Bytes of a block for ``world`` members, ``small`` float64 values a row and ``n`` float32 values a state."""
    return _offsets(world, small, n)[-1]


def _offsets(world: int, small: int, n: int) -> tuple[int, int, int, int, int, int]:
    """Byte offsets of the counters, pids, small rows, slots and result buffers, and the end."""

    def up(x: int) -> int:
        return -(-x // _ALIGN) * _ALIGN

    counters = up(8 * _HEADER)
    pids = up(counters + 8 * world)
    rows = up(pids + 8 * world)
    slots = up(rows + 8 * small * world)
    results = up(slots + 4 * n * world)
    return counters, pids, rows, slots, results, results + 8 * n


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] not in (b"Z", b"X")


class SharedBlock:
    """One member's mapping of the group's block: its counters, the small rows, the slots and the results."""

    def __init__(self, path: str, rank: int, world: int, small: int, n: int, timeout_s: float) -> None:
        self.path, self.rank, self.world, self.small_len, self.n = path, rank, world, small, n
        self.timeout_s = timeout_s
        self._map = np.memmap(path, dtype=np.uint8, mode="r+", shape=(block_bytes(world, small, n),))
        counters, pids, rows, slots, results = _offsets(world, small, n)[:5]
        buf = self._map
        self.header = buf[:8 * _HEADER].view(np.int64)
        self.counters = buf[counters:counters + 8 * world].view(np.int64)
        self.pids = buf[pids:pids + 8 * world].view(np.int64)
        self.rows = buf[rows:rows + 8 * small * world].view(np.float64).reshape(world, small)
        self.slots = buf[slots:slots + 4 * n * world].view(np.float32).reshape(world, n)
        self.results = buf[results:results + 8 * n].view(np.float32).reshape(2, n)
        self.seq = int(self.counters[rank])
        self.pids[rank] = os.getpid()
        # this member's FIFO, read and write (so opening it never waits and it never reads end-of-file)
        self._inbox = os.open(fifo_path(path, rank), os.O_RDWR | os.O_NONBLOCK)
        self._peers: list[int] = []  # the others' FIFOs (:meth:`connect`, once every member has opened its own)

    def connect(self) -> None:
        """Open the other members' FIFOs for writing (each member's own must be open: a FIFO without a reader
        cannot be opened without waiting)."""
        self._peers = [os.open(fifo_path(self.path, r), os.O_WRONLY | os.O_NONBLOCK)
                       for r in range(self.world) if r != self.rank]

    @staticmethod
    def create(world: int, small: int, n: int) -> str:
        """Make a block's file (pages allocated now; OSError when ``/dev/shm`` has no room) and its members'
        FIFOs; the block's path."""
        path = os.path.join(SHM_DIR, f"fdam-ray-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, block_bytes(world, small, n))
            for r in range(world):
                os.mkfifo(fifo_path(path, r), 0o600)
        except OSError:
            SharedBlock.unlink(path, world)
            raise
        finally:
            os.close(fd)
        return path

    @staticmethod
    def unlink(path: str, world: int) -> None:
        """Remove a block's names (its file and FIFOs) from ``/dev/shm``; the members' mappings stay."""
        for name in [path, *(fifo_path(path, r) for r in range(world))]:
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass

    @property
    def slot(self) -> np.ndarray:
        """This member's slot (where its partial sum goes)."""
        return self.slots[self.rank]

    def holds(self, x: np.ndarray | None) -> bool:
        """Whether ``x`` lies in this block."""
        return x is not None and np.may_share_memory(x, self._map)

    def result_for(self, start: np.ndarray) -> np.ndarray:
        """The result buffer a round whose state ``start`` may live in the other one writes into."""
        return self.results[1] if np.may_share_memory(start, self.results[0]) else self.results[0]

    def put_row(self, row: np.ndarray) -> None:
        self.rows[self.rank] = row

    def sum_rows(self) -> np.ndarray:
        """The members' small rows summed (in rank order)."""
        out = self.rows[0].copy()
        for r in range(1, self.world):
            out += self.rows[r]
        return out

    def reduce_slice(self, out: np.ndarray, start: int, stop: int) -> None:
        """``out[start:stop]`` = the members' slots summed there, in rank order (one member: its slot + 0)."""
        target = out[start:stop]
        if self.world == 1:
            np.add(self.slots[0, start:stop], np.float32(0), out=target)
            return
        np.add(self.slots[0, start:stop], self.slots[1, start:stop], out=target)
        for r in range(2, self.world):
            np.add(target, self.slots[r, start:stop], out=target)

    def barrier(self) -> None:
        """Wait until every member has reached this barrier (each member's n-th call meets the others' n-th)."""
        self.seq += 1
        self.counters[self.rank] = self.seq
        if self._arrived():
            self._wake()
            return
        start = checked = time.monotonic()
        while time.monotonic() - start < SPIN_S:  # a short wait: the last member is about to arrive
            os.sched_yield()
            if self._arrived():
                return
        while True:
            ready, _, _ = select.select([self._inbox], [], [], CHECK_EVERY_S)
            if ready:
                self._drain()
            if self._arrived():
                return
            if self.header[0]:
                raise SharedBroken("a member left the group's shared-memory block")
            now = time.monotonic()
            if now - checked >= CHECK_EVERY_S or not ready:
                checked = now
                self._check(now - start)

    def _arrived(self) -> bool:
        return int(self.counters.min()) >= self.seq

    def _wake(self) -> None:
        """Wake every other member (a byte in its FIFO; a full FIFO has bytes to wake it already, and one
        without a reader belongs to a member that is gone: the others' checks find it)."""
        for fd in self._peers:
            try:
                os.write(fd, b"w")
            except (BlockingIOError, BrokenPipeError):
                pass

    def _drain(self) -> None:
        try:
            while os.read(self._inbox, 4096):
                pass
        except BlockingIOError:
            pass

    def _check(self, waited: float) -> None:
        late = [r for r in range(self.world) if int(self.counters[r]) < self.seq]
        for r in late:
            pid = int(self.pids[r])
            if pid and not _alive(pid):
                self.mark_broken()
                raise SharedBroken(f"member {r} of the group (pid {pid}) died")
        if waited > self.timeout_s:
            self.mark_broken()
            raise SharedBroken(f"members {', '.join(map(str, late))} of the group did not reach the barrier in "
                               f"{self.timeout_s:g} s")

    def mark_broken(self) -> None:
        """Release every member waiting in this block (they raise :class:`SharedBroken`)."""
        self.header[0] = 1
        self._wake()

    def close(self) -> None:
        """Close this member's FIFOs (the block's mapping goes with the last view of it: a held state may
        still read from it)."""
        for fd in [self._inbox, *self._peers]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._inbox, self._peers = -1, []


def fifo_path(path: str, rank: int) -> str:
    """The FIFO of member ``rank`` of the block at ``path``."""
    return f"{path}.wake{rank}"

