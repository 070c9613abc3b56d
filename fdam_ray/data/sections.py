"""What the data sources read of a config: typed sections (see :mod:`fdam_ray.settings.sections`).

A source's constructor takes its dataset's section, not the whole config, so
what a dataset depends on is visible in one place and a client's data spec
carries nothing else. :class:`DataSection` holds the fields the data sources
share; a dataset with settings of its own has a subclass that adds them.
:func:`data_section` cuts the right one for the dataset a config names.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from fdam_ray.settings.factories import is_import_path
from fdam_ray.settings.sections import (
    AT_LEAST_ONE,
    EACH_ONCE,
    FRACTION,
    NONNEGATIVE,
    POSITIVE,
    Section,
    fail,
    owned_fields,
    setting,
    shared,
    warn_once,
)

log = logging.getLogger(__name__)

# "arrays" and "datasets" are set by fdam_ray.train_arrays / train_datasets (bring-your-own data), not by hand.
DATASET_NAMES = ("digits", "synthetic", "arrays", "cifar10", "cifar100", "imagefolder", "mnist5k", "chestxray",
                 "datasets")
CHESTXRAY_SOURCES = ("chexpert", "nih", "padchest", "mimic", "vindr")
# The datasets whose source splits a pool of classes over the clients with `partition` (ih or dirichlet).
PARTITIONED = ("digits", "mnist5k", "cifar10", "cifar100", "imagefolder")
# The datasets whose source reads its samples from the folder data_root, so that client_data_roots can give
# each client a folder of its own. Any other dataset (digits and mnist5k are bundled, synthetic is drawn, your
# own factory is called with a client number, never a folder) would give every client the same data.
READS_DATA_ROOT = ("cifar10", "cifar100", "imagefolder")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection(Section):
    """The data fields read by digits, mnist5k, cifar10/100 and imagefolder (and, in part, by every source)."""

    name = "data"

    dataset: str = setting("digits", "Dataset name, or your own factory module:attr called on each client as "
                           "factory(client_id, num_clients, split) -> torch Dataset of (x, y) items, split 'train' "
                           "or 'test' (None: no test split).", kind="factory", choices=DATASET_NAMES)
    data_root: str | None = setting(None, "Folder of an on-disk dataset.")
    partition: str = setting("ih", "How a labelled dataset is split over clients: ih (class-disjoint, the paper's) "
                             "or dirichlet.", choices=("ih", "dirichlet"))
    imratio: float = setting(0.1, "Positive fraction kept on each client (IH and Dirichlet partitions).",
                             check=lambda v: 0 < v <= 0.5, allowed="in (0, 0.5]", aliases=("imbalance_ratio",))
    dirichlet_concentration: float = setting(0.5, "Dirichlet concentration per class over clients (smaller = more "
                                             "heterogeneous).", check=POSITIVE)
    positive_classes: tuple[int, ...] | None = setting(None, "Original classes labelled positive; null = dataset "
                                                       "default.")
    negative_classes: tuple[int, ...] | None = setting(None, "Original classes labelled negative; null = every "
                                                       "class that is not positive (classes in neither list are "
                                                       "left out).")
    test_fraction: float = setting(0.3, "Held-out fraction for datasets without a test split (digits).",
                                   check=FRACTION)
    image_size: int | None = setting(None, "Side of the square images a loader resizes to; null = the dataset's "
                                     "default (imagefolder 224, chestxray 320).", check=AT_LEAST_ONE)
    augment: bool = setting(False, "Random augmentation of training images (cifar: padded crop and flip; "
                            "imagefolder: resized crop and flip; chestxray: the paper's random affine).")
    data_workers: int | str = setting(0, "DataLoader worker processes per client for datasets read from disk; auto "
                                      "= the CPUs Ray gave the client (the CPUs of this process inline) less one, "
                                      "at most 8.", check=NONNEGATIVE, allowed=">= 0 or 'auto'", resume=True)
    download: bool = setting(False, "cifar10/cifar100: fetch the official archive into data_root when its files "
                             "are missing (torchvision); off = read local files only.")
    client_data_roots: tuple[str, ...] | None = setting(None, "A data folder per client, in client order: client k "
                                                        "reads its training data (all of it) from its own folder "
                                                        "only, on the node it runs on; data_root then holds the "
                                                        "global test set; null = every client takes its part of "
                                                        "data_root.")
    class_names: tuple[str, ...] | None = setting(None, "imagefolder: the class folder names in class order "
                                                  "(positive_classes and negative_classes number them); null = "
                                                  "the class folders of data_root's train/ and, with "
                                                  "client_data_roots, of every client folder found here, sorted.",
                                                  check=lambda v: len(v) > 0 and len(set(v)) == len(v),
                                                  allowed="a non-empty list of distinct folder names")
    num_clients: int = shared()
    seed: int = shared()

    def check(self) -> None:
        self._check_roots()
        unused = []
        if self.partition != "dirichlet" and self.dirichlet_concentration != 0.5:
            unused.append(("dirichlet_concentration", f"partition = {self.partition}"))
        if self.partition != "ih" and self.dataset not in PARTITIONED:
            unused.append(("partition", f"dataset = {self.dataset}, which is not split from a pool of classes"))
        if self.download and self.dataset not in ("cifar10", "cifar100"):
            unused.append(("download", f"dataset = {self.dataset} (it fetches cifar10/cifar100 only)"))
        for name, why in unused:
            warn_unused(name, getattr(self, name), why)

    def _check_roots(self) -> None:
        roots = self.client_data_roots
        if roots is None:
            return
        if len(roots) != self.num_clients:
            raise fail("client_data_roots", short_list(roots),
                       f"one entry per client: {self.num_clients} (num_clients), not {len(roots)}")
        refused = roots_refusal(self.dataset)
        if refused:
            raise fail("client_data_roots", short_list(roots, shown=1, width=40), refused)


def warn_unused(name: str, value: Any, why: str) -> None:
    """One warning for a field set to other than its default that the run does not read (``why``): a config
    shared by several datasets may mean it; more often the other field was meant to be set too."""
    shown = value if not isinstance(value, (tuple, list)) else short_list(tuple(map(str, value)))
    warn_once(log, f"config field '{name}' = {shown} has no effect with {why}; remove it or change that field")


def _warn_if_not(section: DataSection, dataset: str) -> None:
    """Warn once for each field ``section``'s class owns and sets when the run's dataset is not ``dataset``."""
    if section.dataset == dataset:
        return
    for f in owned_fields(type(section)):
        value = getattr(section, f.name)
        if value != f.default:
            warn_unused(f.name, value, f"dataset = {section.dataset} (only dataset {dataset} reads it)")


def short_list(values: tuple[str, ...], *, shown: int = 2, width: int = 60) -> str:
    """A list of texts shortened for a one-line message: the first ``shown``, each cut to ``width`` characters,
    and how many there are."""
    cut = [v if len(v) <= width else v[: width - 3] + "..." for v in map(str, values[:shown])]
    more = f", ... ({len(values)} in all)" if len(values) > shown else ""
    return "[" + ", ".join(cut) + more + "]"


def roots_refusal(dataset: str) -> str | None:
    """Why ``client_data_roots`` cannot be used with ``dataset`` (None: its source reads data_root, so a folder
    per client gives each client its own data). A dataset that does not read data_root would give every client
    the same data: refused, never ignored."""
    if dataset == "chestxray":
        return "per-client folders of a dataset read from data_root; dataset=chestxray has per-source roots " \
               "(chestxray_*_root)"
    if dataset in ("arrays", "datasets"):
        return f"per-client folders of a dataset read from data_root; dataset={dataset} takes its data in memory"
    if dataset in READS_DATA_ROOT:
        return None
    rooted = ", ".join(READS_DATA_ROOT)
    if is_import_path(dataset):
        return (f"dataset '{dataset}' is your own factory, called as factory(client_id, num_clients, split), and "
                "reads no data folder, so every client would get the same data: build client k's data from "
                "client_id in the factory and remove client_data_roots")
    return (f"dataset={dataset} reads no data folder, so every client would train on the same whole dataset; "
            f"per-client folders work with {rooted}: remove client_data_roots or use one of those")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticSection(DataSection):
    """``dataset: synthetic``: the Gaussian mixtures' size and heterogeneity as well."""

    name = "synthetic"

    heterogeneity: float = setting(1.0, "Synthetic data: spread of each client's class-centre shift.",
                                   check=NONNEGATIVE)
    num_features: int = setting(20, "Synthetic data: feature dimension.", check=AT_LEAST_ONE)
    samples_per_client: int = setting(500, "Synthetic data: training samples per client.", check=AT_LEAST_ONE)

    def check(self) -> None:
        _warn_if_not(self, "synthetic")  # (DataSection's own rules run on its own cut of the config)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChestXraySection(DataSection):
    """``dataset: chestxray``: the organisations, their folders, the client layout, splits and label policies."""

    name = "chestxray"

    chestxray_sources: tuple[str, ...] = setting(CHESTXRAY_SOURCES, "chestxray: the organisations, in client order "
                                                 "(a list, or names joined by commas).", choices=CHESTXRAY_SOURCES,
                                                 check=EACH_ONCE, allowed="each source once")
    chestxray_chexpert_root: str | None = setting(None, "chestxray: folder with CheXpert's train.csv, valid.csv, "
                                                  "train/.")
    chestxray_nih_root: str | None = setting(None, "chestxray: folder with NIH's Data_Entry_2017*.csv and "
                                             "images*/.")
    chestxray_padchest_root: str | None = setting(None, "chestxray: folder with PadChest's labels CSV and numbered "
                                                  "image folders.")
    chestxray_mimic_root: str | None = setting(None, "chestxray: folder with MIMIC-CXR-JPG's "
                                               "mimic-cxr-2.0.0-*.csv.gz and files/.")
    chestxray_vindr_root: str | None = setting(None, "chestxray: folder with VinDr-CXR's image_labels_train.csv "
                                               "(or Kaggle train.csv) and train/ images as PNG/JPEG.")
    chestxray_clients: str = setting("source", "chestxray: source = one client per organisation; patient = "
                                     "num_clients clients, each a patient group inside one organisation.",
                                     choices=("source", "patient"))
    chestxray_clients_per_source: tuple[int, ...] | None = setting(None, "chestxray, clients=patient: clients per "
                                                                   "source in chestxray_sources order (sum = "
                                                                   "num_clients); null = as even as possible.")
    chestxray_test_fraction: float = setting(0.05, "chestxray: fraction of each organisation's patients held out "
                                             "as its test split (fixed seed: the same patients for every run).",
                                             check=FRACTION)
    chestxray_test_split: str = setting("holdout", "chestxray: holdout (by patient) or official (CheXpert "
                                        "valid.csv, MIMIC's test split, NIH test_list.txt; others fall back to "
                                        "holdout).", choices=("holdout", "official"))
    chestxray_val_split: str = setting("holdout", "chestxray, with val_fraction > 0: holdout (val_fraction of "
                                       "each client's training images) or official (MIMIC-CXR's validate split "
                                       "for MIMIC clients; others fall back to holdout).",
                                       choices=("holdout", "official"))
    chestxray_uncertain: tuple[str, ...] = setting(("zeros", "ones", "zeros", "ones", "zeros"), "chestxray: "
                                                   "uncertain (-1) labels per task (Cardiomegaly, Edema, "
                                                   "Consolidation, Atelectasis, Pleural Effusion), or one for all: "
                                                   "ones, zeros or ignore (missing).",
                                                   choices=("ones", "zeros", "ignore"),
                                                   check=lambda v: len(v) in (1, 5), allowed="1 or 5 policies")
    chestxray_blank: str = setting("zeros", "chestxray: blank (not mentioned) labels: zeros (negative) or ignore "
                                   "(missing).", choices=("zeros", "ignore"))
    chestxray_frontal_only: bool = setting(True, "chestxray: keep frontal (PA/AP) views only.")

    def check(self) -> None:
        _warn_if_not(self, "chestxray")  # (DataSection's own rules run on its own cut of the config)


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
    has = {f.name for f in dataclasses.fields(config)}
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in has]
    if missing:
        raise TypeError(f"dataset={config.dataset} reads {', '.join(missing)}, which {type(config).__name__} "
                        f"lacks; pass the Config or a {cls.__name__}")
    return cls.of(config)
