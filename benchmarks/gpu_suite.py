"""Every GPU check in one go: gpu_throughput's three figures and the collective round against a bare all-reduce.

    python benchmarks/gpu_suite.py                          # on a CUDA machine: the real figures, < 8 minutes
    python benchmarks/gpu_suite.py --quick --device cpu     # the test suite's run: every path once, on gloo

1. gpu_throughput.py (its functions, its sizes): a client against the bare PyTorch loop (DenseNet121 bf16,
   target >= 0.95), four clients sharing one GPU against one alone (aggregate samples/s, target >= 0.9) and
   the chest X-ray file pipeline against in-memory images (target >= 0.9); written to
   ``gpu_throughput.md``. Its bf16-vs-fp32 AUC runs are left out (no target, and they take minutes).
2. The collective round: K = 4 client actors sharing one GPU (``gpus_per_actor`` 0.25) run
   ``transport: collective`` on a state of N floats (DenseNet121's size); its round overhead (the round
   minus the slowest client's compute, as round_overhead.py measures it) against a bare
   ``torch.distributed`` all-reduce of N floats among 4 processes on the same GPU (target: at most 1.2x).
   The transport uses NCCL when every actor holds a GPU of its own and, run here with
   ``collective_backend: gloo``, gloo when actors share one (NCCL takes one rank per GPU and refuses a second
   rank on the same device; the default ``auto`` would reduce through host shared memory, which
   round_overhead.py measures); the bare reference tries NCCL first and, when NCCL refuses 4 ranks on one
   GPU, says so in the table and measures gloo, so both sides use the same backend. On the CPU
   (``--device cpu``) both use gloo.

3. The device block (``fdam_ray/executors/ray/transports/device_block.py``, the reduce of members that share one
   GPU through CUDA IPC handles): 4 processes on the device each reduce a partial sum of N floats (their slices
   summed in rank order into a result buffer every member reads) against a bare torch sum of the same 4 tensors
   in one process on the device (``a + b + c + d``, no processes, no barriers). Measured only on a CUDA
   device; elsewhere its figures are nan and its CPU equivalent (the same processes on CPU tensors shared
   through shared memory) runs and is tabled as such.

Writes ``gpu_suite.md`` (the card named, every table) and ``gpu_throughput.md`` into ``--out-dir``
(default benchmarks/results). Prints the time each part took.

Last line: ``RESULT client_vs_bare_densenet_bf16=... shared_gpu_ratio=... pipeline_ratio=... collective_ms=...
bare_allreduce_ms=... ratio_collective_bare=... collective_nccl=... bare_nccl=... device_block_ms=... bare_sum_ms=...
ratio_device_block_bare=...`` (the last three nan without a CUDA device)
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing
import socket
import statistics
import sys
import time
from pathlib import Path

import _common as C
import gpu_throughput as G
import numpy as np
import torch

from fdam_ray.clients.client import resolve_device
from fdam_ray.executors.base import ExecutorSetup

log = logging.getLogger(__name__)

COLLECTIVE_TARGET = 1.2  # the collective round at most this times the bare all-reduce among 4 processes
FULL = {"floats": 7_000_000, "clients": 4, "rounds": 10, "repeats": 3}
QUICK = {"floats": 20_000, "clients": 4, "rounds": 2, "repeats": 1}


def _bare_rank(rank: int, k: int, n: int, rounds: int, port: int, backend: str, device: str, results) -> None:
    """One rank of the bare reference: all-reduce N floats (on ``device``) and divide by K, per round."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", world_size=k, rank=rank,
                                timeout=datetime.timedelta(seconds=120))
        x = torch.zeros(n, dtype=torch.float32, device=device)
        times = []
        for r in range(2 + rounds):
            x += 1e-3
            if device != "cpu":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            x /= k
            if device != "cpu":
                torch.cuda.synchronize()
            if r >= 2:
                times.append(time.perf_counter() - t0)
        slowest = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            results.put(("ok", slowest.cpu().tolist()))
        dist.destroy_process_group()
    except Exception as exc:  # NCCL refusing ranks that share a GPU, typically
        results.put(("error", f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"))


def bare_allreduce(k: int, n: int, rounds: int, backend: str, device: str) -> dict:
    """The bare reference: K spawned processes all-reduce N floats with ``backend``; median ms, or the error."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_bare_rank, args=(r, k, n, rounds, port, backend, device, results))
             for r in range(k)]
    for proc in procs:
        proc.start()
    try:
        what, value = results.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if what == "error":
        return {"backend": backend, "error": value}
    return {"backend": backend, "ms": 1e3 * statistics.median(value)}


def _block_member(rank: int, k: int, n: int, rounds: int, port: int, device: str, results) -> None:
    """One member of the device block: reduce its partial sum of N floats, per round (after 2 warm-up rounds)."""
    import datetime

    import torch.distributed as dist

    from fdam_ray.executors.ray.transports.device_block import DeviceBlock

    torch.set_num_threads(1)
    block = DeviceBlock()
    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=120))
        block.open(store, rank, k, n, device, prefix="bench", timeout_s=120)
        block.slot.fill_(1e-3 * (rank + 1))
        times = []
        for r in range(2 + rounds):
            block.barrier()  # every member starts the round together
            t0 = time.perf_counter()
            block.reduce(block.slot)  # returns once every member's slice is written (device work waited for)
            if r >= 2:
                times.append(time.perf_counter() - t0)
        results.put(("ok", rank, times))
    except Exception as exc:
        results.put(("error", rank, f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"))
    finally:
        block.close()


def device_block_reduce(k: int, n: int, rounds: int, device: str) -> dict:
    """K spawned processes reduce N floats each through the device block on ``device``: the median over rounds
    of the slowest member's time (ms), or the error."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_block_member, args=(r, k, n, rounds, store.port, device, results))
             for r in range(k)]
    for proc in procs:
        proc.start()
    got = []
    try:
        for _ in range(k):
            got.append(results.get(timeout=300))
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    errors = [g[2] for g in got if g[0] == "error"]
    if errors:
        return {"error": errors[0]}
    slowest = [max(per) for per in zip(*(g[2] for g in got), strict=True)]
    return {"ms": 1e3 * statistics.median(slowest)}


def bare_sum(k: int, n: int, rounds: int, device: str) -> float:
    """The bare reference of the device block: K tensors of N floats on ``device`` summed in one process
    (``a + b``, then ``+= c``, ...), median ms over rounds."""
    parts = [torch.full((n,), 1e-3 * (r + 1), dtype=torch.float32, device=device) for r in range(k)]
    out = torch.empty(n, dtype=torch.float32, device=device)
    times = []
    for r in range(2 + rounds):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out.add_(p)
        if device != "cpu":
            torch.cuda.synchronize()
        if r >= 2:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def device_block_part(spec: dict, device: torch.device) -> dict:
    """Part 3: the device block against the bare sum; on a CUDA device its figures, else the CPU equivalent's
    (``cpu_*``, tabled only) and nan figures."""
    where = "cuda" if device.type == "cuda" else "cpu"
    block = device_block_reduce(spec["clients"], spec["floats"], 2 * spec["rounds"], where)
    bare_ms = bare_sum(spec["clients"], spec["floats"], 2 * spec["rounds"], where)
    block_ms = block.get("ms", math.nan)
    out = {"where": where, "block_ms": block_ms, "bare_ms": bare_ms, "error": block.get("error", "")}
    out["ratio"] = block_ms / bare_ms if bare_ms > 0 else math.nan
    return out


def collective_round(spec: dict, device: torch.device) -> dict:
    """The collective transport's round overhead with K clients sharing the device, median over blocks."""
    import ray
    from round_overhead import WideSource, executor_rounds

    from fdam_ray.algorithms import AlgorithmSection, build_algorithm
    from fdam_ray.clients.client import Replica
    from fdam_ray.config import build_config
    from fdam_ray.executors.ray.compat import start_loopback_ray
    from fdam_ray.executors.ray.executor import RayExecutor

    k, n = spec["clients"], spec["floats"]
    gpu = device.type == "cuda"
    share = {"gpus_per_actor": 1.0 / k, "cpus_per_actor": 1.0} if gpu else {"cpus_per_actor": 0.5}
    start_loopback_ray(include_dashboard=False, log_to_driver=False,
                       **({} if gpu else {"num_cpus": k}))  # listens on 127.0.0.1
    try:
        config = build_config(dict(dataset="arrays", num_clients=k, model="linear", algorithm="coda_plus",
                                   batch_size="full", local_steps=1, lr=0.01, executor="ray", eval_on="driver",
                                   transport="collective", collective_backend="gloo", device=device.type,
                                   **share))
        source = WideSource(k, n - 3)
        executor = RayExecutor()
        executor.start(ExecutorSetup.for_config(config, executor.section), source)
        try:
            state = Replica(config, source, device=torch.device("cpu")).flat.initial_state()
            executor.configure(np.array([0.5]))
            executor.begin_stage(state.v, True)
            algorithm = build_algorithm(AlgorithmSection.of(config))
            blocks = []
            for _ in range(spec["repeats"]):
                state, block = executor_rounds(executor, algorithm, state, spec["rounds"])
                blocks.append(block)
            backend = executor.transport.backend
            sent = executor.transport.rounds_sent
        finally:
            executor.shutdown()
    finally:
        ray.shutdown()
    over = [b["overhead_ms"] for b in blocks]
    return {"ms": statistics.median(over), "lo": min(over), "hi": max(over), "backend": backend, "sent": sent,
            "compute_ms": statistics.median(b["compute_ms"] for b in blocks)}


def throughput(quick: bool, device: torch.device, out_dir: Path) -> dict[str, float]:
    """gpu_throughput.py's three figures (its AUC runs left out), its tables written to ``out_dir``."""
    argv = [*(["--quick"] if quick else []), "--device", device.type, "--skip", "auc",
            "--out", str(out_dir / "gpu_throughput.md")]
    line = G.main(argv)
    return {k: float(v) for k, v in (item.split("=") for item in line.split()[1:])}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test suite's run)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--skip", nargs="*", default=[], choices=("throughput", "collective", "device_block"),
                        help="leave parts out (their figures are then nan)")
    parser.add_argument("--out-dir", default=None, help="where the tables go (default benchmarks/results)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    out_dir = Path(args.out_dir) if args.out_dir else C.RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = QUICK if args.quick else FULL
    logging.getLogger("fdam_ray").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    took = {}
    nan = math.nan
    figures = {"client_vs_bare_densenet_bf16": nan, "shared_gpu_ratio": nan, "pipeline_ratio": nan}
    if "throughput" not in args.skip:
        figures.update({k: v for k, v in throughput(args.quick, device, out_dir).items() if k in figures})
    took["throughput"] = time.perf_counter() - t0
    print(f"  gpu_throughput done at {took['throughput']:.0f} s", file=sys.stderr, flush=True)
    coll: dict = {"ms": nan, "lo": nan, "hi": nan, "backend": "-", "sent": 0, "compute_ms": nan}
    bare: dict = {"backend": "-", "ms": nan}
    refused = ""
    if "collective" not in args.skip:
        coll = collective_round(spec, device)
        where = "cuda" if device.type == "cuda" else "cpu"
        bare = bare_allreduce(spec["clients"], spec["floats"], spec["rounds"],
                              "nccl" if where == "cuda" else "gloo", where)
        if "error" in bare:
            refused = bare["error"]
            bare = bare_allreduce(spec["clients"], spec["floats"], spec["rounds"], "gloo", where)
    took["collective"] = time.perf_counter() - t0 - took["throughput"]
    print(f"  collective round done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    blk: dict = {"where": "-", "block_ms": nan, "bare_ms": nan, "ratio": nan, "error": ""}
    if "device_block" not in args.skip:
        blk = device_block_part(spec, device)
    took["device_block"] = time.perf_counter() - t0 - took["throughput"] - took["collective"]
    on_gpu = blk["where"] == "cuda"
    block_figures = {"device_block_ms": blk["block_ms"] if on_gpu else nan,
                     "bare_sum_ms": blk["bare_ms"] if on_gpu else nan,
                     "ratio_device_block_bare": blk["ratio"] if on_gpu else nan}
    if blk["where"] == "cpu":
        block_note = ("**The GPU figure is not measured: no CUDA device here.** The rows above are the CPU "
                      "equivalent (the same processes on CPU tensors in shared memory); they show that the path "
                      "runs, not what it costs on a GPU (`python benchmarks/gpu_suite.py` on a machine with a CUDA "
                      "GPU measures it). The RESULT line's device block figures are nan.")
        log.warning("device block: the GPU figure is not measured (no CUDA device); CPU equivalent %.2f ms "
                    "against a bare sum %.2f ms", blk["block_ms"], blk["bare_ms"])
    elif blk["where"] == "cuda":
        block_note = f"Device block / bare sum: {blk['ratio']:.2f}."
    else:
        block_note = "Left out (`--skip device_block`)."
    if blk["error"]:
        block_note += f" The device block failed: {blk['error']}."
    ratio = coll["ms"] / bare["ms"] if bare.get("ms") else nan
    card = G.device_name(device)
    note = ("" if device.type == "cuda" else "\n**CPU figures at small sizes, measured where no GPU was available: "
            "they show that every path of the suite runs, not a GPU's figures. The GPU figures are still to be "
            "measured** (`python benchmarks/gpu_suite.py` on a machine with a CUDA GPU).\n")
    refused_line = f"\nNCCL with 4 ranks on one GPU: {refused}. The bare reference below is gloo.\n" if refused else ""
    body = f"""
Device: {card}.
{note}
## 1. gpu_throughput.py

Tables in `gpu_throughput.md` (same run). Figures: DenseNet121 bf16 client / bare loop \
{figures['client_vs_bare_densenet_bf16']:.3f} (target >= {G.TARGETS['client_vs_bare']}); four clients \
sharing the device / one alone {figures['shared_gpu_ratio']:.3f} (target >= {G.TARGETS['shared_gpu_ratio']}); \
chest X-ray files / in memory {figures['pipeline_ratio']:.3f} (target >= {G.TARGETS['pipeline_ratio']}).

## 2. The collective round against a bare all-reduce

K = {spec['clients']} client actors sharing the device, `transport: collective`, a state of {spec['floats']:,} \
floats; {spec['repeats']} blocks of {spec['rounds']} rounds after 2 warm-up rounds; overhead = round minus the \
slowest client's compute, median over blocks (lo..hi). Bare = {spec['clients']} spawned processes all-reduce \
{spec['floats']:,} floats on the same device and divide by K (the slowest rank's time).
{refused_line}
{C.table(["what", "backend", "ms (lo..hi)"],
         [["collective round overhead", coll["backend"], f"{coll['ms']:.1f} ({coll['lo']:.1f}..{coll['hi']:.1f})"],
          ["bare all-reduce", bare["backend"], f"{bare.get('ms', nan):.1f}"]])}

Collective / bare: {ratio:.2f} (target <= {COLLECTIVE_TARGET}: {"met" if ratio <= COLLECTIVE_TARGET else "not met"}). \
Rounds that sent the state to the actors: {coll['sent']} (the first; the actors keep their copy after it).

## 3. The device block against a bare sum on the device

K = {spec['clients']} processes on the device ({blk['where']}), each reducing a partial sum of \
{spec['floats']:,} floats through the device block (its slice of the K sums in rank order, two barriers); \
median over {2 * spec['rounds']} rounds after 2 warm-up rounds of the slowest member's time. Bare = the same K \
tensors summed on the device in one process.

{C.table(["what", "device", "ms"],
         [["device block reduce", blk['where'], f"{blk['block_ms']:.3f}"],
          ["bare torch sum", blk['where'], f"{blk['bare_ms']:.3f}"]])}

{block_note}

Time taken: gpu_throughput {took['throughput']:.0f} s, collective {took['collective']:.0f} s, \
device block {took['device_block']:.0f} s, \
total {time.perf_counter() - t0:.0f} s.
"""
    C.write_results(out_dir / "gpu_suite.md", "GPU suite" + ("" if device.type == "cuda" else " (CPU stand-in)"),
                    C.command_line("gpu_suite.py", argv), body)
    print(body.strip())
    line = C.result_line(**figures, collective_ms=coll["ms"], bare_allreduce_ms=bare.get("ms", nan),
                         ratio_collective_bare=ratio, collective_nccl=float(coll["backend"] == "nccl"),
                         bare_nccl=float(bare["backend"] == "nccl"), **block_figures)
    print(line)
    return line


if __name__ == "__main__":
    main(sys.argv[1:])
