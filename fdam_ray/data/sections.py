"""What the data sources read of a config: typed sections (see :mod:`fdam_ray.sections`).

A source's constructor takes its dataset's section, not the whole config, so
what a dataset depends on is visible in one place and a client's data spec
carries nothing else. :class:`DataSection` holds the fields the data sources
share; a dataset with settings of its own has a subclass that adds them.
:func:`data_section` cuts the right one for the dataset a config names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fdam_ray.factories import is_import_path
from fdam_ray.sections import Section


@dataclasses.dataclass(frozen=True)
class DataSection(Section):
    """The data fields read by digits, mnist5k, cifar10/100 and imagefolder (and, in part, by every source)."""

    dataset: str
    data_root: str | None
    num_clients: int
    seed: int
    partition: str
    imratio: float
    dirichlet_concentration: float
    positive_classes: tuple[int, ...] | None
    negative_classes: tuple[int, ...] | None
    test_fraction: float
    image_size: int | None
    augment: bool
    data_workers: int | str
    download: bool


@dataclasses.dataclass(frozen=True)
class SyntheticSection(DataSection):
    """``dataset: synthetic``: the Gaussian mixtures' size and heterogeneity as well."""

    heterogeneity: float
    num_features: int
    samples_per_client: int


@dataclasses.dataclass(frozen=True)
class ChestXraySection(DataSection):
    """``dataset: chestxray``: the organisations, their folders, the client layout, splits and label policies."""

    chestxray_sources: tuple[str, ...]
    chestxray_chexpert_root: str | None
    chestxray_nih_root: str | None
    chestxray_padchest_root: str | None
    chestxray_mimic_root: str | None
    chestxray_vindr_root: str | None
    chestxray_clients: str
    chestxray_clients_per_source: tuple[int, ...] | None
    chestxray_test_fraction: float
    chestxray_test_split: str
    chestxray_uncertain: tuple[str, ...]
    chestxray_blank: str
    chestxray_frontal_only: bool


# The section each dataset's source takes ("arrays" has none: its data comes in memory, not from a config).
SECTIONS: dict[str, type[DataSection]] = {
    "digits": DataSection,
    "mnist5k": DataSection,
    "synthetic": SyntheticSection,
    "cifar10": DataSection,
    "cifar100": DataSection,
    "imagefolder": DataSection,
    "chestxray": ChestXraySection,
}


def data_section(config: Any) -> DataSection:
    """The section of the dataset ``config`` names, cut from a :class:`~fdam_ray.config.Config` or a wider section.

    Raises:
        ValueError: the dataset has no source built from a config.
        TypeError: ``config`` lacks fields that dataset's section needs.
    """
    cls = DataSection if is_import_path(config.dataset) else SECTIONS.get(config.dataset)  # your own factory
    if cls is None:
        raise ValueError(f"dataset {config.dataset!r} has no loader")
    missing = [f.name for f in dataclasses.fields(cls) if not hasattr(config, f.name)]
    if missing:
        raise TypeError(f"dataset={config.dataset} reads {', '.join(missing)}, which {type(config).__name__} "
                        f"lacks; pass the Config or a {cls.__name__}")
    return cls.of(config)
