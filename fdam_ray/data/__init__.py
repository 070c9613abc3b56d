"""Datasets, partitions and samplers (torch, numpy and scikit-learn only); each source takes a typed section."""

from __future__ import annotations

from fdam_ray.data.balanced import make_sampler
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
)
from fdam_ray.data.sections import ChestXraySection, DataSection, SyntheticSection, data_section, roots_refusal
from fdam_ray.settings.factories import is_import_path

__all__ = ["AnySplit", "ChestXraySection", "DataSection", "DataSource", "DatasetSplit", "LoaderSampler", "Shard",
           "Split", "SyntheticSection", "TensorSampler", "as_labels", "data_section", "iter_batches", "make_sampler",
           "make_source", "source_class"]


def make_source(config: DataSection, *, executor: str = "inline", address: str | None = None,
                ) -> DataSource:
    """The data source a config names (``arrays`` is made by :func:`fdam_ray.train_arrays`).

    ``config`` is a section holding the dataset's fields (the run's whole
    config is one: it holds every section); the source is given its dataset's section alone (see
    :mod:`fdam_ray.data.sections`). With ``client_data_roots`` the folders are
    checked here, on the driver, when the clients run on this machine (every
    bad folder named in one line): ``executor`` and ``address`` are the run's
    (:func:`~fdam_ray.data.rooted.clients_run_here`; a run's assembly passes its
    config's).
    """
    if config.dataset == "arrays":
        raise ValueError("dataset 'arrays' takes in-memory data: train with fdam_ray.train_arrays(config, clients, "
                         "test); resume such a run from Python with the same arrays, fdam_ray.resume(run_dir, "
                         "source=fdam_ray.data.arrays.ArraysSource(clients, test, client_tests))")
    if config.dataset == "datasets":
        raise ValueError("dataset 'datasets' takes your own Datasets: train with fdam_ray.train_datasets(config, "
                         "clients, test); resume such a run from Python with the same Datasets, fdam_ray.resume("
                         "run_dir, source=fdam_ray.data.datasets.DatasetsSource(clients, test, client_tests))")
    section = data_section(config)
    roots = section.client_data_roots
    if roots:
        from fdam_ray.data.rooted import PerClientRoots, check_roots, clients_run_here

        refused = roots_refusal(section.dataset)
        if refused:
            raise ValueError(f"client_data_roots: {refused}")
        if section.data_root is None:
            raise ValueError("client_data_roots needs data_root as well: the folder of the global test set")
        cls = source_class(section.dataset)
        if clients_run_here(executor, address):
            check_roots(cls, section, roots)
        return PerClientRoots(_source_of, cls.shared_section(section, tuple(roots)), roots)
    return _source_of(section)




def source_class(dataset: str) -> type[DataSource]:
    """The class of the source of ``dataset`` (a name, or your own factory's import path)."""
    if is_import_path(dataset):
        from fdam_ray.data.datasets import FactorySource

        return FactorySource
    if dataset == "digits":
        from fdam_ray.data.digits import DigitsSource

        return DigitsSource
    if dataset == "synthetic":
        from fdam_ray.data.synthetic import SyntheticSource

        return SyntheticSource
    if dataset in ("cifar10", "cifar100"):
        from fdam_ray.data.cifar import Cifar10Source, Cifar100Source

        return Cifar10Source if dataset == "cifar10" else Cifar100Source
    if dataset == "imagefolder":
        from fdam_ray.data.imagefolder import ImageFolderSource

        return ImageFolderSource
    if dataset == "mnist5k":
        from fdam_ray.data.mnist5k import Mnist5kSource

        return Mnist5kSource
    if dataset == "chestxray":
        from fdam_ray.data.chestxray import ChestXraySource

        return ChestXraySource
    raise ValueError(f"dataset {dataset!r} has no loader")


def _source_of(section: DataSection) -> DataSource:
    """The source of the dataset ``section`` names."""
    return source_class(section.dataset)(section)  # type: ignore[call-arg]

