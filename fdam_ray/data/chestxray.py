"""Multi-source chest X-rays with five tasks (the paper's ChestXray-IH, s.5 "Chest X-ray datasets").

Five binary tasks as in the CheXpert competition: Cardiomegaly, Edema,
Consolidation, Atelectasis and Pleural Effusion, from up to five organisations
(CheXpert, NIH ChestX-ray14, PadChest, MIMIC-CXR-JPG, VinDr-CXR), each read
from its files as distributed (:mod:`fdam_ray.data.chestxray_readers`).

Labels. An uncertain label (-1) follows a per-task policy: ``ones``, ``zeros``
or ``ignore`` (NaN, left out of that task's loss and AUC); the default is
LibAUC's: ones for Edema and Atelectasis, zeros for the other three. A blank
(not mentioned) is negative by default (``chestxray_blank=ignore`` makes it
NaN). A task a source does not label (Edema in VinDr-CXR's Kaggle variant) is
NaN for that source, never negative. Images with no label left are skipped.

Clients. ``chestxray_clients=source``: one client per organisation (the
paper's multi-source CheXpert experiment). ``patient``: K clients, each inside
one organisation (the paper's K = 16 ChestXray-IH split: "each machine only
owns samples from one organization without overlapping patients"); an
organisation's patients are dealt into its clients' groups (seeded by
``seed``), so no patient is on two clients. Each organisation's test split is a
``chestxray_test_fraction`` of its patients (5% as in the paper), drawn with a
fixed seed so that every run, whatever its seed and whichever sources it lists,
tests on the same patients; with ``chestxray_test_split=official`` the
publisher's own test split is used where the reader has one. The clients'
test splits together are the pooled test set, so the run reports pooled,
per-client and per-task AUC.

Images: grayscale (16-bit PNGs and DICOMs scaled by their own range), resized to
``image_size`` (320 by default, as in the paper), with ``augment`` the
paper's random affine map for training, then 3 channels with ImageNet's
normalisation; ``data_workers`` DataLoader processes per client read them.

Data stays where it lives: the driver reads nothing; ``client_shard(k)`` reads
only client k's organisation's label files, and images are read lazily, batch
by batch, through a DataLoader.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fdam_ray.data.base import DatasetSplit, DataSource, Shard
from fdam_ray.data.chestxray_readers import READERS, TASKS, SourceTable, files_problem
from fdam_ray.data.images import IMAGENET_MEAN, IMAGENET_STD, LazyImages, read_gray, split_seed
from fdam_ray.data.sections import ChestXraySection
from fdam_ray.files.extras import require

log = logging.getLogger(__name__)

SOURCES = tuple(READERS)  # chexpert, nih, padchest, mimic, vindr (the paper's order of adding sources)
POLICIES = ("ones", "zeros", "ignore")
DEFAULT_IMAGE_SIZE = 320  # the paper's multi-source experiments
SPLIT_SEED = 20210718  # the held-out test patients are the same for every run seed


def task_policies(uncertain: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """One policy for every task, or one per task in the order of ``TASKS``."""
    uncertain = tuple(uncertain)
    if len(uncertain) == 1:
        uncertain = uncertain * len(TASKS)
    if len(uncertain) != len(TASKS) or any(p not in POLICIES for p in uncertain):
        raise ValueError(f"chestxray_uncertain: {list(uncertain)} must be one policy or one per task "
                         f"({', '.join(TASKS)}), each one of {', '.join(POLICIES)}")
    return uncertain


def apply_label_policy(codes: np.ndarray, present: tuple[bool, ...], uncertain: tuple[str, ...],
                       blank: str = "zeros") -> np.ndarray:
    """Raw codes (1, 0, -1, NaN = blank) -> labels (1, 0, NaN = missing) under the policies."""
    labels = np.array(codes, dtype=np.float32, copy=True)
    value = {"ones": 1.0, "zeros": 0.0, "ignore": np.nan}
    for t, policy in enumerate(task_policies(uncertain)):
        column = codes[:, t]
        if not present[t]:
            labels[:, t] = np.nan
            continue
        labels[column == -1, t] = value[policy]
        labels[np.isnan(column), t] = value[blank]
    return labels


class GrayToImageNet:
    """A grayscale (1, H, W) tensor in [0, 1] -> 3 channels normalised with ImageNet's mean and std."""

    def __init__(self) -> None:
        self.mean = torch.tensor(IMAGENET_MEAN).reshape(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).reshape(3, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x.expand(3, -1, -1) - self.mean) / self.std


