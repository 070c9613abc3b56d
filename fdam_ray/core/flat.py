"""Bind a model's parameters and buffers to flat storage.

Every parameter becomes a view into one float32 vector ``v`` (followed by a and
b of the AUC objectives) and its ``.grad`` a view into one gradient vector, so
a local step is a handful of vector operations and loading or exporting the
model state is one copy. Float buffers (BatchNorm statistics) become views into
a second vector; BatchNorm updates them in place, so they stay bound.

The flat layout is the networks' own (contiguous, NCHW for convolution
weights) whatever memory format the forward pass runs in
(:mod:`fdam_ray.features.precision`), so states move between replicas on any device.
Every host-device copy of a state-sized vector goes through one
:class:`HostLink`: on a GPU it stages through pinned host buffers and copies
without blocking, and each vector crosses once per load or export.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from fdam_ray.core.state import GlobalState, reads_store_arrays
from fdam_ray.features.precision import Precision

reads_store_arrays(__name__)  # states from the object store are only copied into the model


def _bind(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        flat[offset : offset + n].copy_(t.detach().reshape(-1))
        offset += n


class HostLink:
    """Copies of float32 vectors between host (numpy) and ``device``, recorded in :attr:`log`.

    On a GPU a load writes the host arrays into one pinned buffer and copies each
    part to its device tensor without blocking (the buffer is reused once those
    copies are done); an export copies the device tensors into a second pinned
    buffer without blocking and waits once. On the CPU the copies are plain.
    ``log`` holds ``(direction, numel)`` per vector copied ("up" = to the device).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._up: torch.Tensor | None = None
        self._down: torch.Tensor | None = None
        self._uploaded: torch.cuda.Event | None = None
        self.log: list[tuple[str, int]] = []

    def _buffer(self, buf: torch.Tensor | None, n: int) -> torch.Tensor:
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=torch.float32, pin_memory=True)
        return buf

    def upload(self, pairs: Sequence[tuple[np.ndarray, torch.Tensor]]) -> None:
        """Copy each host array into its device tensor (same length, float32)."""
        for src, dst in pairs:
            if src.shape[0] != dst.numel():
                raise ValueError(f"a host vector of {src.shape[0]} values cannot fill a device vector of {dst.numel()}")
            self.log.append(("up", dst.numel()))
        with torch.no_grad():
            if not self.pinned:
                for src, dst in pairs:
                    dst.copy_(torch.from_numpy(src))
                return
            if self._uploaded is not None:
                self._uploaded.synchronize()  # the last load's copies have read the buffer
            self._up = self._buffer(self._up, sum(dst.numel() for _, dst in pairs))
            offset = 0
            for src, dst in pairs:
                n = dst.numel()
                part = self._up[offset : offset + n]
                np.copyto(part.numpy(), src, casting="same_kind")
                dst.copy_(part.view_as(dst), non_blocking=True)
                offset += n
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()

    def download(self, tensors: Sequence[torch.Tensor], *, copy: bool = True) -> list[np.ndarray]:
        """The device tensors as host arrays: copies, or with ``copy=False`` views valid until the next download
        (of this link's pinned buffer on a GPU, of the tensors themselves on the CPU)."""
        self.log.extend(("down", t.numel()) for t in tensors)
        if not self.pinned:
            return [t.detach().to("cpu", copy=copy).numpy() for t in tensors]
        self._down = self._buffer(self._down, sum(t.numel() for t in tensors))
        parts, offset = [], 0
        for t in tensors:
            part = self._down[offset : offset + t.numel()]
            part.copy_(t.detach().reshape(-1), non_blocking=True)
            parts.append(part)
            offset += t.numel()
        torch.cuda.current_stream(self.device).synchronize()
        return [p.numpy().copy() if copy else p.numpy() for p in parts]


