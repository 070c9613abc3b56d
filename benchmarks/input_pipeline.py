"""Images per second one DataLoader worker decodes and resizes, and the workers a GPU client needs.

Generated grayscale files of the real sizes, each read by the library's own
chest X-ray reader (:class:`fdam_ray.data.chestxray.ChestXrayImages`: decode,
resize to ``image_size``, three channels, ImageNet normalisation) through a
DataLoader as a client reads its batches:

- CheXpert-small-like: 8-bit JPEG, 320 x 390 (width x height);
- NIH-like: 8-bit PNG, 1024 x 1024.

For each format and worker count, the images per second; one worker's rate
is the per-worker figure (a worker process decodes one image at a time), and
the workers a client needs to feed a training rate R samples/s is
ceil(R / per-worker rate). With 0 workers the training process itself reads.

    python benchmarks/input_pipeline.py [--images 192] [--workers 0 1 2] [--image-size 320] \\
        [--train-rates 250 500 1000 2000]

Last line: ``RESULT jpeg_per_worker=... png_per_worker=... jpeg_workers_at_1000=... png_workers_at_1000=...``
(the rate given by ``--rate-for-result``, 1000 samples/s by default).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import _common as C
import numpy as np
import torch
from PIL import Image

from fdam_ray.data.chestxray import ChestXrayImages

FORMATS = {"jpeg": ("CheXpert-small-like JPEG", (320, 390), ".jpg"),
           "png": ("NIH-like PNG", (1024, 1024), ".png")}


def xray_pixels(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """An 8-bit grayscale picture with the statistics of a radiograph rather than of noise: a smooth
    background (a coarse random grid resized up), two bright lung-field-like ellipses, mild grain."""
    coarse = Image.fromarray(rng.uniform(0, 1, (6, 6)).astype(np.float32), mode="F")
    base = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float64)
    yy, xx = np.mgrid[0:height, 0:width] / np.array([height, width]).reshape(2, 1, 1)
    for cx in (0.32, 0.68):
        base += 0.8 * np.exp(-(((xx - cx) / 0.16) ** 2 + ((yy - 0.5) / 0.3) ** 2))
    base += 0.03 * rng.standard_normal((height, width))
    base = (base - base.min()) / (base.max() - base.min())
    return (base * 255).astype(np.uint8)


def write_image(path: Path, rng: np.random.Generator, size: tuple[int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(xray_pixels(rng, *size), mode="L")
    if path.suffix == ".jpg":
        image.save(path, quality=90)
    else:
        image.save(path)


def write_files(folder: Path, fmt: str, n: int, seed: int = 0) -> list[str]:
    """``n`` generated files of format ``fmt`` (a key of :data:`FORMATS`) under ``folder``."""
    _, size, suffix = FORMATS[fmt]
    rng = np.random.default_rng([seed, len(fmt)])
    paths = []
    for i in range(n):
        path = folder / fmt / f"img{i:05d}{suffix}"
        write_image(path, rng, size)
        paths.append(str(path))
    return paths


def read_rate(paths: list[str], *, image_size: int, workers: int, batch: int) -> float:
    """Images per second read through a DataLoader with ``workers`` processes (the first batch, which
    waits for the workers to start, is not timed)."""
    dataset = ChestXrayImages(np.array(paths, dtype=object), np.zeros((len(paths), 5), np.float32),
                              image_size=image_size)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, num_workers=workers, shuffle=False)
    it = iter(loader)
    next(it)
    start, n = time.perf_counter(), 0
    for x, _ in it:
        n += x.shape[0]
    return n / (time.perf_counter() - start)


def workers_needed(train_rate: float, per_worker: float) -> int:
    return math.ceil(train_rate / per_worker)


def measure(folder: Path, *, images: int, workers: list[int], image_size: int, batch: int) -> dict:
    """Per format: on-disk size, images/s at each worker count, and the per-worker rate (one worker's)."""
    out = {}
    for fmt in FORMATS:
        paths = write_files(folder, fmt, images)
        kib = np.mean([os.path.getsize(p) for p in paths]) / 1024
        rates = {w: read_rate(paths, image_size=image_size, workers=w, batch=batch) for w in workers}
        per_worker = rates[1] if 1 in rates else max(rates[w] / max(w, 1) for w in rates)
        out[fmt] = {"kib": kib, "rates": rates, "per_worker": per_worker}
    return out


def report_rows(m: dict, train_rates: list[float]) -> list[list]:
    return [[FORMATS[fmt][0], "x".join(map(str, FORMATS[fmt][1])), f"{r['kib']:.0f}",
             ", ".join(f"{w}: {v:.0f}" for w, v in r["rates"].items()), f"{r['per_worker']:.0f}",
             ", ".join(f"{t:g}: {workers_needed(t, r['per_worker'])}" for t in train_rates)]
            for fmt, r in m.items()]


HEADERS = ["files", "size (w x h)", "KiB each", "images/s by workers", "per worker",
           "workers needed at samples/s"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=192, help="files generated per format")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--image-size", type=int, default=320, help="side the reader resizes to (chestxray: 320)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--train-rates", type=float, nargs="+", default=[250, 500, 1000, 2000])
    parser.add_argument("--rate-for-result", type=float, default=1000.0)
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/input_pipeline.md)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        m = measure(Path(tmp), images=args.images, workers=args.workers, image_size=args.image_size,
                    batch=args.batch)
    body = f"""
{cpu_name()}, {os.cpu_count()} logical CPUs; {args.images} generated files per format, resized to \
{args.image_size} by the library's chest X-ray reader, batch {args.batch}. Per worker = the rate with one \
DataLoader worker; workers needed = ceil(training rate / per-worker rate).

{C.table(HEADERS, report_rows(m, args.train_rates))}
"""
    out = Path(args.out) if args.out else C.RESULTS_DIR / "input_pipeline.md"
    C.write_results(out, "Input pipeline: decode and resize per DataLoader worker",
                    C.command_line("input_pipeline.py", argv), body)
    print(body.strip())
    rate = args.rate_for_result
    line = C.result_line(jpeg_per_worker=m["jpeg"]["per_worker"], png_per_worker=m["png"]["per_worker"],
                         **{f"jpeg_workers_at_{int(rate)}": workers_needed(rate, m["jpeg"]["per_worker"]),
                            f"png_workers_at_{int(rate)}": workers_needed(rate, m["png"]["per_worker"])})
    print(line)
    return line


if __name__ == "__main__":
    main(sys.argv[1:])
