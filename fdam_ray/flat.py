"""Bind a model's parameters and buffers to flat storage.

Every parameter becomes a view into one float32 vector ``v`` (followed by a and
b of the AUC objectives) and its ``.grad`` a view into one gradient vector, so
a local step is a handful of vector operations and loading or exporting the
model state is one copy. Float buffers (BatchNorm statistics) become views into
a second vector; BatchNorm updates them in place, so they stay bound.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fdam_ray.state import GlobalState


def _bind(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        flat[offset : offset + n].copy_(t.detach().reshape(-1))
        offset += n


class FlatModel:
    """A model whose state lives in flat buffers.

    Args:
        model: the scoring network (moved to ``device``).
        aux_size: length of each of a, b and alpha (0 for bce).
        device: where the buffers live.
    """

    def __init__(self, model: nn.Module, *, aux_size: int, device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        self.model = model.to(device)
        self.device = device
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

        float_bufs, self._counter_slots = [], []
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

    @property
    def state_size(self) -> int:
        return self.v.numel()

    def counters(self) -> np.ndarray:
        if not self._counter_slots:
            return np.zeros(0, dtype=np.int64)
        # one transfer for all layers (not one device sync per BatchNorm layer)
        return torch.stack([m._buffers[n].reshape(-1)[0] for m, n in self._counter_slots]).cpu().numpy().astype(
            np.int64)

    def load(self, state: GlobalState) -> None:
        """Copy the global model state into this replica."""
        if state.v.shape[0] != self.v.numel():
            raise ValueError(f"state has {state.v.shape[0]} primal values, this model {self.v.numel()}")
        with torch.no_grad():
            self.v.copy_(torch.from_numpy(state.v), non_blocking=True)
            self.buffers.copy_(torch.from_numpy(state.buffers), non_blocking=True)
            self.alpha.copy_(torch.from_numpy(state.alpha))
        for (m, n), value in zip(self._counter_slots, state.counters.tolist(), strict=True):
            m._buffers[n].fill_(value)

    def _np(self, t: torch.Tensor, copy: bool = True) -> np.ndarray:
        return t.detach().to("cpu", copy=copy).numpy()

    def export(self, *, copy: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(v, alpha, buffers, counters) as numpy arrays: copies, or with ``copy=False`` views of the flat
        buffers where they live on the CPU (for a caller that serialises them before the model changes)."""
        return (self._np(self.v, copy), self._np(self.alpha, copy), self._np(self.buffers, copy),
                self.counters())

    def initial_state(self) -> GlobalState:
        v, alpha, buffers, counters = self.export()
        return GlobalState(v=v, alpha=alpha, buffers=buffers, counters=counters)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The network's ``state_dict`` (copied to CPU, detached from the flat storage)."""
        return {k: t.detach().to("cpu", copy=True) for k, t in self.model.state_dict().items()}
