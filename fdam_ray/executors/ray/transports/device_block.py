"""The all-reduce of ``transport: collective`` for members that share one device: a block of device memory.

NCCL takes one rank per GPU and refuses a second rank on the same device, so
actors that share a GPU cannot all-reduce through it; without this module
they would reduce through host memory (gloo, or the shared-memory block of
:mod:`.shared`), copying every state off the device and back. Here each
member exports device buffers once per group through torch's IPC reductions
(:func:`torch.multiprocessing.reductions.reduce_tensor`: a CUDA tensor's
storage travels as a ``cudaIpcMemHandle``; a CPU tensor's as a shared-memory
file name, torch's ``file_system`` sharing) and the members reduce as the
shared-memory block does:

1. each member's partial sum is in its own slot (its fold can write there
   directly, :attr:`DeviceBlock.slot`); barrier;
2. every member sums its own slice of the slots in rank order into a result
   buffer (rank order is the shared-memory block's and the driver's fold
   order, so the sums equal theirs bit for bit: a float32 add is exactly
   rounded on the CPU and on the GPU alike); barrier;
3. every member reads the whole result (a view of the buffer, no copy).

The handles are plain values (numbers, byte strings, a dtype's name) sent as
JSON through the group's store (:meth:`DeviceBlock.open`); nothing is
unpickled. The lowest rank owns the two result buffers, used in turn (a
result stays whole until the member that holds it calls :meth:`DeviceBlock.reduce`
twice more), and a tiny host block of counters: a barrier is a counter per
member (plain aligned 8-byte stores, which x86-64 keeps in order, as in
:mod:`.shared`); a waiting member yields the CPU for :data:`SPIN_S`, then
naps (at most :data:`NAP_S`) and looks again. Every wait is bounded by the
group's timeout and checks the other members' processes every
:data:`CHECK_EVERY_S`: a member that died, or that left (:meth:`DeviceBlock.close`
marks the block broken), ends the wait with :class:`DeviceBlockBroken`.

On a GPU a member waits for its own device work before each barrier, so what
the others read after it is complete. The same code runs on CPU tensors
(how it is tested without a GPU); :func:`device_block_usable` says when a group
should use it.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.multiprocessing import reductions

from fdam_ray.executors.ray.transports.shared import _alive, supported

SPIN_S = 0.002  # a wait first yields the CPU in a loop for this long (most waits end within it)
NAP_S = 0.002  # then naps, each at most this long, and looks again
CHECK_EVERY_S = 0.05  # how often a wait looks at the other members' processes and the clock
_HEADER = 8  # int64 words before the per-member ones: [0] broken (the others are spare)
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
_CLASSES = {"Tensor": torch.Tensor, "TypedStorage": torch.storage.TypedStorage,
            "UntypedStorage": torch.UntypedStorage}


DEVICE = "device"  # the collective backend of this module (collective_backend: device)


class DeviceBlockBroken(RuntimeError):
    """A member of the device block died, left it, or did not reach a barrier (or publish its buffers) in time."""


def device_identity(device: torch.device) -> str:
    """What a member reports of its device so that the group can tell whether all share one: a CUDA device's
    UUID (an actor's ``cuda:0`` may be another actor's ``cuda:1``), else ``cpu/`` and the host's name."""
    if device.type == "cuda":
        return f"cuda/{torch.cuda.get_device_properties(device).uuid}"
    return f"cpu/{socket.gethostname()}"


def device_block_usable(devices: Sequence[str], *, allow_cpu: bool = False,
                        cuda_available: bool | None = None) -> bool:
    """Whether members with these identities (:func:`device_identity`, or any ``cuda/...`` / ``cpu/...`` names
    that are equal exactly when the devices are one) can reduce through a device block: all on one CUDA device,
    CUDA available (``cuda_available``; None: asked here, so a driver without a GPU passes what its members
    reported), on a host that keeps stores in order (:func:`.shared.supported`); members on one host's CPU only
    with ``allow_cpu`` (tests: host memory is better served by :mod:`.shared`)."""
    if not devices or len(set(devices)) != 1 or not supported():
        return False
    kind = devices[0].split("/", 1)[0]
    if kind == "cuda":
        return torch.cuda.is_available() if cuda_available is None else cuda_available
    return allow_cpu and kind == "cpu"


def slice_of(n: int, world: int, rank: int) -> tuple[int, int]:
    """Member ``rank``'s share of an ``n``-long vector: contiguous, in rank order (the last ones one shorter);
    the split of :meth:`.group.GroupMember.my_slice`."""
    per, extra = divmod(n, world)
    start = rank * per + min(rank, extra)
    return start, start + per + (rank < extra)


