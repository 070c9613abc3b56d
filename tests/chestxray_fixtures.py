"""Tiny chest X-ray sources written in each publisher's on-disk layout (CSV headers and conventions as shipped).

Every writer makes about a dozen small images and returns the root folder a
config's ``chestxray_<source>_root`` points at. The label tables are module
constants so that tests can state what each image must end up with.
"""

from __future__ import annotations

import csv
import gzip
import io
from pathlib import Path

import numpy as np
from PIL import Image

TASKS = ("Cardiomegaly", "Edema", "Consolidation", "Atelectasis", "Pleural Effusion")


def write_image(path: Path, seed: int, *, bits: int = 8, size: tuple[int, int] = (24, 20)) -> None:
    """A small grayscale image: a seeded noise pattern (8-bit JPEG/PNG or 16-bit PNG with 12-bit values)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    w, h = size
    if bits == 16:
        Image.fromarray(gray12(seed, size)).save(path)  # mode I;16 -> a 16-bit PNG
    else:
        Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), mode="L").save(path)


def write_csv(path: Path, header: list[str], rows: list[list], *, gz: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(buf.getvalue())
    else:
        path.write_text(buf.getvalue(), encoding="utf-8")


# ---------------------------------------------------------------- CheXpert
CHEXPERT_FINDINGS = ["No Finding", "Enlarged Cardiomediastinum", "Cardiomegaly", "Lung Opacity", "Lung Lesion",
                     "Edema", "Consolidation", "Pneumonia", "Atelectasis", "Pneumothorax", "Pleural Effusion",
                     "Pleural Other", "Fracture", "Support Devices"]
CHEXPERT_HEADER = ["Path", "Sex", "Age", "Frontal/Lateral", "AP/PA", *CHEXPERT_FINDINGS]
# (patient, study, view file, frontal?, values of the five tasks as written in the file)
CHEXPERT_ROWS = [
    (1, 1, "view1_frontal", True, ("1.0", "-1.0", "", "-1.0", "0.0")),
    (1, 1, "view2_lateral", False, ("1.0", "-1.0", "", "-1.0", "0.0")),
    (2, 1, "view1_frontal", True, ("0.0", "1.0", "-1.0", "", "1.0")),
    (2, 1, "view2_lateral", False, ("0.0", "1.0", "-1.0", "", "1.0")),
    (3, 1, "view1_frontal", True, ("-1.0", "0.0", "1.0", "1.0", "-1.0")),
    (3, 2, "view1_frontal", True, ("", "", "0.0", "0.0", "")),
    (4, 1, "view1_frontal", True, ("1.0", "1.0", "0.0", "1.0", "1.0")),
    (5, 1, "view1_frontal", True, ("0.0", "0.0", "1.0", "0.0", "0.0")),
    (6, 1, "view1_frontal", True, ("1.0", "-1.0", "0.0", "1.0", "1.0")),
    (7, 1, "view1_frontal", True, ("0.0", "1.0", "1.0", "0.0", "0.0")),
    (8, 1, "view1_frontal", True, ("1.0", "0.0", "0.0", "-1.0", "1.0")),
    (8, 1, "view2_lateral", False, ("1.0", "0.0", "0.0", "-1.0", "1.0")),
]
CHEXPERT_VALID_ROWS = [
    (64541, 1, "view1_frontal", True, ("1.0", "0.0", "1.0", "0.0", "1.0")),
    (64542, 1, "view1_frontal", True, ("0.0", "1.0", "0.0", "1.0", "0.0")),
]


def _chexpert_row(part: str, prefix: str, patient: int, study: int, view: str, frontal: bool, values) -> list:
    rel = f"{part}/patient{patient:05d}/study{study}/{view}.jpg"
    by_name = dict(zip(TASKS, values, strict=True))
    findings = [by_name.get(f, "1.0" if f == "Support Devices" and patient % 2 else "") for f in CHEXPERT_FINDINGS]
    return [prefix + rel, "Female" if patient % 2 else "Male", str(40 + patient), "Frontal" if frontal else "Lateral",
            ("AP" if patient % 3 else "PA") if frontal else "", *findings]


def write_chexpert(base: Path, *, prefix: str = "CheXpert-v1.0-small/", rows=CHEXPERT_ROWS,
                   valid_rows=CHEXPERT_VALID_ROWS) -> Path:
    root = base / "CheXpert-v1.0-small"
    for part, table in (("train", rows), ("valid", valid_rows)):
        out = []
        for i, (patient, study, view, frontal, values) in enumerate(table):
            out.append(_chexpert_row(part, prefix, patient, study, view, frontal, values))
            write_image(root / part / f"patient{patient:05d}" / f"study{study}" / f"{view}.jpg", seed=100 + i)
        write_csv(root / f"{part}.csv", CHEXPERT_HEADER, out)
    return root


# ---------------------------------------------------------------- NIH ChestX-ray14
NIH_HEADER = ["Image Index", "Finding Labels", "Follow-up #", "Patient ID", "Patient Age", "Patient Gender",
              "View Position", "OriginalImage[Width", "Height]", "OriginalImagePixelSpacing[x", "y]", ""]
# (image, finding labels, patient id, view)
NIH_ROWS = [
    ("00000001_000.png", "Cardiomegaly|Effusion", 1, "PA"),
    ("00000001_001.png", "No Finding", 1, "PA"),
    ("00000002_000.png", "Edema|Infiltration", 2, "AP"),
    ("00000002_001.png", "Atelectasis|Consolidation", 2, "AP"),
    ("00000003_000.png", "Effusion|Pleural_Thickening", 3, "PA"),
    ("00000003_001.png", "No Finding", 3, "PA"),
    ("00000004_000.png", "Cardiomegaly|Edema|Atelectasis", 4, "PA"),
    ("00000004_001.png", "Consolidation", 4, "AP"),
    ("00000005_000.png", "Nodule|Mass", 5, "PA"),
    ("00000005_001.png", "Effusion|Consolidation", 5, "PA"),
    ("00000006_000.png", "Edema|Cardiomegaly", 6, "AP"),
    ("00000006_001.png", "Atelectasis", 6, "PA"),
]


def write_nih(base: Path, *, rows=NIH_ROWS) -> Path:
    root = base / "nih"
    out = []
    for i, (name, findings, patient, view) in enumerate(rows):
        folder = "images_001" if i < 6 else "images_002"
        write_image(root / folder / "images" / name, seed=200 + i)
        out.append([name, findings, str(i % 2), str(patient), "50", "M", view, "2500", "2048", "0.143", "0.143", ""])
    write_csv(root / "Data_Entry_2017_v2020.csv", NIH_HEADER, out)
    (root / "test_list.txt").write_text("00000006_000.png\n00000006_001.png\n")
    return root


# ---------------------------------------------------------------- PadChest
PADCHEST_HEADER = [
    "ImageID", "ImageDir", "StudyDate_DICOM", "StudyID", "PatientID", "PatientBirth", "PatientSex_DICOM",
    "ViewPosition_DICOM", "Projection", "MethodProjection", "Pediatric", "Modality_DICOM", "Manufacturer_DICOM",
    "PhotometricInterpretation_DICOM", "PixelRepresentation_DICOM", "PixelAspectRatio_DICOM",
    "SpatialResolution_DICOM", "BitsStored_DICOM", "WindowCenter_DICOM", "WindowWidth_DICOM", "Rows_DICOM",
    "Columns_DICOM", "XRayTubeCurrent_DICOM", "Exposure_DICOM", "ExposureInuAs_DICOM", "ExposureTime",
    "RelativeXRayExposure_DICOM", "ReportID", "Report", "MethodLabel", "Labels", "Localizations",
    "LabelsLocalizationsBySentence", "labelCUIS", "LocalizationsCUIS",
]
# (image id, patient, projection, Labels as written)
PADCHEST_ROWS = [
    ("pc_01.png", "pat_a", "PA", "['pericardial effusion']"),
    ("pc_02.png", "pat_a", "L", "['pleural effusion']"),
    ("pc_03.png", "pat_b", "PA", "['loculated pleural effusion', 'cardiomegaly']"),
    ("pc_04.png", "pat_b", "AP_horizontal", "['lobar atelectasis', 'pulmonary edema']"),
    ("pc_05.png", "pat_c", "AP", "['kerley lines', 'consolidation']"),
    ("pc_06.png", "pat_c", "PA", "['normal']"),
    ("pc_07.png", "pat_d", "PA", "['atelectasis', ' pleural effusion']"),
    ("pc_08.png", "pat_d", "PA", "['cardiomegaly', 'pulmonary edema', 'consolidation']"),
    ("pc_09.png", "pat_e", "PA", ""),
    ("pc_10.png", "pat_e", "PA", "['pleural thickening', 'atelectasis basal']"),
    ("pc_11.png", "pat_f", "PA", "['cardiomegaly', 'pleural effusion']"),
    ("pc_12.png", "pat_f", "PA", "['consolidation', 'pulmonary edema']"),
]


def write_padchest(base: Path, *, rows=PADCHEST_ROWS) -> Path:
    root = base / "padchest"
    out = []
    for i, (image, patient, projection, labels) in enumerate(rows):
        folder = str(i % 2)
        write_image(root / folder / image, seed=300 + i, bits=16)
        row = dict.fromkeys(PADCHEST_HEADER, "")
        row.update(ImageID=image, ImageDir=folder, PatientID=patient, Projection=projection, Labels=labels,
                   StudyID=f"study_{i}", Pediatric="No", MethodLabel="Physician", BitsStored_DICOM="12")
        out.append([row[c] for c in PADCHEST_HEADER])
    write_csv(root / "PADCHEST_chest_x_ray_images_labels_160K_01.02.19.csv", PADCHEST_HEADER, out)
    return root


# ---------------------------------------------------------------- MIMIC-CXR-JPG
MIMIC_FINDINGS = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Enlarged Cardiomediastinum", "Fracture",
                  "Lung Lesion", "Lung Opacity", "No Finding", "Pleural Effusion", "Pleural Other", "Pneumonia",
                  "Pneumothorax", "Support Devices"]
MIMIC_META_HEADER = ["dicom_id", "subject_id", "study_id", "PerformedProcedureStepDescription", "ViewPosition",
                     "Rows", "Columns", "StudyDate", "StudyTime", "ProcedureCodeSequence_CodeMeaning",
                     "ViewCodeSequence_CodeMeaning", "PatientOrientationCodeSequence_CodeMeaning"]
# study -> (subject, split, values of the five tasks in TASKS order); study 50000007 has no label row
MIMIC_STUDIES = {
    "50000001": ("10000032", "train", ("1.0", "-1.0", "", "0.0", "1.0")),
    "50000002": ("10000032", "train", ("0.0", "", "1.0", "-1.0", "0.0")),
    "50000003": ("10000764", "train", ("-1.0", "1.0", "0.0", "1.0", "")),
    "50000004": ("10000898", "validate", ("1.0", "0.0", "-1.0", "1.0", "1.0")),
    "50000005": ("11000011", "train", ("0.0", "1.0", "1.0", "0.0", "-1.0")),
    "50000006": ("12000024", "test", ("1.0", "1.0", "0.0", "0.0", "1.0")),
    "50000007": ("12000024", "test", None),
}


def write_mimic(base: Path, *, studies=MIMIC_STUDIES) -> Path:
    root = base / "mimic"
    labels, meta, split = [], [], []
    for i, (study, (subject, part, values)) in enumerate(studies.items()):
        if values is not None:
            by_name = dict(zip(TASKS, values, strict=True))
            labels.append([subject, study, *[by_name.get(f, "") for f in MIMIC_FINDINGS]])
        for j, view in enumerate(("PA" if i % 2 else "AP", "LATERAL")):
            dicom = f"{i:02d}{j}a1b2c3-d4e5f6a7-b8c9d0e1-f2a3b4c5-d6e7f8a9"
            meta.append([dicom, subject, study, "CHEST (PA AND LAT)", view, "3056", "2544", "21800506", "213014.531",
                         "CHEST (PA AND LAT)", "postero-anterior" if view == "PA" else "lateral", "Erect"])
            split.append([dicom, study, subject, part])
            write_image(root / "files" / f"p{subject[:2]}" / f"p{subject}" / f"s{study}" / f"{dicom}.jpg",
                        seed=400 + 2 * i + j)
    write_csv(root / "mimic-cxr-2.0.0-chexpert.csv.gz", ["subject_id", "study_id", *MIMIC_FINDINGS], labels, gz=True)
    write_csv(root / "mimic-cxr-2.0.0-metadata.csv.gz", MIMIC_META_HEADER, meta, gz=True)
    write_csv(root / "mimic-cxr-2.0.0-split.csv.gz", ["dicom_id", "study_id", "subject_id", "split"], split, gz=True)
    return root


# ---------------------------------------------------------------- VinDr-CXR
VINDR_FINDINGS = ["Aortic enlargement", "Atelectasis", "Calcification", "Cardiomegaly", "Clavicle fracture",
                  "Consolidation", "Edema", "Emphysema", "Enlarged PA", "ILD", "Infiltration", "Lung Opacity",
                  "Lung cavity", "Lung cyst", "Mediastinal shift", "Nodule/Mass", "Pleural effusion",
                  "Pleural thickening", "Pneumothorax", "Pulmonary fibrosis", "Rib fracture", "Other lesion", "COPD",
                  "Lung tumor", "Pneumonia", "Tuberculosis", "Other diseases", "No finding"]
VINDR_TASK_COLUMNS = ("Cardiomegaly", "Edema", "Consolidation", "Atelectasis", "Pleural effusion")
VINDR_IMAGES = [f"{i:032x}" for i in range(0xA0, 0xAC)]


def vindr_reads(i: int) -> list[tuple[str, tuple[int, ...]]]:
    """Image i's three readers and the five task marks each gave (the union differs from any one reader)."""
    first = tuple(int((i + t) % 3 == 0) for t in range(5))
    second = tuple(int((i * 2 + t) % 5 == 0) for t in range(5))
    return [(f"R{1 + i % 8}", first), (f"R{9 + i % 6}", second), ("R15", (0, 0, 0, 0, 0))]