class FlatModel:
    """A model whose state lives in flat buffers.

    Args:
        model: the scoring network (moved to ``device``).
        aux_size: length of each of a, b and alpha (0 for bce).
        device: where the buffers live.
        precision: the forward pass's arithmetic and memory format (default: float32, as stored).
    """

    def __init__(self, model: nn.Module, *, aux_size: int, device: torch.device | str = "cpu",
                 precision: Precision | None = None) -> None:
        device = torch.device(device)
        self.model = model.to(device)
        self.device = device
        self.precision = precision or Precision("fp32", device)
        self.link = HostLink(device)
        params = list(model.parameters())
        self.num_weights = sum(p.numel() for p in params)
        self.aux_size = aux_size
        size = self.num_weights + 2 * aux_size
        self.v = torch.zeros(size, device=device)
        self.grad = torch.zeros(size, device=device)
        _bind(params, self.v)
        offset = 0
        for p in params:
            n = p.numel()
            p.data = self.v[offset : offset + n].view_as(p)
            p.grad = self.grad[offset : offset + n].view_as(p)
            offset += n
        self.a = nn.Parameter(torch.zeros(aux_size, device=device))
        self.b = nn.Parameter(torch.zeros(aux_size, device=device))
        for aux in (self.a, self.b):
            aux.data = self.v[offset : offset + aux_size]
            aux.grad = self.grad[offset : offset + aux_size]
            offset += aux_size
        self.alpha = torch.zeros(aux_size, device=device, requires_grad=True)
        self.alpha.grad = torch.zeros_like(self.alpha)

        float_bufs: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._counter_slots: list[tuple[nn.Module, str]] = []
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is None:
                    continue
                if buf.is_floating_point():
                    float_bufs.append((module, name, buf))
                else:
                    self._counter_slots.append((module, name))
        self.buffers = torch.zeros(sum(b.numel() for _, _, b in float_bufs), device=device)
        _bind([b for _, _, b in float_bufs], self.buffers)
        offset = 0
        for module, name, buf in float_bufs:
            n = buf.numel()
            module._buffers[name] = self.buffers[offset : offset + n].view_as(buf)
            offset += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The network's float32 logits of ``x`` (in the precision's arithmetic and memory format)."""
        return self.precision.forward(self.model, x)

    def bound(self) -> bool:
        """Whether every parameter, its gradient and every float buffer is still a view of the flat storage."""
        def inside(t: torch.Tensor, flat: torch.Tensor) -> bool:
            start = flat.data_ptr()
            return (t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() and t.is_contiguous()
                    and start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size()
                    <= start + flat.numel() * flat.element_size())

        params = list(self.model.parameters())
        bufs = [b for m in self.model.modules() for b in m._buffers.values() if b is not None and b.is_floating_point()]
        return (all(inside(p, self.v) and p.grad is not None and inside(p.grad, self.grad) for p in params)
                and all(inside(b, self.buffers) for b in bufs))

    @property
    def alpha_grad(self) -> torch.Tensor:
        """alpha's gradient: allocated once at construction, zeroed and read in place by the local step."""
        grad = self.alpha.grad
        if grad is None:
            raise RuntimeError("alpha's gradient buffer was removed (FlatModel allocates it once and keeps it)")
        return grad

    def _counters(self) -> list[torch.Tensor]:
        """The integer buffers, looked up in their modules (a module may rebind a buffer; it must not drop one)."""
        out = []
        for m, n in self._counter_slots:
            t = m._buffers[n]
            if t is None:
                raise RuntimeError(f"buffer {n!r} of {type(m).__name__} was set to None after the model was bound")
            out.append(t)
        return out

    @property
    def state_size(self) -> int:
        return self.v.numel()

    def counters(self) -> np.ndarray:
        if not self._counter_slots:
            return np.zeros(0, dtype=np.int64)
        # one transfer for all layers (not one device sync per BatchNorm layer)
        return torch.stack([t.reshape(-1)[0] for t in self._counters()]).cpu().numpy().astype(np.int64)

    def load(self, state: GlobalState, also: Sequence[tuple[np.ndarray, torch.Tensor]] = ()) -> None:
        """Copy the global model state into this replica, and each ``also`` host array into its device
        tensor in the same pass (one crossing per vector)."""
        if state.v.shape[0] != self.v.numel():
            raise ValueError(f"state has {state.v.shape[0]} primal values, this model {self.v.numel()}")
        self.link.upload([(state.v, self.v), (state.buffers, self.buffers), (state.alpha, self.alpha), *also])
        for counter, value in zip(self._counters(), state.counters.tolist(), strict=True):
            counter.fill_(value)

    def export(self, *, copy: bool = True, also: Sequence[torch.Tensor] = ()) -> tuple[np.ndarray, ...]:
        """(v, alpha, buffers, counters, then each ``also`` tensor) as numpy arrays: copies, or with ``copy=False``
        views (of the flat buffers on the CPU, of a pinned buffer on a GPU) valid until the next export, for a
        caller that serialises them at once."""
        v, alpha, buffers, *rest = self.link.download([self.v, self.alpha, self.buffers, *also], copy=copy)
        return (v, alpha, buffers, self.counters(), *rest)

    def initial_state(self) -> GlobalState:
        v, alpha, buffers, counters = self.export()
        return GlobalState(v=v, alpha=alpha, buffers=buffers, counters=counters)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The network's ``state_dict`` (copied to CPU, detached from the flat storage)."""
        return {k: t.detach().to("cpu", copy=True) for k, t in self.model.state_dict().items()}
