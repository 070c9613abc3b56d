"""Readers for the five chest X-ray sources, each reading the files as its publisher distributes them.

Every reader takes the source's root folder and returns a :class:`SourceTable`:
one row per image with its absolute path, its patient id, a frontal flag and
the raw label codes of the five tasks (1 positive, 0 negative, -1 uncertain,
NaN blank, i.e. not mentioned). A task the source does not label at all is
marked absent (its labels become NaN, "missing", never negative). Readers
touch only their own source's files; the labels policy, the frontal filter
and the splits are applied by :mod:`fdam_ray.data.chestxray`.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import pandas as pd

from fdam_ray.data.base import MissingExtraError
from fdam_ray.data.images import DICOM_SUFFIXES
from fdam_ray.files.extras import extra_hint

log = logging.getLogger(__name__)

TASKS = ("Cardiomegaly", "Edema", "Consolidation", "Atelectasis", "Pleural Effusion")

# The NIH ChestX-ray14 names of the five tasks, and every finding name its Data_Entry file uses.
NIH_TASKS = ("Cardiomegaly", "Edema", "Consolidation", "Atelectasis", "Effusion")
NIH_FINDINGS = frozenset({
    "Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Effusion", "Emphysema", "Fibrosis", "Hernia",
    "Infiltration", "Mass", "No Finding", "Nodule", "Pleural_Thickening", "Pneumonia", "Pneumothorax",
})

# PadChest terms per task, matched exactly (after stripping spaces): "pericardial effusion" is not a
# pleural effusion. Atelectasis includes its subtypes in the PadChest hierarchy.
PADCHEST_TERMS: dict[str, frozenset[str]] = {
    "Cardiomegaly": frozenset({"cardiomegaly"}),
    "Edema": frozenset({"pulmonary edema"}),
    "Consolidation": frozenset({"consolidation"}),
    "Atelectasis": frozenset({"atelectasis", "laminar atelectasis", "lobar atelectasis", "segmental atelectasis",
                              "round atelectasis", "total atelectasis", "atelectasis basal"}),
    "Pleural Effusion": frozenset({"pleural effusion", "loculated pleural effusion"}),
}
PADCHEST_FRONTAL = frozenset({"PA", "AP", "AP_horizontal"})

# VinDr-CXR column / class names of the tasks, compared case-insensitively ("Pleural effusion").
VINDR_KAGGLE_CLASSES = frozenset({
    "aortic enlargement", "atelectasis", "calcification", "cardiomegaly", "consolidation", "ild", "infiltration",
    "lung opacity", "nodule/mass", "other lesion", "pleural effusion", "pleural thickening", "pneumothorax",
    "pulmonary fibrosis", "no finding",
})

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclasses.dataclass
class SourceTable:
    """One source's images: paths, patients, frontal flags, raw label codes and tasks present."""

    paths: np.ndarray  # (n,) object array of absolute file paths
    patients: np.ndarray  # (n,) object array of patient ids
    frontal: np.ndarray  # (n,) bool
    codes: np.ndarray  # (n, 5) float32: 1, 0, -1 (uncertain), NaN (blank)
    present: tuple[bool, ...]  # per task: does the source label it at all
    official_test: np.ndarray | None = None  # (n,) bool: the publisher's own test split, if read
    official_val: np.ndarray | None = None  # (n,) bool: the publisher's own validation split, where it has one

    def __len__(self) -> int:
        return len(self.paths)


def _read_csv(path: Path, needed: tuple[str, ...] | list[str], what: str) -> pd.DataFrame:
    """Read a CSV (plain or .gz) as strings, blanks kept as '', after checking the columns exist."""
    header = pd.read_csv(path, nrows=0).columns
    missing = [c for c in needed if c not in header]
    if missing:
        raise ValueError(f"{path}: {what} file lacks column(s) {missing}; its columns are {list(header)}")
    return pd.read_csv(path, usecols=list(needed), dtype=str, keep_default_na=False)


