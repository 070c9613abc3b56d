"""Datasets, partitions and samplers (torch, numpy and scikit-learn only)."""

from __future__ import annotations

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

__all__ = ["AnySplit", "DataSource", "DatasetSplit", "LoaderSampler", "Shard", "Split", "TensorSampler",
           "as_labels", "iter_batches", "make_sampler", "make_source"]


def make_source(config) -> DataSource:
    """The data source a config names (``arrays`` is made by :func:`fdam_ray.train_arrays`)."""
    if config.dataset == "digits":
        from fdam_ray.data.digits import DigitsSource

        return DigitsSource(config)
    if config.dataset == "synthetic":
        from fdam_ray.data.synthetic import SyntheticSource

        return SyntheticSource(config)
    if config.dataset in ("cifar10", "cifar100"):
        from fdam_ray.data.cifar import Cifar10Source, Cifar100Source

        return Cifar10Source(config) if config.dataset == "cifar10" else Cifar100Source(config)
    if config.dataset == "imagefolder":
        from fdam_ray.data.imagefolder import ImageFolderSource

        return ImageFolderSource(config)
    if config.dataset == "mnist5k":
        from fdam_ray.data.mnist5k import Mnist5kSource

        return Mnist5kSource(config)
    if config.dataset == "chestxray":
        from fdam_ray.data.chestxray import ChestXraySource

        return ChestXraySource(config)
    if config.dataset == "arrays":
        raise ValueError("dataset 'arrays' takes in-memory data: call fdam_ray.train_arrays(config, clients, test)")
    raise ValueError(f"dataset {config.dataset!r} has no loader")
