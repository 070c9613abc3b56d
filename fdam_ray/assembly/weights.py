"""Initial network weights from a local file (never downloaded).

:func:`read_weights` reads a ``state_dict`` saved with ``torch.save`` (or a
run's ``model.pt``, or a checkpoint that wraps one under ``state_dict``) with
``torch.load(..., weights_only=True)``, so a file cannot run code.
:func:`load_weights` copies it into a network: every key must match in name
and shape except the classifier head (the last ``nn.Linear``), which keeps its
fresh initialisation when the file's head has another size or is absent, so an
ImageNet checkpoint (1000 outputs) can start a T-task AUC model.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from fdam_ray.files.torchload import safe_load, torch_load_failure, value_problems
from fdam_ray.settings.redact import short

log = logging.getLogger(__name__)

# Old torchvision DenseNet checkpoints name layers "norm.1"; torchvision's modules are "norm1".
_DENSENET_OLD_KEY = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$"
)


def _unwrap(obj: object, path: str) -> dict[str, torch.Tensor]:
    for key in ("model", "state_dict"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    if not isinstance(obj, Mapping) or not obj or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise ValueError(f"model_weights: '{path}' does not hold a state_dict (a mapping of names to tensors, "
                         "as saved by torch.save(model.state_dict(), path))")
    state = dict(obj)
    if all(k.startswith("module.") for k in state):  # saved from DataParallel / DistributedDataParallel
        state = {k[len("module."):]: v for k, v in state.items()}
    return {(m.group(1) + m.group(2) if (m := _DENSENET_OLD_KEY.match(k)) else k): v for k, v in state.items()}


def is_state_dict(obj: object) -> bool:
    """Whether ``obj`` is a non-empty mapping of names (printable text) to dense tensors holding values (not on
    the meta device)."""
    return isinstance(obj, Mapping) and bool(obj) and all(
        isinstance(k, str) and 0 < len(k) <= _LONGEST_KEY and k.isprintable() and isinstance(v, torch.Tensor)
        and v.layout == torch.strided and not v.is_meta for k, v in obj.items())


_LONGEST_KEY = 1000  # characters of a state_dict key (a parameter's dotted name)


def not_a_state_dict(obj: object) -> str:
    """Why ``obj`` is no state_dict (:func:`is_state_dict`), in a few words on one line."""
    if not isinstance(obj, Mapping):
        return f"it is a {type(obj).__name__}"
    if not obj:
        return "it is empty"
    for key, value in obj.items():
        if not isinstance(key, str) or not 0 < len(key) <= _LONGEST_KEY or not key.isprintable():
            return f"its key {' '.join(short(key, 60).split())} is not a parameter name"
        if not isinstance(value, torch.Tensor):
            return f"its entry {short(key, 60)} is a {type(value).__name__}, not a tensor"
        if value.layout != torch.strided or value.is_meta:
            return f"its entry {short(key, 60)} is a {value.layout} tensor on {value.device}, not a dense tensor"
    return "it holds no tensors"


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The state_dict in a local file, on CPU.

    Raises:
        ValueError: the file does not exist, cannot be read safely, or holds no state_dict.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"model_weights: '{path}' is not a file (weights are read from a local file, "
                         "never downloaded)")
    try:
        obj = safe_load(file)
    except Exception as exc:  # torch raises several kinds; all mean "not a weights file"
        raise ValueError(f"model_weights: '{path}' cannot be read with torch.load(weights_only=True): "
                         f"{torch_load_failure(exc)}") from None
    return _unwrap(obj, str(path))


def head_prefix(model: nn.Module) -> str:
    """The name of the classifier head: the last ``nn.Linear`` in module order."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no nn.Linear classifier head")
    return names[-1]


def head_keys(model: nn.Module) -> list[str]:
    """The state_dict keys of the classifier head."""
    prefix = head_prefix(model) + "."
    return [k for k in model.state_dict() if k.startswith(prefix)]


def _names(items: list[str], shown: int = 8) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _shape(t: torch.Tensor) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def load_weights(model: nn.Module, state: Mapping[str, torch.Tensor], *, source: str = "the weights") -> list[str]:
    """Copy ``state`` into ``model`` in place; returns the head keys left at their fresh initialisation.

    Raises:
        ValueError: naming the keys the model lacks, the keys the file lacks and the
            keys whose shapes differ (the classifier head excepted).
    """
    own = model.state_dict()
    head = set(head_keys(model))
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [k for k in own if k in state and state[k].shape != own[k].shape]
    fresh_head = sorted(head & set(missing + mismatched))
    if fresh_head:
        fresh_head = sorted(head)  # weight and bias together
        unexpected = [k for k in unexpected if not _same_module(k, head)]
    problems = _misfits(own, state, head, missing=missing, mismatched=mismatched, unexpected=unexpected)
    if bad := value_problems({k: v for k, v in own.items() if k not in fresh_head}, state):
        problems.append("entries of the wrong kind or not finite: " + _names(bad))
    if problems:
        raise ValueError(f"{source} do not fit model {type(model).__name__}: " + "; ".join(problems))
    with torch.no_grad():
        for key, value in state.items():
            if key not in fresh_head:
                own[key].copy_(value)
    if fresh_head:
        why = "its size differs from the file's" if head & set(mismatched) else "the weights have none"
        log.warning("%s: classifier head %s re-initialised (%s)", source, ", ".join(fresh_head), why)
    return fresh_head


def misfits(own: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> list[str]:
    """What keeps ``state`` from fitting a network whose state_dict is ``own`` key for key and shape for shape (its
    head included), a phrase per kind; ``own`` may be laid out on the meta device."""
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [k for k in own if k in state and state[k].shape != own[k].shape]
    return _misfits(own, state, set(), missing=missing, mismatched=mismatched, unexpected=unexpected)


def _misfits(own: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], head: set[str], *,
             missing: list[str], mismatched: list[str], unexpected: list[str]) -> list[str]:
    """What keeps ``state`` from fitting the model (the classifier head excepted), a phrase per kind."""
    problems = []
    if bad := [k for k in mismatched if k not in head]:
        problems.append("shapes differ: " + _names([f"{k} (file {_shape(state[k])}, model {_shape(own[k])})"
                                                    for k in bad]))
    if bad := [k for k in missing if k not in head]:
        problems.append(f"the file lacks {len(bad)} key(s): {_names(bad)}")
    if unexpected:
        problems.append(f"the model has no key(s) {_names(unexpected)}")
    return problems


def _same_module(key: str, head: set[str]) -> bool:
    """Whether ``key`` names a tensor of the head module (a file's head may have e.g. no bias)."""
    prefixes = {h.rsplit(".", 1)[0] + "." for h in head}
    return any(key.startswith(p) for p in prefixes)
