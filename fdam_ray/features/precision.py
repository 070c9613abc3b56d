"""The arithmetic and memory format of a client's forward pass (the ``precision`` and ``channels_last`` fields).

``precision: bf16`` or ``fp16`` runs the network's forward pass under
``torch.autocast`` (matrix products and convolutions in 16 bits, reductions
and normalisations as autocast decides) and hands the objective float32
logits. Everything else stays float32: the parameters (views of the flat
vector, :mod:`fdam_ray.core.flat`), their gradients, a, b and alpha, the objective,
the local step, the control variates and every sum the server forms; a
checkpoint or update holds the same float32 vectors whatever the precision.
``fp16`` also scales the loss (``torch.amp.GradScaler``): gradients are
unscaled before the step, a step whose gradients overflowed is skipped, and
the scaler's state is part of the client's checkpointed state. ``fp32`` (the
default) runs exactly as without this module.

``channels_last`` hands convolutional networks their inputs in channels-last
memory format, so the convolutions and the activations between them run in
it (cuDNN's fast path for 16-bit convolutions). The weights stay in the flat
vector's own (NCHW) layout, so the flat vector still aliases them and states
move between replicas whatever their memory format. On a GPU with
``deterministic=false``, cuDNN's autotuner (``torch.backends.cudnn.benchmark``)
picks the fastest convolution kernels for the shapes it sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fdam_ray.settings.sections import Section, setting

log = logging.getLogger(__name__)

_warned_cpu_fp16 = False
DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionSection(Section):
    """The config fields that set how a client's forward pass computes."""

    name = "precision"

    precision: str = setting("fp32", "Arithmetic of the network's forward pass: fp32, or bf16/fp16 autocast (the "
                             "objective, a, b, alpha, the parameters and every sum stay float32; fp16 scales the "
                             "loss).", choices=("fp32", "bf16", "fp16"))
    channels_last: bool | str = setting("auto", "Run convolutional networks in channels-last memory format; auto = "
                                        "on for conv nets on a GPU, off on the CPU.",
                                        allowed="true, false or 'auto'", resume=True)
    deterministic: bool = setting(False, "Ask torch for deterministic kernels (GPU runs then repeat bit for bit, "
                                  "more slowly; CPU runs repeat exactly either way).", resume=True)


def is_conv_net(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def wants_channels_last(setting: bool | str, model: nn.Module, device: torch.device) -> bool:
    """``channels_last`` resolved: auto = on for a convolutional network on a GPU; never for other networks."""
    on = device.type == "cuda" if setting == "auto" else bool(setting)
    return on and is_conv_net(model)


def _to_channels_last(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    return output.contiguous(memory_format=torch.channels_last)


def keep_channels_last(model: nn.Module) -> None:
    """Make the convolutions of one input channel hand on channels-last outputs.

    A batch of one channel has the same strides in both formats, so a convolution
    reading it (with NCHW weights, as the flat vector holds them) writes NCHW; its
    output is re-laid once so the layers after it run channels-last.
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d) and m.in_channels == 1 and not getattr(m, "_fdam_channels_last", False):
            m.register_forward_hook(_to_channels_last)
            m._fdam_channels_last = True  # type: ignore[assignment]  # a plain flag; Module's stub types tensors


class _Update(torch.optim.Optimizer):
    """The solver's own update, shaped as an optimizer so that a GradScaler can unscale and guard it."""

    def __init__(self, params: Sequence[torch.Tensor], update: Callable[[], None]) -> None:
        super().__init__(list(params), {})
        self.update = update

    # A GradScaler calls step() without a closure; the update takes none (the supertype's overloads also
    # promise closure(), whose loss this step would have to return).
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.update()


class Precision:
    """How the forward pass runs: autocast dtype, input memory format and, for fp16, the loss scaler.

    Args:
        name: fp32, bf16 or fp16.
        device: where the network runs.
        channels_last: hand 4-d inputs to the network in channels-last format.
    """

    def __init__(self, name: str, device: torch.device, *, channels_last: bool = False) -> None:
        if name not in DTYPES:
            raise ValueError(f"precision {name!r} is not one of {', '.join(DTYPES)}")
        self.name = name
        self.device = torch.device(device)
        self.dtype = DTYPES[name]
        self.channels_last = channels_last
        self.scaler = torch.amp.GradScaler(self.device.type) if name == "fp16" else None
        self._update: _Update | None = None

    @classmethod
    def of(cls, config: PrecisionSection, model: nn.Module, device: torch.device) -> Precision:
        """The precision a config asks of ``model`` on ``device``; turns on cuDNN's autotuner on a GPU when
        the run does not ask for deterministic kernels."""
        if device.type == "cuda" and not config.deterministic:
            torch.backends.cudnn.benchmark = True
        channels_last = wants_channels_last(config.channels_last, model, device)
        if channels_last:
            keep_channels_last(model)
        return cls(config.precision, device, channels_last=channels_last)

    def note_training(self) -> None:
        """Say once per process when the precision trains slowly here (fp16 on the CPU)."""
        global _warned_cpu_fp16
        if self.name == "fp16" and self.device.type == "cpu" and not _warned_cpu_fp16:
            _warned_cpu_fp16 = True
            log.warning("precision=fp16 on the CPU runs, but most CPUs have no float16 matrix units and compute it "
                        "more slowly than fp32; bf16 is the CPU's mixed precision")

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``model(x)`` as float32 logits."""
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.dtype is None:
            return model(x)
        with self.autocast():
            out = model(x)
        return out.float()

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, update: Callable[[], None], params: Callable[[], Sequence[torch.Tensor]]) -> None:
        """Run ``update`` (the solver's step on the gradients of ``params()``); with fp16 first unscale the
        gradients, skip the step if any is infinite or NaN, and adjust the scale."""
        if self.scaler is None:
            update()
            return
        if self._update is None:
            self._update = _Update(params(), update)
        self._update.update = update
        self.scaler.step(self._update)  # unscales, then runs update() unless a gradient overflowed
        self.scaler.update()

    @property
    def scale(self) -> float:
        """The fp16 loss scale (1 without a scaler)."""
        return 1.0 if self.scaler is None else float(self.scaler.get_scale())

    def state_dict(self) -> dict | None:
        """The scaler's state (None without one), for a client's checkpointed state."""
        return None if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
