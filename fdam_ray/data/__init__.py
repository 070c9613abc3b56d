"""Datasets, partitions and samplers (torch, numpy and scikit-learn only); each source takes a typed section."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fdam_ray.data.base import (
    AnySplit,
    DatasetSplit,
    DataSource,
    LoaderSampler,
    Shard,
    Split,
    TensorSampler,
    as_labels,
    iter_batches,
    make_sampler,
)
from fdam_ray.data.sections import ChestXraySection, DataSection, SyntheticSection, data_section
from fdam_ray.factories import is_import_path

if TYPE_CHECKING:
    from fdam_ray.config import Config

__all__ = ["AnySplit", "ChestXraySection", "DataSection", "DataSource", "DatasetSplit", "LoaderSampler", "Shard",
           "Split", "SyntheticSection", "TensorSampler", "as_labels", "data_section", "iter_batches", "make_sampler",
           "make_source"]


def make_source(config: Config | DataSection) -> DataSource:
    """The data source a config names (``arrays`` is made by :func:`fdam_ray.train_arrays`).

    ``config`` is a :class:`~fdam_ray.config.Config` or a section holding the
    dataset's fields; the source is given its dataset's section alone (see
    :mod:`fdam_ray.data.sections`).
    """
    if config.dataset == "arrays":
        raise ValueError("dataset 'arrays' takes in-memory data: call fdam_ray.train_arrays(config, clients, test)")
    if config.dataset == "datasets":
        raise ValueError("dataset 'datasets' takes your own Datasets: call fdam_ray.train_datasets(config, clients, "
                         "test)")
    section = data_section(config)
    roots = getattr(config, "client_data_roots", None)
    if roots:
        from fdam_ray.data.rooted import PerClientRoots

        if section.data_root is None:
            raise ValueError("client_data_roots needs data_root as well: the folder of the global test set")
        return PerClientRoots(_source_of, section, roots)
    return _source_of(section)


def _source_of(section: DataSection) -> DataSource:
    """The source of the dataset ``section`` names."""
    if is_import_path(section.dataset):
        from fdam_ray.data.datasets import FactorySource

        return FactorySource(section)
    if section.dataset == "digits":
        from fdam_ray.data.digits import DigitsSource

        return DigitsSource(section)
    if isinstance(section, SyntheticSection):
        from fdam_ray.data.synthetic import SyntheticSource

        return SyntheticSource(section)
    if section.dataset in ("cifar10", "cifar100"):
        from fdam_ray.data.cifar import Cifar10Source, Cifar100Source

        return Cifar10Source(section) if section.dataset == "cifar10" else Cifar100Source(section)
    if section.dataset == "imagefolder":
        from fdam_ray.data.imagefolder import ImageFolderSource

        return ImageFolderSource(section)
    if section.dataset == "mnist5k":
        from fdam_ray.data.mnist5k import Mnist5kSource

        return Mnist5kSource(section)
    if isinstance(section, ChestXraySection):
        from fdam_ray.data.chestxray import ChestXraySource

        return ChestXraySource(section)
    raise ValueError(f"dataset {section.dataset!r} has no loader")
