"""More sources for one hospital: CheXpert validation AUC as K = 1..5 organisations join (the paper's Sec. 5.2).

The paper trains CODASCA with CheXpert alone (K = 1), then adds NIH
ChestX-ray14, PadChest, MIMIC-CXR and VinDr-CXR one at a time (one client per
organisation), and reports the mean AUC of the five tasks on CheXpert's
validation set: DenseNet121 0.9353 at K = 1 to 0.9376 at K = 5. The recipe is
two-stage: BCE pre-training on CheXpert, then CODASCA from the pre-trained body
with a new head (gamma 1e-3, T0 1000, batch 32).

The script drives the ``chestxray`` dataset exactly as a user would: given the
five source roots it runs on the real data. Without them it first writes a
miniature of the five datasets *in their real on-disk layouts* (label files
with the publishers' headers, written by the chest X-ray test fixtures,
``tests/chestxray_fixtures.py``) whose images carry a learnable signal: each
task adds its own blob pattern where its label is positive (half of it where
uncertain), and each organisation has its own brightness, contrast and stripe
texture (a shifted feature distribution, scaled by ``--shifts``: one miniature
per value, default 0 and 1) and its own prevalences (the paper's Table 5).
CheXpert's ``valid.csv`` is the target validation set
(``chestxray_test_split: official``); the figure reported is client 0's AUC.

    python benchmarks/multi_source.py --quick                      # committed results (generated data)
    python benchmarks/multi_source.py --chexpert-root C --nih-root N --padchest-root P --mimic-root M \\
        --vindr-root V --executor ray                              # the real five datasets, DenseNet121

Last line: ``RESULT auc_k1=... auc_k5=... gain=...`` (gain = K = 5 minus K = 1), with a ``_shift<s>``
suffix per generated miniature when there are several.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import _common as C
import numpy as np

SOURCES = ("chexpert", "nih", "padchest", "mimic", "vindr")  # the paper's order of adding sources
# Positive rate of Cardiomegaly, Edema, Consolidation, Atelectasis, Pleural Effusion per source (paper, Table 5).
PREVALENCE = {
    "chexpert": (0.211, 0.342, 0.120, 0.310, 0.414),
    "nih": (0.025, 0.021, 0.042, 0.103, 0.119),
    "padchest": (0.089, 0.012, 0.015, 0.056, 0.064),
    "mimic": (0.196, 0.179, 0.047, 0.246, 0.237),
    "vindr": (0.153, 0.000, 0.024, 0.012, 0.069),
}
PAPER = {1: 0.9353, 2: 0.9361, 3: 0.9356, 4: 0.9372, 5: 0.9376}  # DenseNet121, mean of the five tasks
GENERATED_SIZE = 16
QUICK = {"images": 300, "iterations": 600, "pretrain_iterations": 200, "model": "cnn", "model_width": 16,
         "image_size": GENERATED_SIZE, "stage_length": 320, "lrs": [0.5]}
FULL = {"images": 1000, "iterations": 4000, "pretrain_iterations": 2000, "model": "densenet121", "model_width": 32,
        "image_size": None, "stage_length": 1000, "lrs": [0.1, 0.01]}


# -- the generated miniature --------------------------------------------------------------------------
def _fixtures():
    tests = Path(__file__).resolve().parent.parent / "tests"
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    import chestxray_fixtures

    return chestxray_fixtures


def _labels(rng: np.random.Generator, n: int, source: str, uncertain: float) -> np.ndarray:
    """Codes 1, 0, -1 (uncertain) per image and task, positives at the source's prevalences."""
    prev = np.array(PREVALENCE[source])
    codes = (rng.random((n, 5)) < prev).astype(float)
    if uncertain:
        codes[(rng.random((n, 5)) < uncertain) & (codes == 0)] = -1
    return codes


def _as_text(code: float) -> str:
    return {1.0: "1.0", 0.0: "0.0", -1.0: "-1.0"}[float(code)]


