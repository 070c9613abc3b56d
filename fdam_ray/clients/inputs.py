"""Finite values, and a client's features refused before or while training, in one line: NaN or infinity, or a
type the network cannot take."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fdam_ray.data import AnySplit, Split
from fdam_ray.models import model_name
from fdam_ray.settings.factories import describe_error


@torch.no_grad()
def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether no value of ``tensors`` is NaN or infinite.

    A sum is finite only if every term is (NaN and infinity propagate), and it
    costs a twentieth of an element-wise test; only a non-finite sum, which may
    also come from large finite terms overflowing, takes the element-wise test.
    """
    if bool(torch.isfinite(torch.stack([t.sum() for t in tensors])).all()):
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def check_features(split: AnySplit | None, client: int | str, what: str) -> None:
    """Refuse features holding NaN or infinity before training (they would only show later as a divergence).

    Tensors held in memory are checked whole; images read from disk are decoded into finite pixels.
    """
    if not isinstance(split, Split) or len(split) == 0 or all_finite([split.x]):
        return
    sample, column = (int(i) for i in (~torch.isfinite(split.x.reshape(len(split), -1))).nonzero()[0])
    raise ValueError(f"client {client}: its {what} features hold NaN or infinite values (first at sample "
                     f"{sample}, feature column {column}); clean or impute them before training")


def features_refused(exc: RuntimeError, x: torch.Tensor | None, model: str | Callable,
                     what: str) -> ValueError | None:
    """The one-line error for ``exc``, raised while the network ran on the batch ``x`` of ``what``, when the
    features are not floating point (integers, bool): what they are and what to change. None for any other
    error (raised as it was)."""
    if x is None or x.is_floating_point():
        return None
    return ValueError(f"{what}: the features are {x.dtype} and model {model_name(model)!r} cannot take them "
                      f"({describe_error(exc)}); give float features (convert x in the Dataset, e.g. x.float(), "
                      "or for uint8 images torchvision's ToDtype(torch.float32, scale=True)) or a model whose "
                      f"forward takes {x.dtype}")