def chestxray_transform(*, augment: bool) -> Callable:
    """Grayscale (1, H, W) in [0, 1] -> normalised float32 (3, H, W); with ``augment`` the paper's affine first."""
    if not augment:
        return GrayToImageNet()
    require("torchvision", "images", "chest X-ray augmentation")
    from torchvision import transforms

    affine = transforms.RandomAffine(degrees=(-15, 15), translate=(0.05, 0.1), scale=(0.95, 1.05),
                                     interpolation=transforms.InterpolationMode.BILINEAR, fill=128 / 255)
    return transforms.Compose([affine, GrayToImageNet()])


class ChestXrayImages(LazyImages):
    """Images read from disk on demand: grayscale, resized, augmented (training), 3 channels, normalised.

    The augmentation is the paper's recipe (Yuan et al.'s CheXpert training):
    a random affine map with rotation in [-15, 15] degrees, translation up to
    5% horizontally and 10% vertically, scale in [0.95, 1.05], mid-grey fill.
    It is on when ``augment_seed`` is given, and its draws are seeded as for
    every :class:`~fdam_ray.data.images.LazyImages`. The 3 channels are
    normalised with ImageNet's mean and std (for ImageNet-pretrained DenseNets).
    """

    def __init__(self, paths: np.ndarray, labels: np.ndarray, *, image_size: int,
                 augment_seed: int | None = None) -> None:
        super().__init__(torch.from_numpy(np.asarray(labels, dtype=np.float32)),
                         chestxray_transform(augment=augment_seed is not None), augment_seed=augment_seed)
        self.paths = np.asarray(paths, dtype=object)
        self.image_size = image_size

    def load(self, index: int) -> torch.Tensor:
        return torch.from_numpy(read_gray(self.paths[index], self.image_size)).unsqueeze(0)


@dataclasses.dataclass(frozen=True)
class ClientPlace:
    """Where a client sits: its organisation and its patient group there (``group`` of ``groups``)."""

    source: str
    group: int
    groups: int


def client_places(section) -> list[ClientPlace]:
    """Every client's organisation and group, from the settings alone (nothing is read)."""
    sources = tuple(section.chestxray_sources)
    per_source = section.chestxray_clients_per_source
    if section.chestxray_clients == "source":
        if per_source is not None:
            raise ValueError("chestxray_clients_per_source is for chestxray_clients=patient; with 'source' every "
                             "organisation is one client")
        counts = [1] * len(sources)
        if section.num_clients != len(sources):
            raise ValueError(f"chestxray_clients=source makes one client per source ({len(sources)}: "
                             f"{', '.join(sources)}) but num_clients={section.num_clients}; set num_clients="
                             f"{len(sources)} or chestxray_clients=patient")
    elif per_source is not None:
        counts = list(per_source)
        if len(counts) != len(sources) or min(counts) < 1 or sum(counts) != section.num_clients:
            raise ValueError(f"chestxray_clients_per_source={counts} must give each of the {len(sources)} sources "
                             f"({', '.join(sources)}) at least 1 client and sum to num_clients={section.num_clients}")
    else:
        if section.num_clients < len(sources):
            raise ValueError(f"chestxray_clients=patient puts each client inside one organisation, so num_clients="
                             f"{section.num_clients} must be at least the number of sources ({len(sources)})")
        base, extra = divmod(section.num_clients, len(sources))
        counts = [base + (i < extra) for i in range(len(sources))]
    return [ClientPlace(s, g, n) for s, n in zip(sources, counts, strict=True) for g in range(n)]


