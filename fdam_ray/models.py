"""Scoring networks: each maps a batch of inputs to (B, T) logits; the score is their sigmoid.

No weights are ever downloaded: torchvision models are built with ``weights=None``.

Besides the built-in names, ``model`` may name your own factory by import path
(``my_pkg.models:build``) or, in Python, be the factory itself: a callable
``factory(input_shape, num_tasks)`` (plus ``width=model_width`` when it has a
parameter named ``width``) returning an ``nn.Module`` whose output for a batch of
B samples is (B, T) logits ((B,) is accepted when T = 1). [`check_model`][fdam_ray.models.check_model]
says what such a network may hold.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import socket
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fdam_ray.files.extras import MissingExtraError, extra_hint
from fdam_ray.settings.factories import (
    PYTHON_PREFIX,
    describe_error,
    import_path_of,
    is_import_path,
    python_name,
    raised_at,
    resolve,
)
from fdam_ray.settings.redact import short
from fdam_ray.settings.sections import AT_LEAST_ONE, Section, setting


def _image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(
            f"model '{name}' needs image inputs (channels, height, width), the dataset gives {input_shape}; "
            "use model=linear or model=mlp"
        )
    return input_shape


def linear(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_tasks))


def mlp(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, num_tasks),
    )


def cnn(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    """Three conv-BN-ReLU blocks (the last two with stride 2), global average pooling, linear head."""
    return _conv_net("cnn", input_shape, num_tasks, width, nn.BatchNorm2d)


def cnn_gn(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    """``cnn`` with GroupNorm in place of BatchNorm: each sample is normalised by its own statistics, so
    per-sample gradients are one sample's alone (``dp: sample`` refuses BatchNorm). Groups: gcd(32, channels)
    (32 for the default width, one channel per group). Same seed, same convolution and head weights as ``cnn``
    (both norms start at weight 1, bias 0 and draw nothing); no buffers."""
    return _conv_net("cnn_gn", input_shape, num_tasks, width, lambda c: nn.GroupNorm(math.gcd(32, c), c))


def _conv_net(name: str, input_shape: tuple[int, ...], num_tasks: int, width: int,
              norm: Callable[[int], nn.Module]) -> nn.Module:
    channels = _image_shape(name, input_shape)[0]

    def block(c_in: int, c_out: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), norm(c_out), nn.ReLU()]

    return nn.Sequential(
        *block(channels, width, 1),
        *block(width, 2 * width, 2),
        *block(2 * width, 2 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_tasks),
    )


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet20(nn.Module):
    """He et al.'s CIFAR ResNet-20: 3 stages of 3 basic blocks (16, 32, 64 channels), about 0.27M weights."""

    def __init__(self, channels: int, num_tasks: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        layers, c_in = [], 16
        for c_out, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                layers.append(_BasicBlock(c_in, c_out, stride if i == 0 else 1))
                c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(64, num_tasks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet20(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    return ResNet20(_image_shape("resnet20", input_shape)[0], num_tasks)


def _densenet(name: str, input_shape: tuple[int, ...], num_tasks: int) -> nn.Module:
    """A torchvision DenseNet (random init, T outputs), first convolution adapted to the input channels."""
    try:
        import torchvision.models
    except ImportError:
        raise MissingExtraError(f"model '{name}' is torchvision's: {extra_hint('images', 'torchvision')}") from None

    channels, height, width_px = _image_shape(name, input_shape)
    if min(height, width_px) < 32:
        raise ValueError(f"model '{name}' needs images of at least 32x32, the dataset gives {height}x{width_px}")
    model = getattr(torchvision.models, name)(weights=None, num_classes=num_tasks)
    if channels != 3:
        conv0 = model.features.conv0
        model.features.conv0 = nn.Conv2d(channels, conv0.out_channels, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def densenet121(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    """torchvision's DenseNet-121 (random init), first convolution adapted to the input channels."""
    return _densenet("densenet121", input_shape, num_tasks)


def densenet161(input_shape: tuple[int, ...], num_tasks: int, width: int) -> nn.Module:
    """torchvision's DenseNet-161 (random init, about 26.5M weights), first convolution adapted likewise."""
    return _densenet("densenet161", input_shape, num_tasks)


BUILDERS = {"linear": linear, "mlp": mlp, "cnn": cnn, "cnn_gn": cnn_gn, "resnet20": resnet20,
            "densenet121": densenet121, "densenet161": densenet161}
MODEL_NAMES = tuple(BUILDERS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection(Section):
    """The config fields of the scoring network and its initial weights."""

    name = "model"

    model: str = setting("cnn", "Scoring network: a name, or your own factory module:attr called as "
                         "factory(input_shape, num_tasks) -> nn.Module giving (B, T) logits, on the driver and every "
                         "client.", kind="factory", choices=MODEL_NAMES)
    model_width: int = setting(32, "Width of mlp hidden layers / cnn and cnn_gn channels; passed to your own model "
                               "factory as width= if it has that parameter, else unused.", check=AT_LEAST_ONE)
    model_weights: str | None = setting(None, "Local file of initial network weights (a state_dict saved with "
                                        "torch.save, or a run's model.pt); a classifier head of another size is "
                                        "re-initialised. Never downloaded.")


def model_name(model: str | Callable) -> str:
    """How a model is named in messages and records: a built-in name, an import path, or ``python:...``."""
    if isinstance(model, str):
        return model
    return import_path_of(model) or python_name(model)


def network_record(config: Any, input_shape: tuple[int, ...], num_tasks: int) -> dict[str, Any]:
    """Which network a saved model holds (the ``network`` entry of a run's ``model.pt``): the config's model
    fields and the input shape and task count it was built for, all [`fdam_ray.load_model`][fdam_ray.api.load_model]
    needs to build it again."""
    return {"model": model_name(config.model), "model_width": int(config.model_width), "seed": int(config.seed),
            "input_shape": [int(d) for d in input_shape], "num_tasks": int(num_tasks)}


# What a saved network record (model.pt's ``network``, read by fdam_ray.load_model) may ask to build. Every network
# of the built-in datasets (digits 1x8x8, mnist5k 1x28x28, cifar 3x32x32, imagefolder 3x224x224, chestxray 3x320x320
# or another image_size, synthetic num_features) and of your own arrays is far inside them.
MAX_INPUT_DIMS = 8  # dimensions of one sample
MAX_INPUT_VALUES = 2**26  # values in one sample (67,108,864: a 4x4096x4096 image)
MAX_MODEL_WIDTH = 2**16
MAX_TASKS = 2**16
MAX_SEED = 2**64 - 1  # torch.manual_seed's range
MAX_MODEL_NAME = 1000  # characters of a model name or import path


@dataclasses.dataclass(frozen=True)
class NetworkRecord:
    """Which network a saved model holds, checked ([`read_network_record`][fdam_ray.models.read_network_record])."""

    model: str
    model_width: int
    seed: int
    input_shape: tuple[int, ...]
    num_tasks: int


NETWORK_KEYS = tuple(f.name for f in dataclasses.fields(NetworkRecord))


def _shown(value: object) -> str:
    """A value of a record as a one-line message shows it (a tensor's repr has line breaks)."""
    return " ".join(short(value).split())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _model_name_problem(value: object) -> str | None:
    if (isinstance(value, str) and len(value) <= MAX_MODEL_NAME
            and (value in BUILDERS or is_import_path(value) or value.startswith(PYTHON_PREFIX))):
        return None
    return (f"one of {', '.join(BUILDERS)}, an import path module:attr or a python:... name, of at most "
            f"{MAX_MODEL_NAME} characters")


def record_problem(key: str, value: object) -> str | None:
    """What is wrong with ``value`` of the record's ``key`` (what is allowed), or None."""
    if key == "model":
        return _model_name_problem(value)
    if key == "input_shape":
        dims = list(value) if isinstance(value, (list, tuple)) else None
        if (dims is None or not 1 <= len(dims) <= MAX_INPUT_DIMS or not all(_is_int(d) and d >= 1 for d in dims)
                or math.prod(dims) > MAX_INPUT_VALUES):
            return (f"a list of 1 to {MAX_INPUT_DIMS} positive integers, the shape of one sample, of at most "
                    f"{MAX_INPUT_VALUES} values in all")
        return None
    low, high = {"model_width": (1, MAX_MODEL_WIDTH), "num_tasks": (1, MAX_TASKS), "seed": (0, MAX_SEED)}[key]
    if _is_int(value) and low <= value <= high:  # type: ignore[operator]
        return None
    return f"an integer from {low} to {high}"


def read_network_record(record: object, where: str, *, defaults: dict[str, Any] | None = None) -> NetworkRecord:
    """The network record ``record`` (``model.pt``'s ``network``), every key checked against the bounds above
    before anything is built; ``defaults`` fill keys an older record may lack (``seed``).

    Raises:
        ValueError: one line, ``where`` (the file and the record's name) followed by the key, its value and what
            is allowed: a record that is no mapping, a key missing, unknown, of a wrong type or out of bounds.
    """
    keys = ", ".join(NETWORK_KEYS)
    if not isinstance(record, dict) or not all(isinstance(k, str) for k in record):
        raise ValueError(f"{where} is {_shown(record)}, not a mapping of the keys {keys}")
    unknown = [k for k in record if k not in NETWORK_KEYS]
    if unknown:
        raise ValueError(f"{where} holds the unknown key(s) {_shown(unknown)} (a network record holds {keys})")
    values = {**(defaults or {}), **record}
    for key in NETWORK_KEYS:
        if key not in values:
            raise ValueError(f"{where} lacks the key {key!r} (a network record holds {keys})")
        problem = record_problem(key, values[key])
        if problem:
            raise ValueError(f"{where} key {key!r}: {_shown(values[key])} is not allowed ({problem})")
    return NetworkRecord(model=values["model"], model_width=values["model_width"], seed=values["seed"],
                         input_shape=tuple(values["input_shape"]), num_tasks=values["num_tasks"])


def layout(name: str, input_shape: tuple[int, ...], num_tasks: int, *, width: int) -> dict[str, torch.Tensor]:
    """The state_dict of the built-in network ``name`` laid out on torch's meta device: every key and shape,
    no memory taken and no weight initialised (what a file's weights are checked against before the network is
    built)."""
    if name.startswith("densenet"):
        import torchvision.models  # noqa: F401 (imported before the meta device is set: its own tensors are real)
    with torch.device("meta"):
        return BUILDERS[name](tuple(input_shape), num_tasks, width).state_dict()


def _factory(model: str | Callable) -> Callable:
    if callable(model):
        return model
    if is_import_path(model):
        return resolve(model, field="model", here=f"on host {socket.gethostname()}")
    raise ValueError(f"model {model!r} is not one of {', '.join(BUILDERS)}, nor an import path module:attr")


def _takes_width(fn: Callable) -> bool:
    try:
        return "width" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


def build_model(
    name: str | Callable, input_shape: tuple[int, ...], num_tasks: int, *, width: int = 32, seed: int = 0
) -> nn.Module:
    """Build a network with weights initialised from ``seed`` (the same on every client and the driver).

    ``name`` is a built-in name, an import path ``module:attr`` of a factory, or the factory itself.
    """
    input_shape = tuple(int(d) for d in input_shape)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    built_in = BUILDERS.get(name) if isinstance(name, str) else None
    if built_in is not None:
        builder, args, kwargs = built_in, (input_shape, num_tasks, width), {}
    else:
        builder = _factory(name)
        args, kwargs = (input_shape, num_tasks), ({"width": width} if _takes_width(builder) else {})
        try:
            inspect.signature(builder).bind(*args, **kwargs)
        except TypeError as exc:
            raise ValueError(f"model {model_name(name)!r}: a model factory is called as factory(input_shape, "
                             f"num_tasks) (and width=model_width if it takes width); this one cannot be ({exc})"
                             ) from None
        except ValueError:
            pass  # no signature to check against
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = builder(*args, **kwargs) if built_in is not None else _call_factory(builder, name, args, kwargs)
    return check_model(model, name, num_tasks)


def _call_factory(builder: Callable, name: str | Callable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call your own model factory; an error it raises (or ``sys.exit``) becomes one line naming the factory,
    how it was called and where in it the error came from, with no traceback through the federation."""
    try:
        return builder(*args, **kwargs)
    except (Exception, SystemExit) as exc:  # the factory's own failure, whatever it is
        call = ", ".join([*(repr(a) for a in args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        raise ValueError(f"model {model_name(name)!r}: the factory raised {describe_error(exc)}{raised_at(exc)} "
                         f"when called as factory({call}); fix the factory so that this call returns an "
                         "nn.Module") from None


def check_model(model: object, name: str | Callable, num_tasks: int) -> nn.Module:
    """Refuse, in one line, a network the federation cannot carry; watch its first output's shape.

    Every parameter is trained, so each must be float32 and require grad (fixed
    tensors belong in buffers). Float32 buffers (BatchNorm statistics) are
    averaged over clients; integer buffers of one element (``num_batches_tracked``)
    take the clients' maximum; other buffers (bool masks, integer vectors, float64)
    have no server rule and are refused. The first forward pass checks that a batch
    of B samples gives (B, T) logits, or (B,) when T = 1.
    """
    what = f"model {model_name(name)!r}"
    if not isinstance(model, nn.Module):
        raise ValueError(f"{what} returned a {type(model).__name__}, not a torch.nn.Module")
    params = list(model.named_parameters())
    if not params:
        raise ValueError(f"{what} has no parameters to train")
    for pname, p in params:
        if p.dtype != torch.float32:
            raise ValueError(f"{what}: parameter '{pname}' is {p.dtype}; the federation keeps weights in float32 "
                             "(build the network without .double() / .half())")
        if not p.requires_grad:
            raise ValueError(f"{what}: parameter '{pname}' does not require grad; every parameter is trained "
                             "(and moved by weight decay and the proximal term): register fixed tensors as "
                             "buffers (module.register_buffer) instead")
    for bname, b in model.named_buffers():
        if b.dtype == torch.float32 or (not b.is_floating_point() and not b.is_complex()
                                        and b.dtype != torch.bool and b.numel() == 1):
            continue
        raise ValueError(f"{what}: buffer '{bname}' ({b.dtype}, shape {tuple(b.shape)}) has no federation rule; "
                         "buffers must be float32 (averaged over clients) or integer counters of one element "
                         "(their maximum is kept): store constants as plain attributes or float32 buffers")
    _watch_first_output(model, what, num_tasks)
    return model


def _watch_first_output(model: nn.Module, what: str, num_tasks: int) -> None:
    """Check the shape of the network's first output, then stop watching."""

    def hook(module: nn.Module, args: tuple, output: object) -> None:
        x = args[0] if args else None
        batch = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() > 0 else None
        if not isinstance(output, torch.Tensor):
            raise ValueError(f"{what} returned a {type(output).__name__} from forward; expected a tensor of "
                             f"logits of shape (batch, {num_tasks})")
        shape = tuple(output.shape)
        ok = batch is not None and (shape == (batch, num_tasks) or (num_tasks == 1 and shape == (batch,)))
        if not ok:
            expected = f"({batch}, {num_tasks})" + (f" or ({batch},)" if num_tasks == 1 else "")
            raise ValueError(f"{what} returned logits of shape {shape} for a batch of {batch} samples; expected "
                             f"{expected}: one logit per task (num_tasks={num_tasks})")
        handle.remove()

    handle = model.register_forward_hook(hook)