# -- handles -----------------------------------------------------------------------------------
def _encode(value: Any) -> Any:
    """A value of torch's CUDA handle as JSON (tagged: bytes, sizes, dtypes and the two classes)."""
    if isinstance(value, bytes):
        return {"b": base64.b64encode(value).decode()}
    if isinstance(value, torch.dtype):
        return {"d": str(value).removeprefix("torch.")}
    if isinstance(value, type):
        return {"c": value.__name__}
    if isinstance(value, tuple | list | torch.Size):
        return {"t": [_encode(v) for v in value]}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot send a {type(value).__name__} in a device handle")


def _decode(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    if "b" in value:
        return base64.b64decode(value["b"])
    if "d" in value:
        return _DTYPES[value["d"]]
    if "c" in value:
        return _CLASSES[value["c"]]
    return tuple(_decode(v) for v in value["t"])


def export_tensor(t: torch.Tensor) -> str:
    """A handle (JSON) through which one other process on this host maps ``t``'s memory (one handle a peer: each
    carries the reference the peer's mapping takes over; CPU: ``t``'s storage is moved into shared memory at
    the first export, so export a tensor before writing into it)."""
    if t.is_cuda:
        rebuild, args = reductions.reduce_tensor(t)
        if rebuild is not reductions.rebuild_cuda_tensor:
            raise TypeError(f"cannot export a {t.layout} CUDA tensor")
        return json.dumps({"cuda": [_encode(a) for a in args]})
    storage = t.untyped_storage()
    manager, name, nbytes = storage._share_filename_cpu_()
    storage._shared_incref()  # the peer's mapping drops it (torch's protocol for a storage in transit)
    return json.dumps({"cpu": [_encode(manager), _encode(name), nbytes, str(t.dtype).removeprefix("torch."),
                               t.storage_offset(), list(t.shape), list(t.stride())]})


def import_tensor(handle: str) -> torch.Tensor:
    """The tensor :func:`export_tensor` made ``handle`` of, mapped in this process (same memory)."""
    spec = json.loads(handle)
    if "cuda" in spec:
        return reductions.rebuild_cuda_tensor(*(_decode(a) for a in spec["cuda"]))
    manager, name, nbytes, dtype, offset, shape, stride = spec["cpu"]
    storage = reductions.rebuild_storage_filename(torch.UntypedStorage, _decode(manager), _decode(name), nbytes)
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=_DTYPES[dtype], _internal=True)
    return reductions.rebuild_tensor(torch.Tensor, typed, (offset, tuple(shape), tuple(stride), False))