def write_label_files(base: Path, n: int, seed: int) -> dict[str, Path]:
    """The five datasets' label files and placeholder images in their real layouts; returns the roots."""
    fx = _fixtures()
    rng = np.random.default_rng([seed, 77])
    roots = {}
    codes = _labels(rng, n, "chexpert", 0.05)
    train = [(p + 1, 1, "view1_frontal", True, tuple(map(_as_text, c))) for p, c in enumerate(codes)]
    train += [(p + 1, 1, "view2_lateral", False, train[p][4]) for p in range(0, n, 10)]  # left out: frontal only
    valid_codes = _labels(rng, max(n // 3, 20), "chexpert", 0.0)
    valid = [(64541 + p, 1, "view1_frontal", True, tuple(map(_as_text, c))) for p, c in enumerate(valid_codes)]
    roots["chexpert"] = fx.write_chexpert(base, rows=train, valid_rows=valid)

    nih_names = ("Cardiomegaly", "Edema", "Consolidation", "Atelectasis", "Effusion")
    rows = []
    for i, c in enumerate(_labels(rng, n, "nih", 0.0)):
        found = "|".join(name for name, v in zip(nih_names, c, strict=True) if v == 1) or "No Finding"
        rows.append((f"{i // 2 + 1:08d}_{i % 2:03d}.png", found, i // 2 + 1, "PA" if i % 3 else "AP"))
    roots["nih"] = fx.write_nih(base, rows=rows)

    pc_terms = ("cardiomegaly", "pulmonary edema", "consolidation", "atelectasis", "pleural effusion")
    rows = []
    for i, c in enumerate(_labels(rng, n, "padchest", 0.0)):
        terms = [t for t, v in zip(pc_terms, c, strict=True) if v == 1] or ["normal"]
        rows.append((f"pc_{i:05d}.png", f"pat_{i // 2}", "PA", str(terms)))
    roots["padchest"] = fx.write_padchest(base, rows=rows)

    studies = {}
    for i, c in enumerate(_labels(rng, n, "mimic", 0.05)):
        subject = f"{10000000 + i // 2:08d}"
        studies[f"{50000000 + i:08d}"] = (subject, "test" if i % 10 == 9 else "train", tuple(map(_as_text, c)))
    roots["mimic"] = fx.write_mimic(base, studies=studies)

    vindr_codes = _labels(rng, n, "vindr", 0.0).astype(int)
    images = [f"{0x1000 + i:032x}" for i in range(n)]
    roots["vindr"] = fx.write_vindr(base, images=images,
                                    reads=lambda i: [(f"R{r}", tuple(vindr_codes[i])) for r in (1, 9, 15)])
    return roots


def _pattern(seed: int) -> np.ndarray:
    """A task's signal: two Gaussian blobs at seeded places on a GENERATED_SIZE square."""
    rng = np.random.default_rng([seed, 5])
    yy, xx = np.mgrid[0:GENERATED_SIZE, 0:GENERATED_SIZE]
    out = np.zeros((GENERATED_SIZE, GENERATED_SIZE))
    for _ in range(2):
        cy, cx = rng.uniform(3, GENERATED_SIZE - 3, 2)
        out += np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * 1.5**2))
    return out


def paint_images(roots: dict[str, Path], seed: int, amplitude: float = 1.0, shift: float = 1.0) -> None:
    """Overwrite every listed image with its labels' signal on its organisation's style.

    The labels come back through the library's own readers, so an image gets
    exactly the codes the loader will see. ``shift`` scales how far the
    organisations' styles (brightness, contrast, stripes) lie apart (0: one style).
    """
    from PIL import Image

    from fdam_ray.data.chestxray_readers import READERS

    patterns = [_pattern(t) for t in range(5)]
    yy, xx = np.mgrid[0:GENERATED_SIZE, 0:GENERATED_SIZE]
    for s, (name, root) in enumerate(roots.items()):
        style = np.random.default_rng([seed, 11, s])
        brightness, contrast = shift * style.uniform(-0.6, 0.6), 1 + shift * style.uniform(-0.3, 0.4)
        angle, freq = style.uniform(0, np.pi), style.uniform(0.3, 0.9)
        stripes = shift * 0.5 * np.sin(freq * (np.cos(angle) * xx + np.sin(angle) * yy))
        table = READERS[name](root, official_test=True)
        rng = np.random.default_rng([seed, 13, s])
        for path, codes in zip(table.paths, table.codes, strict=True):
            signal = sum(amplitude * (1.0 if c == 1 else 0.5 if c == -1 else 0.0) * p
                         for c, p in zip(codes, patterns, strict=True))
            coarse = np.kron(rng.standard_normal((4, 4)), np.ones((4, 4)))  # smooth anatomy-like background
            x = contrast * (0.6 * coarse + 0.4 * rng.standard_normal(coarse.shape) + stripes + signal) + brightness
            x = 1 / (1 + np.exp(-x))
            if name == "padchest":
                Image.fromarray((x * 4095).astype(np.uint16)).save(path)  # 12 bits in a 16-bit PNG, as shipped
            else:
                Image.fromarray((x * 255).astype(np.uint8), mode="L").save(path)


def generate(base: Path, n: int, seed: int = 0, amplitude: float = 1.0, shift: float = 1.0) -> dict[str, Path]:
    """A miniature of the five datasets under ``base``; returns each source's root."""
    roots = write_label_files(base, n, seed)
    paint_images(roots, seed, amplitude, shift)
    return roots


# -- the experiment -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None):
    p = C.base_parser(__doc__.split("\n\n")[0])
    for name in SOURCES:
        p.add_argument(f"--{name}-root", default=None, help=f"folder of the real {name} files")
    p.add_argument("--generate-into", default=None, help="where to write the miniature (default: a temp folder)")
    p.add_argument("--images", type=int, default=None, help="generated images per source")
    p.add_argument("--signal", type=float, default=1.5, help="generated images: strength of a task's pattern")
    p.add_argument("--shifts", type=float, nargs="+", default=[0.0, 1.0],
                   help="generated images: how far the organisations' styles lie apart (0: one style); one "
                        "miniature per value")
    p.add_argument("--sources", type=int, default=5, help="largest K (sources added in the paper's order)")
    p.add_argument("--model", default=None)
    p.add_argument("--model-width", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--local-steps", type=int, default=16)
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="lr grid; the best mean over K is kept")
    p.add_argument("--prox-weight", type=float, default=1e-3)
    p.add_argument("--iterations", type=int, default=None)
    p.add_argument("--stage-length", type=int, default=None)
    p.add_argument("--pretrain-iterations", type=int, default=None, help="BCE pre-training on CheXpert alone")
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    C.check_args(args)
    given = [n for n in SOURCES if getattr(args, f"{n}_root")]
    args.real = bool(given)
    if args.real and len(given) < args.sources:
        p.error(f"real data: give the roots of the first {args.sources} sources ({', '.join(SOURCES[:args.sources])})"
                f"; given: {', '.join(given)}")
    if not 1 <= args.sources <= 5:
        p.error("--sources must be 1..5")
    mode = QUICK if args.quick else FULL
    for name in ("images", "iterations", "pretrain_iterations", "model", "model_width", "image_size",
                 "stage_length", "lrs"):
        if getattr(args, name) is None:
            setattr(args, name, mode[name])
    if not args.real:
        args.image_size = GENERATED_SIZE
    return args


def spec(args, roots: dict[str, Path], k: int, lr: float, seed: int) -> dict:
    s = {"dataset": "chestxray", "chestxray_sources": list(SOURCES[:k]), "num_clients": k,
         "chestxray_clients": "source", "chestxray_test_split": "official", "image_size": args.image_size,
         "model": args.model, "model_width": args.model_width, "algorithm": "codasca", "objective": "auc_margin",
         "local_steps": args.local_steps, "lr": lr, "prox_weight": args.prox_weight, "batch_size": args.batch_size,
         "iterations": args.iterations, "stage_length": args.stage_length, "eval_every": args.iterations,
         "pretrain_iterations": args.pretrain_iterations, "pretrain_federated": False, "seed": seed,
         "executor": args.executor, "device": args.device}
    s.update({f"chestxray_{n}_root": str(roots[n]) for n in SOURCES[:k]})
    return s


def target_auc(result: dict) -> float:
    """CheXpert's validation AUC (client 0's own test split, mean over the five tasks)."""
    if result["last"] is None or "client_auc" not in result["last"]:
        return float("nan")
    value = result["last"]["client_auc"].get("0")
    return float("nan") if value is None else float(value)


def measure(args, datasets: dict[str, dict[str, Path]]) -> dict:
    """Every (dataset, lr, K, seed); per dataset the lr with the best mean over K is kept."""
    ks = list(range(1, args.sources + 1))
    specs = [{**spec(args, roots, k, lr, seed), "_data": name} for name, roots in datasets.items()
             for lr in args.lrs for k in ks for seed in args.seeds]
    results = C.run_grid(specs, workers=args.workers)
    for r in results:
        r["target_auc"] = target_auc(r)
    by = C.group(results, ["_data", "lr", "num_clients"], "target_auc")
    best_lr = {d: max(args.lrs, key=lambda x: np.nanmean([by[(d, x, k)].mean for k in ks])) for d in datasets}
    return {"results": results, "by": {d: {k: by[(d, best_lr[d], k)] for k in ks} for d in datasets}, "all": by,
            "lr": best_lr, "ks": ks, "wall_s": sum(r["wall_s"] for r in results)}


def report(args, m: dict, out: Path, command: str) -> str:
    ks, datasets = m["ks"], list(m["by"])
    headers, rows = ["K", "sources"], [[k, ", ".join(SOURCES[:k])] for k in ks]
    for d in datasets:
        by = m["by"][d]
        headers += [f"CheXpert validation AUC{'' if args.real else f', {d}'}", "vs K=1"]
        for row, k in zip(rows, ks, strict=True):
            row += [by[k].fmt(), f"{by[k].mean - by[1].mean:+.4f}"]
    headers.append("paper (DenseNet121, real data)")
    for row, k in zip(rows, ks, strict=True):
        row.append(PAPER[k])
    data = ("the real datasets" if args.real else
            f"generated miniatures ({args.images} images per source, {GENERATED_SIZE}x{GENERATED_SIZE}, in the "
            f"real layouts; task signal {args.signal}; 'shift s': the organisations' styles lie s apart)")
    other = ""
    if len(args.lrs) > 1:
        other = "\n\nAll lr values (mean target AUC by K):\n\n" + C.table(
            ["data", "lr", *[f"K={k}" for k in ks]],
            [[d, lr, *[f"{m['all'][(d, lr, k)].mean:.4f}" for k in ks]] for d in datasets for lr in args.lrs])
    lrs = ", ".join(f"{m['lr'][d]}" + ("" if args.real else f" ({d})") for d in datasets)
    body = f"""
CODASCA (auc_margin) on {data}: one client per source, model {args.model} (width {args.model_width}), images \
{args.image_size or 'default'} px, BCE pre-training on CheXpert alone for {args.pretrain_iterations} iterations, then \
{args.iterations} iterations with I = {args.local_steps}, lr {lrs} (/3 every {args.stage_length}), gamma \
{args.prox_weight}, batch {args.batch_size}; executor {args.executor}. Target: CheXpert validation AUC (mean of \
the five tasks), mean ± sample std over seeds {' '.join(map(str, args.seeds))}.

{C.table(headers, rows)}{other}

{len(m['results'])} runs, {m['wall_s'] / 60:.1f} min of run time.
"""
    C.write_results(out, "Multi-source: CheXpert validation AUC by number of sources", command, body)
    print(body)
    top = ks[-1]
    values = {}
    for d in datasets:
        by, tag = m["by"][d], "" if len(datasets) == 1 else "_" + d.replace(" ", "").replace(".", "")
        values.update({f"auc_k1{tag}": by[1].mean, f"auc_k{top}{tag}": by[top].mean,
                       f"gain{tag}": by[top].mean - by[1].mean})
    return C.result_line(**values)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    C.setup()
    out = Path(args.out) if args.out else C.RESULTS_DIR / "multi_source.md"
    command = C.command_line("multi_source.py", argv)
    if args.real:
        datasets = {"real": {n: Path(getattr(args, f"{n}_root")) for n in SOURCES[:args.sources]}}
        line = report(args, measure(args, datasets), out, command)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            base = Path(args.generate_into) if args.generate_into else Path(tmp)
            datasets = {f"shift {sh:g}": generate(base / f"shift{sh:g}", args.images, seed=0, amplitude=args.signal,
                                                  shift=sh) for sh in args.shifts}
            line = report(args, measure(args, datasets), out, command)
    print(line)
    return line


if __name__ == "__main__":
    main(sys.argv[1:])
