"""ImageNet-style folders: ``data_root/train/<class>/<image>`` and ``data_root/val/<class>/<image>``.

Classes are numbered by their sorted folder names, as torchvision's
``ImageFolder`` numbers them, or by their place in ``class_names`` when it is
given; ``positive_classes`` / ``negative_classes`` take those numbers. With
``client_data_roots`` every client numbers its folder's classes by one list,
fixed on the driver (:meth:`ImageFolderSource.shared_section`): a site that
lacks a class keeps every other class's number, and says what it lacks (a
warning), so a class number means the same class on every site. By default
the classes are split half/half at random with a fixed seed, so every run seed
sees the same task (the paper's ImageNet-IH picks 500 of the 1000 classes as
positive, Sec. 5). The IH or Dirichlet partition
then works as for CIFAR; the ``val`` images are the test set, untouched.

Images are opened one at a time by the DataLoader: resized so the short side
is image_size / 0.875 and centre-cropped to ``image_size`` (224 by default),
or, for training with ``augment``, randomly resized, cropped and flipped.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np

from fdam_ray.data.base import DatasetSplit
from fdam_ray.data.images import FileImages, folder_transform, split_seed
from fdam_ray.data.pooled import ClassPoolSource
from fdam_ray.data.sections import DataSection
from fdam_ray.files.extras import require

log = logging.getLogger(__name__)

CLASS_SPLIT_SEED = 20210301
DEFAULT_IMAGE_SIZE = 224


def _class_folders(folder: str) -> list[str]:
    """The class folder names in ``folder``, sorted (torchvision's rule: every sub-folder is a class)."""
    require("torchvision", "images", "dataset imagefolder")
    from torchvision.datasets.folder import find_classes

    try:
        return list(find_classes(folder)[0])
    except FileNotFoundError as exc:
        raise ValueError(f"dataset=imagefolder: {exc}") from None


class ImageFolderSource(ClassPoolSource):
    @classmethod
    def root_problem(cls, section: DataSection, root: str) -> str | None:
        problem = super().root_problem(section, root)
        if problem is not None:
            return problem
        lacks = [part for part in ("train", "val") if not os.path.isdir(os.path.join(os.path.expanduser(root), part))]
        return f"has no {' or '.join(p + '/' for p in lacks)} folder (it must hold train/<class>/ and val/<class>/)" \
            if lacks else None

    @classmethod
    def shared_section(cls, section: DataSection, roots: tuple[str, ...]) -> DataSection:
        """One class list for every client: ``class_names`` if given, else the class folders of data_root's
        train/ and of every client folder found here, sorted (a client whose folder has a class outside it is
        refused where it runs, asking for ``class_names``)."""
        if section.class_names is not None:
            return section
        folders = [section.data_root or "", *roots]
        names: set[str] = set()
        for folder in folders:
            train = os.path.join(os.path.expanduser(folder), "train")
            if os.path.isdir(train):
                names.update(_class_folders(train))
        return dataclasses.replace(section, class_names=tuple(sorted(names))) if names else section

    def __init__(self, section: DataSection) -> None:
        super().__init__(section)
        if section.data_root is None:
            raise ValueError("dataset=imagefolder needs data_root: the folder that holds train/<class>/ and "
                             "val/<class>/")
        self.root = os.path.normpath(os.path.expanduser(section.data_root))
        for part in ("train", "val"):
            if not os.path.isdir(os.path.join(self.root, part)):
                raise ValueError(f"dataset=imagefolder: '{os.path.join(self.root, part)}' is not a folder; "
                                 f"data_root must hold {part}/<class>/<image files>")
        self.given_classes = section.class_names is not None  # given, or fixed for every client (shared_section)
        self.class_names = tuple(section.class_names or _class_folders(os.path.join(self.root, "train")))
        n = len(self.class_names)
        if not section.positive_classes:
            if self.negative_classes is not None:
                self.positive_classes = tuple(c for c in range(n) if c not in self.negative_classes)
            else:
                order = np.random.default_rng(CLASS_SPLIT_SEED).permutation(n)
                self.positive_classes = tuple(sorted(order[: n // 2].tolist()))
        self.image_size = section.image_size or DEFAULT_IMAGE_SIZE
        self.input_shape = (3, self.image_size, self.image_size)
        self.augment = section.augment
        self.num_workers = section.data_workers

    def _check_classes(self, classes: np.ndarray, part: str) -> None:
        """Listed classes are numbers of the class list (a folder may lack some: :meth:`_scan` warns)."""
        n = len(self.class_names)
        for name, listed in (("positive_classes", self.positive_classes),
                             ("negative_classes", self.negative_classes or ())):
            unknown = sorted(c for c in set(listed) if not 0 <= c < n)
            if unknown:
                raise ValueError(f"{name}: classes {unknown} are not among the {n} classes of imagefolder "
                                 f"(numbered 0..{n - 1}: {', '.join(self.class_names[:4])}"
                                 f"{', ...' if n > 4 else ''})")

    def _scan(self, part: str) -> tuple[np.ndarray, np.ndarray]:
        require("torchvision", "images", "dataset imagefolder")
        from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

        folder = os.path.join(self.root, part)
        index = {name: i for i, name in enumerate(self.class_names)}
        names = _class_folders(folder) if part != "train" or self.given_classes else list(self.class_names)
        extra = sorted(set(names) - set(index))
        if extra:
            if self.given_classes:
                raise ValueError(f"dataset=imagefolder: '{folder}' has classes outside the class list "
                                 f"({len(index)} classes: class_names, or the union of the folders found on the "
                                 f"driver): {extra[:5]}; list every class of every site in class_names")
            raise ValueError(f"dataset=imagefolder: '{folder}' has classes that train/ lacks: {extra[:5]}")
        missing = [name for name in self.class_names if name not in set(names)]
        if missing:
            log.warning("imagefolder: %s has %d of the %d classes; it lacks %s%s (the others keep their numbers)",
                        folder, len(names), len(index), ", ".join(f"{name} (class {index[name]})"
                                                                  for name in missing[:8]),
                        f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        try:
            samples = make_dataset(folder, {name: index[name] for name in names}, extensions=IMG_EXTENSIONS)
        except FileNotFoundError as exc:
            raise ValueError(f"dataset=imagefolder: {exc}") from None
        relpaths = np.array([os.fsencode(os.path.relpath(path, self.root)) for path, _ in samples])
        return relpaths, np.array([c for _, c in samples], dtype=np.int64)

    def load_pool(self):
        """Relative file names (bytes) and class numbers of the train and val images."""
        return (*self._scan("train"), *self._scan("val"))

    def load_test(self):
        return self._scan("val")

    def make_split(self, x: np.ndarray, classes: np.ndarray, *, client_id: int | None) -> DatasetSplit:
        labels = self.binary_labels(classes)
        augment = self.augment and client_id is not None
        augment_seed = split_seed(self.seed, client_id) if augment and client_id is not None else None
        dataset = FileImages(self.root, x, labels, folder_transform(self.image_size, augment=augment),
                             augment_seed=augment_seed)
        return DatasetSplit(dataset, labels.numpy(), num_workers=self.num_workers)