# -- the block ---------------------------------------------------------------------------------
class DeviceBlock:
    """One member's view of the group's device block: its slot, the others' slots, the result buffers and the
    barrier's counters (:meth:`open`, :meth:`reduce`, :meth:`close`)."""

    def __init__(self) -> None:
        self.rank, self.world, self.numel = -1, 0, 0
        self.device = torch.device("cpu")
        self.timeout_s = 0.0
        self._slots: list[torch.Tensor] = []
        self._results: list[torch.Tensor] = []
        self._words: np.ndarray = np.zeros(0, dtype=np.int64)  # view of the lowest rank's counters
        self._keep: list[torch.Tensor] = []  # the tensors behind every view (the counters' above all)
        self._seq = 0
        self._turn = 0

    @property
    def slot(self) -> torch.Tensor:
        """This member's slot: where its partial sum goes (a fold may write there; :meth:`reduce` then copies
        nothing)."""
        return self._slots[self.rank]

    def open(self, store: Any, rank: int, size: int, numel: int, device: torch.device | str, *,
             prefix: str = "device-block", timeout_s: float = 60.0, dtype: torch.dtype = torch.float32) -> None:
        """Join the block of the group of ``size`` members whose store is ``store`` (a ``torch.distributed``
        store; ``prefix`` names this block's keys in it, one prefix per block): make and export this member's
        slot (the lowest rank: the result buffers and the counters too) on ``device``, a handle for each other
        member, map the others', and wait until every member has. Each wait at most ``timeout_s``. Members on
        CUDA must name the same device by the same index (actors that share one GPU each see it as
        ``cuda:0``)."""
        self.close()
        device = torch.device(device)
        self.rank, self.world, self.numel, self.device, self.timeout_s = rank, size, numel, device, timeout_s
        self._seq = self._turn = 0
        mine = [torch.zeros(numel, dtype=dtype, device=device)]
        if rank == 0:
            mine += [torch.zeros(numel, dtype=dtype, device=device) for _ in range(2)]
            mine.append(torch.zeros(_HEADER + 2 * size, dtype=torch.int64))  # host memory, whatever the device
        self._sync()
        for r in range(size):
            if r != rank:
                store.set(f"{prefix}/{rank}-{r}", json.dumps([export_tensor(t) for t in mine]))
        theirs: list[list[torch.Tensor]] = []
        deadline = time.monotonic() + timeout_s
        for r in range(size):
            if r == rank:
                theirs.append(mine)
                continue
            key = f"{prefix}/{r}-{rank}"
            try:
                store.wait([key], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                handles = json.loads(store.get(key).decode())
            except RuntimeError as exc:  # the store's timeout, or its server gone with the lowest rank
                raise DeviceBlockBroken(f"member {r} of the group did not publish its device buffers in "
                                        f"{timeout_s:g} s ({(str(exc).splitlines() or [''])[0]})") from exc
            theirs.append([import_tensor(h) for h in handles])
        self._slots = [t[0] for t in theirs]
        self._results = theirs[0][1:3]
        counters = theirs[0][3]
        self._keep = [t for ts in theirs for t in ts]
        self._words = counters.numpy()
        self._words[_HEADER + size + rank] = os.getpid()
        self.barrier()  # every member has mapped every buffer

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The members' partial sums summed in rank order (every member calls it with its own, on the block's
        device): a view of a result buffer, whole until this member calls :meth:`reduce` twice more."""
        if not self._slots:
            raise RuntimeError("the device block is not open")
        try:
            slot = self.slot
            if partial.data_ptr() != slot.data_ptr() or partial.numel() != slot.numel():
                slot.copy_(partial.reshape(-1))
            self._sync()
            self.barrier()
            out = self._results[self._turn]
            self._turn ^= 1
            start, stop = slice_of(self.numel, self.world, self.rank)
            self._sum_slice(out, start, stop)
            self._sync()
            self.barrier()
        except DeviceBlockBroken:
            raise
        except Exception:
            self.mark_broken()
            raise
        return out

    def _sum_slice(self, out: torch.Tensor, start: int, stop: int) -> None:
        """``out[start:stop]`` = the slots summed there in rank order (one member: its slot + 0)."""
        target = out[start:stop]
        slots = [s[start:stop] for s in self._slots]
        if self.world == 1:
            torch.add(slots[0], 0.0, out=target)
            return
        torch.add(slots[0], slots[1], out=target)
        for s in slots[2:]:
            target.add_(s)

    def _sync(self) -> None:
        """Wait for this process's work on the block's device (a barrier then publishes finished memory)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- the barrier ---------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait until every member has reached this barrier (each member's n-th call meets the others' n-th)."""
        words, seq = self._words, self._seq + 1
        self._seq = seq
        seqs = words[_HEADER:_HEADER + self.world]
        seqs[self.rank] = seq
        start = checked = time.monotonic()
        nap = 1e-5
        while int(seqs.min()) < seq:
            if words[0]:  # released by a member that left or found the group broken: say why if it is a death
                self._find_dead()
                raise DeviceBlockBroken("a member left the group's device block")
            now = time.monotonic()
            if now - start < SPIN_S:
                os.sched_yield()
                continue
            time.sleep(nap)
            nap = min(2 * nap, NAP_S)
            if now - checked >= CHECK_EVERY_S:
                checked = now
                self._check(now - start)

    def _late(self) -> list[int]:
        return [r for r in range(self.world) if int(self._words[_HEADER + r]) < self._seq]

    def _find_dead(self) -> None:
        """Raise :class:`DeviceBlockBroken` naming a member that has not reached this barrier and is dead."""
        for r in self._late():
            pid = int(self._words[_HEADER + self.world + r])
            if pid and not _alive(pid):
                self.mark_broken()
                raise DeviceBlockBroken(f"member {r} of the group (pid {pid}) died")

    def _check(self, waited: float) -> None:
        self._find_dead()
        late = self._late()
        if waited > self.timeout_s:
            self.mark_broken()
            raise DeviceBlockBroken(f"members {', '.join(map(str, late))} of the group did not reach the device "
                                    f"block's barrier in {self.timeout_s:g} s")

    def mark_broken(self) -> None:
        """Release every member waiting in this block (they raise :class:`DeviceBlockBroken`)."""
        if self._words.size:
            self._words[0] = 1

    def close(self) -> None:
        """Leave the block: members still waiting in it are released; this member's views are dropped (the
        memory goes with the last process that maps it)."""
        self.mark_broken()
        self._slots, self._results, self._keep = [], [], []
        self._words = np.zeros(0, dtype=np.int64)
