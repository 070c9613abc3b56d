"""Checks for a machine with a CUDA GPU: the GPU paths run, and give what the CPU gives.

    python benchmarks/gpu_check.py [--iterations 400] [--out benchmarks/results/gpu_check.md]
    python benchmarks/gpu_check.py --allow-cpu      # the same script on a machine without a GPU

1. Inline executor, ``device=cuda`` against ``device=cpu``, same config (CODASCA,
   digits-IH, K=4, small CNN): final test AUC and the largest difference in the
   global state (GPU kernels round differently, so close rather than equal).
2. ``device=cuda deterministic=true``: two runs are bit-identical, and a run
   stopped at half its iterations and resumed ends bit-identical to one that
   was not stopped.
3. Ray executor, K=4 actors with ``gpus_per_actor=0.25`` (four clients share
   one GPU): every actor got exactly one Ray GPU id, the same one for all
   four, trains on ``cuda:0`` and reads a CUDA memory fraction equal to its
   share (on the CPU stand-in: no GPU ids, no fraction); with
   ``deterministic=true fold_order=client`` its final state equals the inline
   GPU run's.
4. Throughput of resnet20 on CIFAR-shaped arrays (K=4, batch 64), inline,
   CPU against GPU: samples per second of local training.

Last line: ``RESULT cpu_gpu_auc_diff=... deterministic_repeat=1 resume_identical=1 ray_actors_placed=1
ray_vs_inline_max_diff=... speedup_resnet20=...`` (1 = the check holds).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import result_line, table, write_results

from fdam_ray import resume, run, train_arrays
from fdam_ray.config import build_config
from fdam_ray.executors import make_executor
from fdam_ray.executors.ray.compat import start_loopback_ray


def base(iterations: int, **kw):
    values = dict(dataset="digits", num_clients=4, model="cnn", iterations=iterations, local_steps=8,
                  batch_size=32, eval_every=iterations, executor="inline", tensorboard=False, seed=0,
                  threads_per_actor=1)  # the same CPU reductions in the driver (inline) and in actors
    values.update(kw)
    return build_config(values)


def max_diff(a, b) -> float:
    return float(np.max(np.abs(a.state.v.astype(np.float64) - b.state.v)))


def identical(a, b) -> bool:
    return bool(np.array_equal(a.state.v, b.state.v) and np.array_equal(a.state.alpha, b.state.alpha)
                and np.array_equal(a.state.buffers, b.state.buffers))


def sharing_ok(where: dict, gpu: str, share: float, clients: int = 4) -> bool:
    """Whether the ``clients`` actors' placement (``executor.client_info()``) is what sharing one GPU means.

    On a GPU: every actor on ``cuda:0`` with exactly one Ray GPU id, the same for all, and a CUDA memory
    fraction equal to ``share``. On the CPU stand-in: every actor on the CPU, with no GPU id and no fraction.
    """
    if len(where) != clients:
        return False
    info = list(where.values())
    if gpu == "cuda":
        ids = {tuple(w["gpu_ids"]) for w in info}
        return (all(w["device"] == "cuda:0" for w in info) and len(ids) == 1 and len(next(iter(ids))) == 1
                and all(w["cuda_memory_fraction"] is not None and abs(w["cuda_memory_fraction"] - share) < 1e-6
                        for w in info))
    return all(w["device"] == "cpu" and not w["gpu_ids"] and w["cuda_memory_fraction"] is None for w in info)


def throughput(device: str, iterations: int) -> float:
    rng = np.random.default_rng(0)
    clients = [(rng.standard_normal((512, 3, 32, 32)).astype(np.float32),
                (rng.random(512) < 0.2).astype(np.float32)) for _ in range(4)]
    test = (rng.standard_normal((256, 3, 32, 32)).astype(np.float32), (rng.random(256) < 0.5).astype(np.float32))
    cfg = dict(model="resnet20", batch_size=64, local_steps=10, iterations=iterations, eval_every=iterations,
               executor="inline", device=device, tensorboard=False, threads_per_actor=os.cpu_count())
    train_arrays(cfg, clients, test)  # warm-up: CUDA context, cuDNN autotuning, allocator
    return train_arrays(cfg, clients, test).summary["samples_per_s"]


def main(argv: list[str] | None = None) -> str:
    # the checks switch deterministic kernels and thread counts for this process: undo that for a caller
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        return checks(argv)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def checks(argv: list[str] | None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--speed-iterations", type=int, default=60)
    parser.add_argument("--out", help="results file (default on a GPU: benchmarks/results/gpu_check.md; "
                        "on the CPU: none)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU where no GPU is visible")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        gpu, name = "cuda", torch.cuda.get_device_name(0)
    elif args.allow_cpu:
        gpu, name = "cpu", "none (CPU stand-in)"
    else:
        sys.exit("gpu_check: no CUDA GPU is visible (use --allow-cpu to run the checks on the CPU)")
    n = args.iterations
    rows: list[tuple[str, str, str]] = []

    # 1. CPU against GPU
    cpu = run(base(n, device="cpu"), save=False)
    gpu_run = run(base(n, device=gpu), save=False)
    auc_cpu, auc_gpu = cpu.summary["final_test_auc"], gpu_run.summary["final_test_auc"]
    auc_diff, state_diff = abs(auc_cpu - auc_gpu), max_diff(cpu, gpu_run)
    rows.append(("inline, CPU vs GPU", f"test AUC {auc_cpu:.4f} (CPU) vs {auc_gpu:.4f} (GPU), "
                 f"abs. difference {auc_diff:.4f}; largest state difference {state_diff:.2e}",
                 "yes" if auc_diff <= 0.01 else "NO"))

    # 2. deterministic repeats and resume
    det = run(base(n, device=gpu, deterministic=True), save=False)
    again = run(base(n, device=gpu, deterministic=True), save=False)
    with tempfile.TemporaryDirectory() as tmp:
        half = run(base(n // 2, device=gpu, deterministic=True, out_dir=tmp, run_name="half"), save=True)
        resumed = resume(half.run_dir, {"iterations": n})
    repeat_ok, resume_ok = identical(det, again), identical(det, resumed)
    rows.append(("deterministic=true, two runs", "bit-identical" if repeat_ok else
                 f"differ (by up to {max_diff(det, again):.2e})", "yes" if repeat_ok else "NO"))
    rows.append(("deterministic=true, stopped at half and resumed", "bit-identical to the uninterrupted run"
                 if resume_ok else f"differs (by up to {max_diff(det, resumed):.2e})", "yes" if resume_ok else "NO"))

    # 3. Ray actors sharing the GPU
    import ray

    start_loopback_ray(num_cpus=8, num_gpus=1 if gpu == "cuda" else 0, include_dashboard=False,
                       log_to_driver=False, configure_logging=False)  # listens on 127.0.0.1
    share = 0.25 if gpu == "cuda" else 0.0
    executor = make_executor("ray")
    seen: list[dict] = []
    ray_run = run(base(n, device=gpu, executor="ray", gpus_per_actor=share, cpus_per_actor=1,
                       deterministic=True, fold_order="client"), executor=executor, save=False,
                  on_eval=lambda _: seen.append(executor.client_info()) if not seen else None)
    ray.shutdown()
    where = seen[0] if seen else {}
    devices = sorted({w["device"] for w in where.values()})
    fractions = sorted({w["cuda_memory_fraction"] for w in where.values()}, key=str)
    gpu_ids = [w["gpu_ids"] for _, w in sorted(where.items())]
    ray_diff = max_diff(det, ray_run)
    placed = sharing_ok(where, gpu, share)
    rows.append(("Ray, 4 actors x 0.25 GPU", f"devices {devices}, Ray GPU ids {gpu_ids}, CUDA memory fraction "
                 f"{fractions}", "yes" if placed else "NO"))
    rows.append(("Ray vs inline (deterministic, fold_order=client)", f"largest state difference {ray_diff:.2e}",
                 "yes" if ray_diff <= 1e-6 else "NO"))

    # 4. throughput
    cpu_speed = throughput("cpu", args.speed_iterations)
    gpu_speed = throughput(gpu, args.speed_iterations)
    rows.append(("resnet20 throughput, K=4, batch 64", f"{cpu_speed:.0f} samples/s (CPU, {os.cpu_count()} "
                 f"threads) vs {gpu_speed:.0f} samples/s (GPU): {gpu_speed / cpu_speed:.1f}x", "-"))

    command = f"python benchmarks/gpu_check.py --iterations {n} --speed-iterations {args.speed_iterations}"
    body = (f"On {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, Ray {ray.__version__}.\n\n"
            + table(["check", "measured", "as expected"], rows))
    print(f"# GPU checks ({name})\n\nCommand: `{command}`\n\n{body}\n")
    out = args.out or (str(Path(__file__).parent / "results" / "gpu_check.md") if gpu == "cuda" else None)
    if out:
        write_results(Path(out), f"GPU checks ({name})", command, body)
    return result_line(cpu_gpu_auc_diff=auc_diff, deterministic_repeat=int(repeat_ok), resume_identical=int(resume_ok),
                       ray_actors_placed=int(placed), ray_vs_inline_max_diff=ray_diff,
                       speedup_resnet20=gpu_speed / cpu_speed)

if __name__ == "__main__":
    print(main())
