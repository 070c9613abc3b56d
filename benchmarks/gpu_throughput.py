"""GPU throughput: a client against a bare PyTorch loop, bf16 against fp32, four clients sharing one GPU,
and a whole run reading chest X-ray files against the training-only rate.

    python benchmarks/gpu_throughput.py            # with a CUDA GPU: the real figures; without: a CPU stand-in
    python benchmarks/gpu_throughput.py --quick    # tiny sizes (the test suite's run): every path once

1. Client vs bare loop: samples/s of ``Client.local_round`` and of step_overhead.py's hand-written loop
   with the same model, batch, precision, memory format and device, in alternating blocks (the ratio
   of the medians; target >= 0.95): DenseNet121 at 224 (batch 32) and ResNet20 at 32 (batch 128), fp32
   and bf16 (quick: the same networks at small sizes).
2. bf16 against fp32: the client's speed-up on DenseNet121 (from 1) and the final test AUC of short
   runs of each (digits, ResNet20, several seeds; no loss of AUC beyond the seeds' spread).
3. Shared GPU: K = 4 Ray client actors with ``gpus_per_client=0.25`` against one client with the whole
   GPU (ResNet20, bf16, batch 128, in-memory data): aggregate samples/s, ratio (target >= 0.9). On the
   CPU the same comparison with ``cpus_per_client`` shares of the CPUs.
4. End to end: ``fdam_ray.run`` (what ``fdam train`` runs) on generated CheXpert-like 320 x 390 JPEG
   files (the test fixtures' layout) at image_size 320 with DenseNet121, bf16 and ``data_workers=auto``,
   against the same run on the same number of in-memory images: samples/s ratio (target >= 0.9).

Rates of whole runs are taken between the run's two evaluations (the second half), so start-up, cuDNN's
autotuning and DataLoader start-up stay out. Writes ``benchmarks/results/gpu_throughput.md``.

Last line: ``RESULT client_vs_bare_densenet_bf16=... bf16_speedup=... shared_gpu_ratio=... pipeline_ratio=...``
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common as C
import numpy as np
import torch
from input_pipeline import cpu_name, write_image
from multi_source import _as_text, _fixtures, _labels
from step_overhead import BareLoop, make_data

import fdam_ray
from fdam_ray.clients.client import Client, resolve_device
from fdam_ray.config import build_config
from fdam_ray.core.state import RoundPlan
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.ray.compat import start_loopback_ray

LR = 0.05
TARGETS = {"client_vs_bare": 0.95, "shared_gpu_ratio": 0.9, "pipeline_ratio": 0.9}
FULL = {
    "models": [("densenet121", 224, 32), ("resnet20", 32, 128)], "steps": 20, "repeats": 5,
    "auc": {"model": "resnet20", "iterations": 600, "seeds": [0, 1, 2]},
    "shared": {"model": "resnet20", "size": 32, "batch": 128, "iterations": 400, "local_steps": 20,
               "samples": 2048},
    "pipeline": {"model": "densenet121", "size": 320, "batch": 32, "iterations": 160, "local_steps": 20,
                 "images": 640},
}
CPU = {  # the stand-in without a GPU: the same measurements at sizes a few CPU cores get through in minutes
    "models": [("densenet121", 32, 8), ("resnet20", 32, 32)], "steps": 5, "repeats": 3,
    "auc": {"model": "cnn", "model_width": 16, "iterations": 100, "seeds": [0, 1]},
    "shared": {"model": "cnn", "size": 32, "batch": 32, "iterations": 80, "local_steps": 10, "samples": 512},
    "pipeline": {"model": "cnn", "size": 64, "batch": 16, "iterations": 80, "local_steps": 10, "images": 256},
}
QUICK = {  # the test suite's: every path once, figures meaningless
    "models": [("densenet121", 32, 2), ("resnet20", 8, 8)], "steps": 1, "repeats": 1,
    "auc": {"model": "cnn", "model_width": 8, "iterations": 20, "seeds": [0]},
    "shared": {"model": "cnn", "size": 8, "batch": 8, "iterations": 4, "local_steps": 1, "samples": 32},
    "pipeline": {"model": "cnn", "size": 32, "batch": 4, "iterations": 4, "local_steps": 1, "images": 48},
}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- 1. client vs bare loop ---------------------------------------------------------------------------
def client_vs_bare(model: str, size: int, batch: int, precision: str, device: torch.device, *, steps: int,
                   repeats: int) -> dict:
    """samples/s of a client's rounds and of the bare loop, alternating blocks of ``steps`` steps."""
    shape = (3, size, size)
    x, y = make_data(max(4 * batch, 256), shape)
    cfg = build_config(dataset="arrays", num_clients=1, model=model, batch_size=batch, algorithm="codasca",
                       objective="auc_margin", lr=LR, prox_weight=0.002, executor="inline", precision=precision)
    client = Client(cfg, ArraysSource([(x, y)], (x[:8], y[:8])), 0, device=device)
    client.configure(np.array([0.2]))
    state = client.flat.initial_state()
    state.c_v, state.c_alpha = np.zeros_like(state.v), np.zeros_like(state.alpha)
    client.begin_stage(state.v.copy(), True)
    bare = BareLoop(model, shape, x, y, batch, seed=cfg.seed, device=device, precision=precision,
                    channels_last=client.flat.precision.channels_last)
    plan = RoundPlan(round=1, stage=1, steps=steps, lr=LR, iteration=0)
    for _ in range(1 if steps == 1 else 2):  # warm-up (cuDNN autotuning, allocator) on both
        client.local_round(state, plan)
        bare.run(steps)
    ours, theirs = [], []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        client.local_round(state, plan)  # waits for its steps (it reads the loss)
        ours.append(steps * batch / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        bare.run(steps)  # synchronises on a GPU
        theirs.append(steps * batch / (time.perf_counter() - t0))
    o, t = statistics.median(ours), statistics.median(theirs)
    return {"model": model, "size": size, "batch": batch, "precision": precision,
            "channels_last": client.flat.precision.channels_last, "client": o, "bare": t, "ratio": o / t}


# -- whole runs ---------------------------------------------------------------------------------------
def steady_rate(history: list[dict], samples_per_iteration: int) -> float:
    """samples/s between the run's last two evaluations (each record holds the cumulative rate)."""
    (i1, r1), (i2, r2) = [(h["iteration"], h["samples_per_s"]) for h in history[-2:]]
    s1, s2 = i1 * samples_per_iteration, i2 * samples_per_iteration
    return (s2 - s1) / (s2 / r2 - s1 / r1)


def run_rate(config: dict, source=None) -> tuple[float, dict]:
    cfg = build_config({**C.RUN_DEFAULTS, **config, "eval_every": config["iterations"] // 2})
    result = fdam_ray.run(cfg, source=source, save=False)
    return steady_rate(result.history, cfg.batch_size * cfg.num_clients), result.history[-1]


# -- 2. AUC of bf16 and fp32 ----------------------------------------------------------------------------
def auc_runs(spec: dict, device: torch.device) -> dict[str, list[float]]:
    out = {}
    for precision in ("fp32", "bf16"):
        out[precision] = []
        for seed in spec["seeds"]:
            cfg = build_config({**C.RUN_DEFAULTS, "dataset": "digits", "num_clients": 4, "model": spec["model"],
                                "model_width": spec.get("model_width", 32),
                                "iterations": spec["iterations"], "eval_every": spec["iterations"], "seed": seed,
                                "local_steps": 10, "batch_size": 32, "lr": 0.1, "device": device.type,
                                "precision": precision})
            out[precision].append(fdam_ray.run(cfg, save=False).history[-1]["test_auc"])
    return out


# -- 3. four clients sharing the GPU ------------------------------------------------------------------
def shared_gpu(spec: dict, device: torch.device) -> dict:
    shape = (3, spec["size"], spec["size"])
    cpus = max(1, (os.cpu_count() or 1))
    common = {"dataset": "arrays", "executor": "ray", "model": spec["model"],
              "batch_size": spec["batch"], "iterations": spec["iterations"], "local_steps": spec["local_steps"],
              "precision": "bf16", "lr": LR, "eval_on": "clients", "device": device.type}
    import ray

    started = not ray.is_initialized()
    if started:  # one local Ray for both runs (a run reuses the Ray of its process)
        start_loopback_ray(include_dashboard=False, log_to_driver=False,  # private, on 127.0.0.1
                           **({} if device.type == "cuda" else {"num_cpus": 4}))
    try:
        rows = {k: shared_run(k, spec, shape, common, device, cpus) for k in (1, 4)}
    finally:
        if started:
            ray.shutdown()
    return {"k1": rows[1], "k4": rows[4], "ratio": rows[4]["rate"] / rows[1]["rate"]}


def shared_run(k: int, spec: dict, shape: tuple, common: dict, device: torch.device, cpus: int) -> dict:
    """Aggregate samples/s of ``k`` clients sharing the device (a 1/k share each)."""
    data = [make_data(spec["samples"], shape, seed=i) for i in range(k)]
    test = make_data(64, shape, seed=99)
    if device.type == "cuda":
        share = {"gpus_per_client": 1.0 / k, "cpus_per_client": max(1, cpus // 4)}
    else:  # the CPU analogue: the same cores split k ways
        share = {"gpus_per_client": 0.0, "cpus_per_client": min(cpus, 2) / k}
    rate, _ = run_rate({**common, **share, "num_clients": k}, ArraysSource(data, test))
    return {"rate": rate, **share}


# -- 4. end to end on chest X-ray files -----------------------------------------------------------------
def write_chexpert_like(base: Path, n: int, seed: int = 0) -> Path:
    """A CheXpert-v1.0-small folder (the test fixtures' layout) with ``n`` frontal training images and a
    small valid split, every image a 320 x 390 JPEG."""
    from fdam_ray.data.chestxray_readers import READERS

    fx = _fixtures()
    rng = np.random.default_rng([seed, 3])
    train = [(p + 1, 1, "view1_frontal", True, tuple(map(_as_text, c)))
             for p, c in enumerate(_labels(rng, n, "chexpert", 0.05))]
    valid = [(64541 + p, 1, "view1_frontal", True, tuple(map(_as_text, c)))
             for p, c in enumerate(_labels(rng, 8, "chexpert", 0.0))]
    root = fx.write_chexpert(base, rows=train, valid_rows=valid)
    for path in READERS["chexpert"](root, official_test=True).paths:
        write_image(Path(path), rng, (320, 390))
    return root


def pipeline(spec: dict, device: torch.device, folder: Path) -> dict:
    root = write_chexpert_like(folder, spec["images"])
    common = {"num_clients": 1, "model": spec["model"], "image_size": spec["size"], "batch_size": spec["batch"],
              "iterations": spec["iterations"], "local_steps": spec["local_steps"], "precision": "bf16",
              "lr": LR, "device": device.type, "executor": "inline"}
    files, last = run_rate({**common, "dataset": "chestxray", "chestxray_sources": ["chexpert"],
                            "chestxray_chexpert_root": str(root), "chestxray_test_split": "official",
                            "data_workers": "auto"})
    from fdam_ray.data.base import loader_workers

    workers = loader_workers("auto")
    shape = (3, spec["size"], spec["size"])
    x, _ = make_data(spec["images"], shape)
    y = (np.random.default_rng(1).random((spec["images"], 5)) < 0.3).astype(np.float32)
    memory, _ = run_rate({**common, "dataset": "arrays"}, ArraysSource([(x, y)], (x[:32], y[:32])))
    return {"files": files, "memory": memory, "ratio": files / memory, "workers": workers,
            "test_auc": last["test_auc"]}


# -- report ---------------------------------------------------------------------------------------------
def fmt_rate(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def report(device: torch.device, args, m: dict) -> str:
    gpu = device.type == "cuda"
    where = device_name(device)
    note = ("" if gpu else "\n**These are CPU figures at small sizes, measured where no GPU was available: they "
            "show that the script and the code paths run and what they cost on this CPU, not a GPU's throughput. "
            "The GPU figures are still to be measured** (`python benchmarks/gpu_throughput.py` on a machine with "
            "a CUDA GPU).\n")
    pairs = m["pairs"]
    auc = m["auc"]
    sh, pl = m["shared"], m["pipeline"]
    shared_what = ("`gpus_per_client` 1 vs 0.25" if gpu else
                   f"`cpus_per_client` {sh['k1']['cpus_per_client']:g} vs {sh['k4']['cpus_per_client']:g}")
    auc_rows = [[p, ", ".join(f"{a:.4f}" for a in v), f"{np.mean(v):.4f}"] for p, v in auc.items()]
    return f"""
Device: {where}.
{note}
## 1. Client vs bare PyTorch loop

`Client.local_round` (CODASCA step: AUC-margin objective, proximal term, control-variate correction) and the
hand-written loop of `step_overhead.py` with the same model, batch, precision, memory format and device;
{args.repeats} alternating blocks of {args.steps} steps after a warm-up, medians. Target: ratio >= \
{TARGETS['client_vs_bare']}.

{C.table(["model", "input", "batch", "precision", "channels-last", "client samples/s", "bare samples/s", "ratio"],
         [[r["model"], f"{r['size']}x{r['size']}", r["batch"], r["precision"], "yes" if r["channels_last"] else "no",
           fmt_rate(r["client"]), fmt_rate(r["bare"]), f"{r['ratio']:.3f}"] for r in pairs])}

## 2. bf16 against fp32

Client speed-up on {pairs[0]['model']} (section 1): {m['bf16_speedup']:.2f}x. Final test AUC of short runs
(digits, {args.auc['model']}, K = 4, {args.auc['iterations']} iterations), one per seed:

{C.table(["precision", "AUC by seed", "mean"], auc_rows)}

## 3. Four clients sharing the device

Ray executor, {args.shared['model']} bf16 at {args.shared['size']}x{args.shared['size']}, batch \
{args.shared['batch']}, in-memory data; aggregate samples/s over the run's second half; {shared_what}.
Target: ratio >= {TARGETS['shared_gpu_ratio']}.

{C.table(["clients", "share each", "aggregate samples/s"],
         [[1, shared_what.split(" vs ")[0].split()[-1], fmt_rate(sh['k1']['rate'])],
          [4, shared_what.split(" vs ")[1], fmt_rate(sh['k4']['rate'])]])}

Ratio (4 sharing / 1 alone): {sh['ratio']:.3f}.

## 4. End to end on chest X-ray files

`fdam_ray.run` on {args.pipeline['images']} generated CheXpert-like 320 x 390 JPEGs, image_size \
{args.pipeline['size']}, {args.pipeline['model']} bf16, batch {args.pipeline['batch']}, `data_workers=auto` \
({pl['workers']} DataLoader workers here), against the same run on {args.pipeline['images']} in-memory images.
Target: ratio >= {TARGETS['pipeline_ratio']}.

{C.table(["input", "samples/s"], [["JPEG files, decoded per batch", fmt_rate(pl['files'])],
                                  ["in memory (training only)", fmt_rate(pl['memory'])]])}

Ratio: {pl['ratio']:.3f}. `python benchmarks/input_pipeline.py` gives the decode rate per worker.
"""


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test suite's run)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--skip", nargs="*", default=[], choices=("auc", "shared", "pipeline"),
                        help="leave sections out (their figures are then nan)")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/gpu_throughput.md)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    sizes = QUICK if args.quick else FULL if device.type == "cuda" else CPU
    for key, value in sizes.items():
        setattr(args, key, value)
    logging.getLogger("fdam_ray").setLevel(logging.WARNING)
    t0 = time.perf_counter()

    def done(what: str) -> None:
        print(f"  {what} done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    pairs = [client_vs_bare(model, size, batch, precision, device, steps=args.steps, repeats=args.repeats)
             for model, size, batch in args.models for precision in ("fp32", "bf16")]
    first = args.models[0][0]
    by = {(r["model"], r["precision"]): r for r in pairs}
    m: dict = {"pairs": pairs, "bf16_speedup": by[first, "bf16"]["client"] / by[first, "fp32"]["client"]}
    done("client vs bare")
    nan = math.nan
    m["auc"] = auc_runs(args.auc, device) if "auc" not in args.skip else {"fp32": [nan], "bf16": [nan]}
    done("AUC runs")
    m["shared"] = (shared_gpu(args.shared, device) if "shared" not in args.skip else
                   {"k1": {"rate": nan, "cpus_per_client": nan}, "k4": {"rate": nan, "cpus_per_client": nan},
                    "ratio": nan})
    done("shared device")
    if "pipeline" in args.skip:
        m["pipeline"] = {"files": nan, "memory": nan, "ratio": nan, "workers": 0, "test_auc": nan}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            m["pipeline"] = pipeline(args.pipeline, device, Path(tmp))
    done("end to end")
    body = report(device, args, m)
    out = Path(args.out) if args.out else C.RESULTS_DIR / "gpu_throughput.md"
    title = "GPU throughput" + ("" if device.type == "cuda" else " (CPU stand-in, small sizes)")
    C.write_results(out, title, C.command_line("gpu_throughput.py", argv), body)
    print(body.strip())
    line = C.result_line(client_vs_bare_densenet_bf16=by[first, "bf16"]["ratio"], bf16_speedup=m["bf16_speedup"],
                         shared_gpu_ratio=m["shared"]["ratio"], pipeline_ratio=m["pipeline"]["ratio"])
    print(line)
    return line


if __name__ == "__main__":
    main(sys.argv[1:])