def _one_of(root: Path, names: tuple[str, ...], what: str) -> Path:
    for name in names:
        if (root / name).is_file():
            return root / name
    raise ValueError(f"{what}: none of {', '.join(names)} is in '{root}'")


def parse_codes(values: pd.Series, path: Path, column: str) -> np.ndarray:
    """Labels 1, 0, -1 or blank ('1.0', '0', '-1.0', '') as float32 codes, blank = NaN; anything else fails."""
    text = values.str.strip()
    blank = (text == "").to_numpy()
    number = pd.to_numeric(text.where(~blank), errors="coerce").to_numpy(dtype=np.float64)
    bad = ~blank & ~np.isin(number, (1.0, 0.0, -1.0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{path}: line {i + 2}, column '{column}': label {values.iloc[i]!r} is not 1, 0, -1 "
                         "(uncertain) or blank")
    return np.where(blank, np.nan, number).astype(np.float32)


def _check_first_image(paths: np.ndarray, source: str, layout: str) -> None:
    if len(paths) and not os.path.isfile(paths[0]):
        raise ValueError(f"{source}: image '{paths[0]}' listed in the labels is not on disk; expected {layout}")


def _image_index(folders: list[Path]) -> dict[str, str]:
    """File name -> path for every file directly in ``folders`` (first one wins)."""
    index: dict[str, str] = {}
    for folder in folders:
        if folder.is_dir():
            with os.scandir(folder) as entries:
                for e in entries:
                    if e.is_file():
                        index.setdefault(e.name, e.path)
    return index


def read_chexpert(root: Path, *, official_test: bool = False) -> SourceTable:
    """CheXpert (v1.0 or v1.0-small) as distributed by Stanford.

    Layout: ``root/train.csv``, ``root/valid.csv``, ``root/train/patientNNNNN/studyM/viewK_frontal.jpg``
    (and ``valid/``). The CSVs hold Path, Sex, Age, Frontal/Lateral, AP/PA and 14
    findings with 1.0, 0.0, -1.0 (uncertain) or blank; Path starts with
    ``CheXpert-v1.0-small/`` or ``CheXpert-v1.0/``, stripped to be relative to
    ``root``. The patient id is the ``patientNNNNN`` folder. ``train.csv`` only,
    unless ``official_test``: then ``valid.csv`` is read too and is the test split.
    """
    files = [root / "train.csv"] + ([root / "valid.csv"] if official_test else [])
    parts = []
    for path in files:
        if not path.is_file():
            raise ValueError(f"CheXpert: '{path}' does not exist; chestxray_chexpert_root must be the folder that "
                             "holds train.csv, valid.csv, train/ and valid/ (e.g. .../CheXpert-v1.0-small)")
        df = _read_csv(path, ("Path", "Frontal/Lateral", *TASKS), "CheXpert labels")
        rel = df["Path"].str.replace(r"^CheXpert-v1\.0(-small)?/", "", regex=True)
        patient = rel.str.extract(r"(patient\d+)", expand=False)
        if patient.isna().any():
            i = int(np.flatnonzero(patient.isna().to_numpy())[0])
            raise ValueError(f"{path}: line {i + 2}, column 'Path': {df['Path'].iloc[i]!r} has no patientNNNNN folder")
        codes = np.stack([parse_codes(df[t], path, t) for t in TASKS], axis=1)
        parts.append((np.array([str(root / p) for p in rel], dtype=object), patient.to_numpy(dtype=object),
                      (df["Frontal/Lateral"] == "Frontal").to_numpy(), codes,
                      np.full(len(df), path.name == "valid.csv")))
    paths, patients, frontal, codes, test = (np.concatenate(c) for c in zip(*parts, strict=True))
    _check_first_image(paths, "CheXpert", "root/train/patientNNNNN/studyM/*.jpg")
    return SourceTable(paths, patients, frontal, codes, (True,) * 5, test if official_test else None)


def read_nih(root: Path, *, official_test: bool = False) -> SourceTable:
    """NIH ChestX-ray14 as distributed by the NIH Clinical Center (or its Kaggle mirror).

    Layout: ``root/Data_Entry_2017*.csv`` (Image Index, Finding Labels with
    findings joined by ``|`` or ``No Finding``, Follow-up #, Patient ID, Patient
    Age, Patient Gender, View Position, ...) and the PNGs in ``root/images*/``
    or ``root/images*/images/`` (e.g. ``images_001/images/00000001_000.png``).
    Pleural effusion is called ``Effusion``; there are no uncertain labels. With
    ``official_test``, the images named in ``root/test_list.txt`` are the test split.
    """
    entries = sorted(root.glob("Data_Entry_2017*.csv"))
    if not entries:
        raise ValueError(f"NIH ChestX-ray14: no Data_Entry_2017*.csv in '{root}'; chestxray_nih_root must be the "
                         "folder that holds it and the images*/ folders")
    path = entries[-1]
    if len(entries) > 1:
        log.info("NIH ChestX-ray14: several label files, reading %s", path.name)
    df = _read_csv(path, ("Image Index", "Finding Labels", "Patient ID", "View Position"), "NIH Data_Entry")
    findings = [set(s.strip() for s in f.split("|")) for f in df["Finding Labels"]]
    for i, found in enumerate(findings):
        unknown = found - NIH_FINDINGS
        if unknown:
            raise ValueError(f"{path}: line {i + 2}, column 'Finding Labels': unknown finding(s) {sorted(unknown)} "
                             f"(known: {', '.join(sorted(NIH_FINDINGS))})")
    codes = np.array([[float(t in found) for t in NIH_TASKS] for found in findings], dtype=np.float32)
    folders = [d for d in sorted(root.glob("images*")) if d.is_dir()]
    index = _image_index(folders + [d / "images" for d in folders])
    names = df["Image Index"].to_numpy(dtype=object)
    lost = [n for n in names if n not in index]
    if lost:
        raise ValueError(f"NIH ChestX-ray14: {len(lost)} of {len(names)} images listed in {path.name} are not in "
                         f"'{root}/images*/' or '{root}/images*/images/' (first: {lost[0]})")
    test = None
    if official_test:
        listed = root / "test_list.txt"
        if listed.is_file():
            test = np.isin(names, np.array(listed.read_text().split(), dtype=object))
        else:
            log.warning("NIH ChestX-ray14: no test_list.txt in '%s'; its test split is held out by patient", root)
    return SourceTable(np.array([index[n] for n in names], dtype=object), df["Patient ID"].to_numpy(dtype=object),
                       df["View Position"].str.strip().isin(("PA", "AP")).to_numpy(), codes.reshape(-1, 5),
                       (True,) * 5, test)


def read_padchest(root: Path, *, official_test: bool = False) -> SourceTable:
    """PadChest as distributed by BIMCV (16-bit PNGs in numbered folders).

    Layout: ``root/PADCHEST_chest_x_ray_images_labels_160K_01.02.19.csv`` (any
    ``PADCHEST_chest_x_ray_images_labels_*.csv[.gz]``) with columns ImageID,
    ImageDir, PatientID, Projection, Labels, ...; images at
    ``root/<ImageDir>/<ImageID>``. Labels is the text of a Python list of
    lowercase terms, e.g. ``['pleural effusion', 'cardiomegaly']``; terms are
    matched exactly (see ``PADCHEST_TERMS``), so 'pericardial effusion' is no
    pleural effusion. Rows without Labels are skipped. Frontal: Projection PA,
    AP or AP_horizontal. PadChest has no official test split.
    """
    found = sorted(root.glob("PADCHEST_chest_x_ray_images_labels_*.csv*"))
    if len(found) != 1:
        raise ValueError(f"PadChest: expected one PADCHEST_chest_x_ray_images_labels_*.csv in '{root}', found "
                         f"{[p.name for p in found]}")
    path = found[0]
    df = _read_csv(path, ("ImageID", "ImageDir", "PatientID", "Projection", "Labels"), "PadChest labels")
    keep = np.zeros(len(df), dtype=bool)
    codes = np.zeros((len(df), 5), dtype=np.float32)
    for i, text in enumerate(df["Labels"]):
        if text.strip() in ("", "nan"):
            continue
        try:
            terms = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            terms = None
        if not isinstance(terms, list) or not all(isinstance(t, str) for t in terms):
            raise ValueError(f"{path}: line {i + 2}, column 'Labels': {text!r} is not a list of terms like "
                             "['pleural effusion', 'cardiomegaly']")
        terms = {t.strip() for t in terms}
        keep[i] = True
        codes[i] = [float(bool(terms & PADCHEST_TERMS[t])) for t in TASKS]
    if (~keep).any():
        log.info("PadChest: %d images without Labels skipped", int((~keep).sum()))
    df, codes = df[keep], codes[keep]
    paths = np.array([str(root / d.strip() / n.strip()) for d, n in zip(df["ImageDir"], df["ImageID"], strict=True)],
                     dtype=object)
    _check_first_image(paths, "PadChest", "root/<ImageDir>/<ImageID>.png")
    if official_test:
        log.warning("PadChest has no official test split; its test split is held out by patient")
    return SourceTable(paths, df["PatientID"].to_numpy(dtype=object),
                       df["Projection"].str.strip().isin(PADCHEST_FRONTAL).to_numpy(), codes, (True,) * 5)


def read_mimic(root: Path, *, official_test: bool = False) -> SourceTable:
    """MIMIC-CXR-JPG 2.0.0 as distributed by PhysioNet.

    Layout: ``root/mimic-cxr-2.0.0-chexpert.csv.gz`` (one row per study:
    subject_id, study_id and 14 findings with 1.0, 0.0, -1.0 or blank),
    ``root/mimic-cxr-2.0.0-metadata.csv.gz`` (dicom_id, subject_id, study_id,
    ViewPosition, ...), ``root/mimic-cxr-2.0.0-split.csv.gz`` (dicom_id,
    study_id, subject_id, split) and ``root/files/pXX/pSUBJECT/sSTUDY/DICOM.jpg``
    (uncompressed ``.csv`` copies are read too). Each image takes its study's
    labels; images of studies without a label row are skipped. Frontal:
    ViewPosition PA or AP. With ``official_test`` the ``test`` split is the test split; the ``validate`` split
    is marked as the official validation split (used with ``chestxray_val_split=official``).
    """
    def file(stem: str) -> Path:
        return _one_of(root, (f"mimic-cxr-2.0.0-{stem}.csv.gz", f"mimic-cxr-2.0.0-{stem}.csv"),
                       "MIMIC-CXR-JPG (chestxray_mimic_root must hold the csv.gz files and files/)")

    keys = ["subject_id", "study_id"]
    labels_path = file("chexpert")
    labels = _read_csv(labels_path, (*keys, *TASKS), "MIMIC-CXR CheXpert labels")
    study_codes = np.stack([parse_codes(labels[t], labels_path, t) for t in TASKS], axis=1)
    labels = labels[keys].assign(_row=np.arange(len(labels)))
    meta = _read_csv(file("metadata"), ("dicom_id", *keys, "ViewPosition"), "MIMIC-CXR metadata")
    split = _read_csv(file("split"), ("dicom_id", "split"), "MIMIC-CXR split")
    images = meta.merge(labels, on=keys, how="inner").merge(split, on="dicom_id", how="left")
    if len(images) < len(meta):
        log.info("MIMIC-CXR: %d images of studies without labels skipped", len(meta) - len(images))
    paths = np.array([str(root / "files" / f"p{s[:2]}" / f"p{s}" / f"s{st}" / f"{d}.jpg")
                      for s, st, d in zip(images["subject_id"], images["study_id"], images["dicom_id"], strict=True)],
                     dtype=object)
    _check_first_image(paths, "MIMIC-CXR-JPG", "root/files/pXX/pSUBJECT/sSTUDY/DICOM_ID.jpg")
    return SourceTable(paths, images["subject_id"].to_numpy(dtype=object),
                       images["ViewPosition"].str.strip().isin(("PA", "AP")).to_numpy(),
                       study_codes[images["_row"].to_numpy()], (True,) * 5,
                       (images["split"] == "test").to_numpy() if official_test else None,
                       (images["split"] == "validate").to_numpy())


def _vindr_images(root: Path, ids: np.ndarray) -> np.ndarray:
    """``<image_id>.png``/``.jpg`` (converted) or, failing that, the published ``<image_id>.dicom``."""
    index: dict[str, str] = {}
    dicoms: dict[str, str] = {}
    for name, path in _image_index([root / "train"]).items():
        stem, suffix = os.path.splitext(name)
        if suffix.lower() in IMAGE_SUFFIXES:
            index.setdefault(stem, path)
        elif suffix.lower() in DICOM_SUFFIXES:
            dicoms.setdefault(stem, path)
    lost = [i for i in ids if i not in index and i not in dicoms]
    if lost:
        raise ValueError(f"VinDr-CXR: {len(lost)} of {len(ids)} labelled images have no <image_id>.dicom, .png "
                         f"or .jpg in '{root / 'train'}' (first: {lost[0]})")
    if any(i not in index for i in ids):
        require_pydicom("VinDr-CXR's DICOM images")
    return np.array([index.get(i) or dicoms[i] for i in ids], dtype=object)


def require_pydicom(what: str) -> None:
    """Fail before anything is written when DICOM files are to be read without pydicom installed."""
    try:
        import pydicom  # noqa: F401
    except ImportError:
        raise MissingExtraError(f"reading {what} needs pydicom: {extra_hint('dicom', 'pydicom')} (or convert the "
                                "files to PNG with the same names)") from None


def _vindr_image_labels(path: Path) -> tuple[np.ndarray, np.ndarray, tuple[bool, ...]]:
    """(image ids, 0/1 codes per row and task, which tasks have a column) of VinDr-CXR's image_labels_train.csv."""
    header = {c.strip().lower(): c for c in pd.read_csv(path, nrows=0).columns}
    if "image_id" not in header:
        raise ValueError(f"{path}: VinDr-CXR labels file lacks the image_id column")
    columns = [header.get(t.lower()) for t in TASKS]
    df = _read_csv(path, ["image_id", *[c for c in columns if c]], "VinDr-CXR labels")
    codes = np.full((len(df), 5), np.nan, dtype=np.float32)
    for t, c in enumerate(columns):
        if c:
            codes[:, t] = parse_codes(df[c], path, c)
            if (codes[:, t] == -1).any() or np.isnan(codes[:, t]).any():
                i = int(np.flatnonzero((codes[:, t] == -1) | np.isnan(codes[:, t]))[0])
                raise ValueError(f"{path}: line {i + 2}, column '{c}': label {df[c].iloc[i]!r} is not 0 or 1")
    return df["image_id"].str.strip().to_numpy(dtype=object), codes, tuple(c is not None for c in columns)


def _vindr_kaggle_boxes(path: Path) -> tuple[np.ndarray, np.ndarray, tuple[bool, ...]]:
    """The same from the Kaggle variant's train.csv (one row per box; a task without a class is missing)."""
    df = _read_csv(path, ("image_id", "class_name"), "VinDr-CXR Kaggle boxes")
    names = df["class_name"].str.strip().str.lower()
    unknown = ~names.isin(VINDR_KAGGLE_CLASSES)
    if unknown.any():
        i = int(np.flatnonzero(unknown.to_numpy())[0])
        raise ValueError(f"{path}: line {i + 2}, column 'class_name': unknown class {df['class_name'].iloc[i]!r}")
    present = tuple(t.lower() in VINDR_KAGGLE_CLASSES for t in TASKS)
    codes = np.stack([(names == t.lower()).to_numpy(np.float32) if p else np.full(len(df), np.nan, np.float32)
                      for t, p in zip(TASKS, present, strict=True)], axis=1)
    return df["image_id"].str.strip().to_numpy(dtype=object), codes, present


def read_vindr(root: Path, *, official_test: bool = False) -> SourceTable:
    """VinDr-CXR, image-level labels of the training set, one row per radiologist.

    Layout: ``root/image_labels_train.csv`` (or ``root/annotations/...``; columns
    image_id, rad_id and one 0/1 column per finding, e.g. Cardiomegaly, Edema,
    Pleural effusion) or, for the Kaggle competition's variant, ``root/train.csv``
    (image_id, class_name, class_id, rad_id, box coordinates; one row per box).
    An image is positive for a task when any reader marks it (union over
    readers). A task with no column (Edema in the Kaggle variant) is missing
    (NaN), not negative. Images: ``root/train/<image_id>.dicom`` as published
    (read with pydicom, the ``dicom`` extra), or a PNG/JPEG conversion with the
    same name, which is used when both are there. Every image is a frontal (PA)
    view; VinDr-CXR has no patient ids, so each image counts as its own patient.
    """
    found = [p for p in (root / "image_labels_train.csv", root / "annotations" / "image_labels_train.csv")
             if p.is_file()]
    if found:
        ids, codes, present = _vindr_image_labels(found[0])
    elif (root / "train.csv").is_file():
        ids, codes, present = _vindr_kaggle_boxes(root / "train.csv")
    else:
        raise ValueError(f"VinDr-CXR: neither image_labels_train.csv (or annotations/image_labels_train.csv) nor "
                         f"the Kaggle train.csv is in '{root}'")
    unique, inverse = np.unique(ids, return_inverse=True)
    union = np.full((len(unique), 5), np.nan, dtype=np.float32)
    for t in range(5):
        if present[t]:
            union[:, t] = 0.0
            np.maximum.at(union[:, t], inverse, codes[:, t])
    if official_test:
        log.warning("VinDr-CXR: the official test labels are not read; its test split is held out by patient")
    return SourceTable(_vindr_images(root, unique), unique.astype(object), np.ones(len(unique), dtype=bool),
                       union, present)


def _label_files(name: str, root: Path, official_test: bool) -> list[tuple[str, bool]]:
    """(the label files source ``name``'s reader opens first in ``root``, as its messages name them; whether
    they are there)."""
    def csv(stem: str) -> tuple[str, bool]:
        found = any((root / f"mimic-cxr-2.0.0-{stem}.csv{gz}").is_file() for gz in (".gz", ""))
        return f"mimic-cxr-2.0.0-{stem}.csv.gz", found

    if name == "chexpert":
        return [(f, (root / f).is_file()) for f in ("train.csv", *(("valid.csv",) if official_test else ()))]
    if name == "nih":
        return [("Data_Entry_2017*.csv", any(p.is_file() for p in root.glob("Data_Entry_2017*.csv")))]
    if name == "padchest":
        return [("PADCHEST_chest_x_ray_images_labels_*.csv",
                 any(root.glob("PADCHEST_chest_x_ray_images_labels_*.csv*")))]
    if name == "mimic":
        return [csv("chexpert"), csv("metadata"), csv("split")]
    return [("image_labels_train.csv (or annotations/image_labels_train.csv, or Kaggle's train.csv)",
             any((root / f).is_file() for f in ("image_labels_train.csv", "annotations/image_labels_train.csv",
                                                "train.csv")))]


def files_problem(name: str, root: Path, *, official_test: bool = False) -> str | None:
    """What source ``name``'s reader would not find in ``root`` before reading a line: the folder itself, or
    every label file it lacks (None: they are there; the images are checked as the labels are read). The
    driver asks this of every source at once where the clients' data is local, so that a wrong folder is one
    error in seconds, before any client starts."""
    if not root.exists():
        return f"'{root}' does not exist"
    if not root.is_dir():
        return f"'{root}' is not a folder"
    missing = [what for what, found in _label_files(name, root, official_test) if not found]
    return f"'{root}' lacks {', '.join(missing)}" if missing else None


READERS = {"chexpert": read_chexpert, "nih": read_nih, "padchest": read_padchest, "mimic": read_mimic,
           "vindr": read_vindr}