def write_dicom(path: Path, pixels: np.ndarray, *, monochrome1: bool = False, slope: float = 1.0,
                intercept: float = 0.0) -> None:
    """A DICOM Part 10 file as VinDr-CXR publishes them: Digital X-Ray, explicit VR little endian, 16-bit
    unsigned pixels with 12 bits stored, optional rescale and MONOCHROME1 (low values bright)."""
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    path.parent.mkdir(parents=True, exist_ok=True)
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.1.1"  # Digital X-Ray Image Storage - For Presentation
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.PatientID = "DX", ""
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME1" if monochrome1 else "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    if slope != 1.0 or intercept != 0.0:
        ds.RescaleSlope, ds.RescaleIntercept = f"{slope:g}", f"{intercept:g}"
    ds.PixelData = np.ascontiguousarray(pixels, dtype="<u2").tobytes()
    ds.save_as(path, enforce_file_format=True)


def gray12(seed: int, size: tuple[int, int] = (24, 20)) -> np.ndarray:
    """The 12-bit pattern of :func:`write_image` with ``bits=16``."""
    rng = np.random.default_rng(seed)
    w, h = size
    return (rng.integers(0, 4096, (h, w)) // 2 + np.linspace(0, 2047, w)[None, :]).astype(np.uint16)


def write_vindr(base: Path, *, edema_column: bool = True, images=VINDR_IMAGES, reads=vindr_reads,
                dicom: bool = False) -> Path:
    """PhysioNet's image_labels_train.csv; without the Edema column it is the variant that lacks that task.
    With ``dicom`` the images are DICOM files as published (every other one MONOCHROME1), not PNGs."""
    root = base / "vindr"
    header = ["image_id", "rad_id", *[f for f in VINDR_FINDINGS if edema_column or f != "Edema"]]
    out = []
    for i, image in enumerate(images):
        if dicom:
            write_dicom(root / "train" / f"{image}.dicom", gray12(500 + i), monochrome1=bool(i % 2))
        else:
            write_image(root / "train" / f"{image}.png", seed=500 + i)
        for rad, marks in reads(i):
            by_name = dict(zip(VINDR_TASK_COLUMNS, marks, strict=True))
            row = {f: str(by_name.get(f, 0)) for f in VINDR_FINDINGS}
            row["No finding"] = str(int(not any(marks)))
            out.append([image, rad, *[row[c] for c in header[2:]]])
    write_csv(root / "image_labels_train.csv", header, out)
    return root


def write_vindr_kaggle(base: Path) -> Path:
    """The Kaggle competition's train.csv: one row per box (or one 'No finding' row per reader), no Edema class."""
    root = base / "vindr_kaggle"
    names = {"Cardiomegaly": 3, "Consolidation": 4, "Atelectasis": 1, "Pleural effusion": 10}
    out = []
    for i, image in enumerate(VINDR_IMAGES):
        write_image(root / "train" / f"{image}.png", seed=600 + i)
        for rad, marks in vindr_reads(i):
            found = [c for c, m in zip(VINDR_TASK_COLUMNS, marks, strict=True) if m and c in names]
            for c in found:
                out.append([image, c, str(names[c]), rad, "10", "20", "100", "200"])
            if not found:
                out.append([image, "No finding", "14", rad, "", "", "", ""])
    write_csv(root / "train.csv", ["image_id", "class_name", "class_id", "rad_id", "x_min", "y_min", "x_max",
                                   "y_max"], out)
    return root
