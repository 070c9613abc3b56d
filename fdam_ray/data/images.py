"""Image datasets read one sample at a time by a DataLoader (see :class:`~fdam_ray.data.base.DatasetSplit`).

:class:`ArrayImages` holds uint8 images in memory (CIFAR: 50000 x 3 x 32 x 32
bytes, a quarter of the float32 size) and converts each sample when it is
read; :class:`FileImages` holds file names and opens each image when it is
read (ImageNet-style folders); the chest X-ray dataset
(:class:`~fdam_ray.data.chestxray.ChestXrayImages`) reads grayscale files with
:func:`read_gray`. Random augmentation draws from a generator of the dataset's
own, seeded per client, so a run with ``data_workers=0`` is reproducible;
inside DataLoader worker processes it draws from the torch seed the DataLoader
gives each worker.

The readers turn a missing, truncated or undecodable file into a ValueError
that names it (:func:`read_errors`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from fdam_ray.files.extras import require

if TYPE_CHECKING:
    from PIL import Image

def _pil():  # Pillow comes with the 'images' extra; nothing else of fdam-ray needs it
    require("PIL", "images", "reading image files", "pillow")
    from PIL import Image

    return Image


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DICOM_SUFFIXES = (".dicom", ".dcm")
WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")  # PIL modes of 16-bit (and wider) grayscale


def split_seed(seed: int, client_id: int) -> int:
    """A 63-bit seed for one client's augmentation draws."""
    return int(np.random.SeedSequence([seed, 31, client_id]).generate_state(1, np.uint64)[0] >> np.uint64(1))


class LazyImages(torch.utils.data.Dataset):
    """Samples ``(transform(image i), label i)``; subclasses say how image i is loaded.

    With ``augment_seed`` every sample read in this process runs ``transform``
    under a torch seed drawn from the dataset's own generator, so its random
    draws depend on that generator alone (whose state samplers save and
    restore), not on what else used torch's global generator.
    """

    def __init__(self, labels: torch.Tensor, transform: Callable, *, augment_seed: int | None) -> None:
        self.labels = (labels.reshape(-1, 1) if labels.dim() == 1 else labels).to(torch.float32)
        self.transform = transform
        self.generator = None if augment_seed is None else torch.Generator().manual_seed(augment_seed)

    def __len__(self) -> int:
        return len(self.labels)

    def load(self, index: int):
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.load(index)
        if self.generator is not None and torch.utils.data.get_worker_info() is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                x = self.transform(image)
        else:
            x = self.transform(image)
        return x, self.labels[index]


class ArrayImages(LazyImages):
    """uint8 images (n, C, H, W) in memory; ``transform`` maps one uint8 (C, H, W) tensor to float32."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Callable, *,
                 augment_seed: int | None = None) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"ArrayImages takes uint8 images of shape (n, C, H, W), got {images.dtype} "
                             f"{tuple(images.shape)}")
        super().__init__(labels, transform, augment_seed=augment_seed)
        self.images = images

    def load(self, index: int) -> torch.Tensor:
        return self.images[index]


@contextlib.contextmanager
def read_errors(path: str, also: tuple[type[BaseException], ...] = ()):
    """Turn a missing, truncated or undecodable image file into a ValueError that names it.

    ``also``: further exception types the decoder raises for a bad file (PIL's are built in).
    """
    bad_file: tuple[type[BaseException], ...] = (OSError, SyntaxError, ValueError, *also)  # PIL: the first three
    try:
        yield
    except bad_file as exc:
        raise ValueError(f"cannot read image '{path}': {type(exc).__name__}: {exc}") from None


class FileImages(LazyImages):
    """Image files ``root/relpath`` opened as RGB PIL images; ``transform`` maps one to float32 (C, H, W)."""

    def __init__(self, root: str, relpaths: np.ndarray, labels: torch.Tensor, transform: Callable, *,
                 augment_seed: int | None = None) -> None:
        super().__init__(labels, transform, augment_seed=augment_seed)
        self.root = root
        self.relpaths = relpaths  # a numpy bytes array: compact for a million names

    def load(self, index: int) -> Image.Image:
        path = os.path.join(self.root, os.fsdecode(self.relpaths[index]))
        pil = _pil()  # outside read_errors: a missing Pillow is not a bad file
        with read_errors(path), pil.open(path) as image:
            return image.convert("RGB")


def read_gray(path: str, size: int) -> np.ndarray:
    """A grayscale image in [0, 1], resized to ``size`` x ``size``.

    8-bit images are divided by 255. 16-bit (and wider) images, such as
    PadChest's PNGs whose stored bit depth varies by scanner, and DICOM files
    (``.dicom``/``.dcm``, see :func:`read_dicom`) are scaled by their own
    minimum and maximum: converting them to 8-bit directly would clip nearly
    every pixel to white.
    """
    if path.lower().endswith(DICOM_SUFFIXES):
        return _scaled(read_dicom(path), size)
    pil = _pil()  # outside read_errors: a missing Pillow is not a bad file
    with read_errors(path), pil.open(path) as img:
        if img.mode in WIDE_MODES:
            return _scaled(np.array(img, dtype=np.float32), size)
        img.draft("L", (size, size))  # JPEG: decode at a reduced scale when the image is much larger
        small = img.convert("L").resize((size, size), pil.Resampling.BILINEAR)
        return np.array(small, dtype=np.float32) / 255.0


def _scaled(a: np.ndarray, size: int) -> np.ndarray:
    lo, hi = float(a.min()), float(a.max())
    a = (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
    return np.array(_pil().fromarray(a).resize((size, size), _pil().Resampling.BILINEAR), dtype=np.float32)


def read_dicom(path: str) -> np.ndarray:
    """A DICOM image's pixels as float32 with bright meaning dense (bone white).

    The modality LUT (RescaleSlope / RescaleIntercept) is applied and
    MONOCHROME1 images, stored with low values bright, are inverted; the caller
    then scales by the image's own range as for 16-bit PNGs. Compressed
    transfer syntaxes need the decoder pydicom names in its message.
    """
    import pydicom
    from pydicom.pixels import apply_modality_lut

    with read_errors(path, (pydicom.errors.InvalidDicomError, AttributeError, RuntimeError, NotImplementedError,
                            KeyError)):
        ds = pydicom.dcmread(path)
        a = np.asarray(apply_modality_lut(ds.pixel_array, ds), dtype=np.float32)
    if a.ndim != 2:
        raise ValueError(f"cannot read image '{path}': expected one grayscale frame, got pixel shape {a.shape}")
    if ds.get("PhotometricInterpretation", "MONOCHROME2") == "MONOCHROME1":
        a = a.max() - a
    return a


def cifar_transform(mean: tuple[float, ...], std: tuple[float, ...], *, augment: bool) -> Callable:
    """uint8 (3, 32, 32) -> normalised float32; with ``augment`` a 4-pixel padded random crop and a flip."""
    require("torchvision", "images", "CIFAR's transforms")
    from torchvision.transforms import v2

    steps = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()] if augment else []
    return v2.Compose([*steps, v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def folder_transform(size: int, *, augment: bool) -> Callable:
    """PIL image -> normalised float32 (3, size, size).

    Evaluation (and training without ``augment``): resize the short side to
    size / 0.875, centre crop. With ``augment``: random resized crop and flip.
    """
    require("torchvision", "images", "image folders' transforms")
    from torchvision import transforms as T

    if augment:
        steps = [T.RandomResizedCrop(size), T.RandomHorizontalFlip()]
    else:
        steps = [T.Resize(round(size / 0.875)), T.CenterCrop(size)]
    return T.Compose([*steps, T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