def _source_seed(name: str) -> int:
    return zlib.crc32(name.encode())


class ChestXraySource(DataSource):
    """The chest X-ray federation a :class:`ChestXraySection` describes; see the module docstring."""

    num_tasks = len(TASKS)
    task_names = TASKS

    def __init__(self, section: ChestXraySection) -> None:
        sources = tuple(section.chestxray_sources)
        if not sources:
            raise ValueError(f"chestxray_sources is empty; list some of {', '.join(SOURCES)}")
        unset = [name for name in sources if not getattr(section, f"chestxray_{name}_root")]
        if unset:
            fields = ", ".join(f"chestxray_{name}_root" for name in unset)
            raise ValueError(f"chestxray_sources lists {', '.join(repr(n) for n in unset)} but {fields} "
                             f"{'is' if len(unset) == 1 else 'are'} not set; set {'it' if len(unset) == 1 else 'each'} "
                             f"to the folder of that source's files or drop {'it' if len(unset) == 1 else 'them'} "
                             "from chestxray_sources")
        self.roots: dict[str, Path] = {name: Path(getattr(section, f"chestxray_{name}_root")).expanduser()
                                       for name in sources}
        self.places = client_places(section)
        self.num_clients = len(self.places)
        self.uncertain = task_policies(section.chestxray_uncertain)
        self.blank = section.chestxray_blank
        self.frontal_only = section.chestxray_frontal_only
        self.official_test = section.chestxray_test_split == "official"
        self.official_val = section.chestxray_val_split == "official"
        self.test_fraction = section.chestxray_test_fraction
        self.image_size = section.image_size or DEFAULT_IMAGE_SIZE
        self.augment = section.augment
        self.num_workers = section.data_workers
        self.seed = section.seed
        self.input_shape = (3, self.image_size, self.image_size)
        self.first_client = 0  # the federation's number of client 0 here (its augmentation draws are keyed by it)
        self._cache: dict[str, tuple[SourceTable, np.ndarray]] = {}

    def local_problems(self) -> list[str]:
        """Every source whose folder or label files are not where the config says, each named with what it
        lacks (read nothing; see :func:`~fdam_ray.data.rooted.check_data_here`)."""
        return [f"chestxray_{name}_root: {problem}" for name, root in self.roots.items()
                if (problem := files_problem(name, root, official_test=self.official_test)) is not None]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_cache"] = {}  # a spec travels without its data
        return state

    def table(self, name: str) -> tuple[SourceTable, np.ndarray]:
        """One organisation's images after the frontal filter, and their labels after the policies."""
        if name not in self._cache:
            raw = READERS[name](self.roots[name], official_test=self.official_test)
            labels = apply_label_policy(raw.codes, raw.present, self.uncertain, self.blank)
            keep = ~np.isnan(labels).all(axis=1)
            if self.frontal_only:
                keep &= raw.frontal
            table = SourceTable(raw.paths[keep], raw.patients[keep], raw.frontal[keep], raw.codes[keep], raw.present,
                                None if raw.official_test is None else raw.official_test[keep],
                                None if raw.official_val is None else raw.official_val[keep])
            log.info("%s: %d of %d images kept (frontal only: %s)", name, int(keep.sum()), len(raw), self.frontal_only)
            self._cache = {name: (table, labels[keep])}  # one organisation at a time in memory
        return self._cache[name]

    def client_rows(self, client_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``client_id``'s training rows and test rows in its organisation's :meth:`table`."""
        if not 0 <= client_id < self.num_clients:
            raise ValueError(f"client_id {client_id} is not in 0..{self.num_clients - 1}")
        place = self.places[client_id]
        table, _ = self.table(place.source)
        patients = table.patients.astype(str)
        unique = np.unique(patients)
        if table.official_test is not None:
            is_test = table.official_test
            test_patients = np.unique(patients[is_test])
        else:
            if len(unique) < 2:
                raise ValueError(f"{place.source}: {len(unique)} patient(s) left after filtering; a test split "
                                 "held out by patient needs at least 2")
            n_test = min(len(unique) - 1, max(1, round(self.test_fraction * len(unique))))
            rng = np.random.default_rng([SPLIT_SEED, _source_seed(place.source)])
            test_patients = rng.choice(unique, n_test, replace=False)
            is_test = np.isin(patients, test_patients)
        train_patients = np.setdiff1d(unique, test_patients)  # a test patient's other images are not trained on
        if len(train_patients) < place.groups:
            raise ValueError(f"{place.source}: {len(train_patients)} training patients cannot fill {place.groups} "
                             "clients")
        rng = np.random.default_rng([self.seed, _source_seed(place.source)])
        train_group = np.array_split(rng.permutation(train_patients), place.groups)[place.group]
        test_group = np.array_split(rng.permutation(np.unique(test_patients)), place.groups)[place.group]
        train = np.flatnonzero(np.isin(patients, train_group))
        test = np.flatnonzero(is_test & np.isin(patients, test_group))
        return train, test

    def official_val_rows(self, client_id: int, train: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """With ``chestxray_val_split=official``, a client of a source with a validation split of its own
        (MIMIC-CXR's ``validate``): its training rows without that split's, and that split's (None: no such
        split, so the client holds out ``val_fraction`` of its training rows instead)."""
        official = self.table(self.places[client_id].source)[0].official_val
        if not self.official_val or official is None:
            return train, None
        return train[~official[train]], train[official[train]]

    def _split(self, table: SourceTable, labels: np.ndarray, rows: np.ndarray, augment_seed: int | None
               ) -> DatasetSplit:
        dataset = ChestXrayImages(table.paths[rows], labels[rows], image_size=self.image_size,
                                  augment_seed=augment_seed)
        return DatasetSplit(dataset, labels[rows], num_workers=self.num_workers)

    def client_shard(self, client_id: int) -> Shard:
        train, test = self.client_rows(client_id)
        train, val = self.official_val_rows(client_id, train)
        table, labels = self.table(self.places[client_id].source)
        if len(train) == 0:
            raise ValueError(f"chest X-ray client {client_id} ({self.places[client_id].source}) has no training images")
        augment_seed = split_seed(self.seed, self.first_client + client_id) if self.augment else None
        return Shard(self._split(table, labels, train, augment_seed),
                     self._split(table, labels, test, None) if len(test) else None,
                     self._split(table, labels, val, None) if val is not None and len(val) else None,
                     groups=table.patients[train])  # a held-out validation part takes whole patients

    def test_set(self) -> None:
        return None


def organisation_source(section: ChestXraySection, client_id: int, root: str | Path) -> ChestXraySource:
    """Client ``client_id`` of a ``chestxray_clients: source`` federation on its own: organisation
    ``chestxray_sources[client_id]`` read from ``root``, on a machine that holds no other organisation's files (a
    Flower site). Its shard is the one that client has in the whole federation: the same images, test patients
    and augmentation draws."""
    sources = tuple(section.chestxray_sources)
    if section.chestxray_clients != "source":
        raise ValueError("a site reading its own organisation's images needs chestxray_clients: source (one client "
                         f"per organisation), not {section.chestxray_clients!r}")
    if not 0 <= client_id < len(sources):
        raise ValueError(f"site {client_id}: chestxray_sources lists {len(sources)} organisations "
                         f"({', '.join(sources)}), so the sites are 0..{len(sources) - 1}")
    name = sources[client_id]
    roots: dict[str, Any] = {f"chestxray_{name}_root": str(root)}
    own = dataclasses.replace(section, chestxray_sources=(name,), num_clients=1, **roots)
    source = ChestXraySource(own)
    source.first_client = client_id
    return source
