"""Reference runs and the hashes of their final global states: a refactor that keeps every result keeps them.

A matrix of small runs, one per way a round can be computed: every algorithm and objective inline, client
sampling and sample weights, momentum, 16-bit transfers with and without error feedback, the geometric
schedule, hosting several clients per actor, the Ray executor under each transport (classic star and node
reduction in client order, compiled, collective), a deadline no client misses (replays are pinned bit for bit
by tests/features/test_stragglers.py), and Flower's in-process grid (where Flower is installed). Each run's final state
vectors (v, alpha, buffers, counters, c_v, c_alpha), its round and iteration, and its evaluation AUCs are
hashed (SHA-256). ``benchmarks/results/reference_hashes.json`` is the record of the current code.

    python benchmarks/reference_hashes.py --out hashes.json                 # record
    python benchmarks/reference_hashes.py --compare hashes.json             # check against a record
    python benchmarks/reference_hashes.py --only inline --compare h.json    # a part of the matrix
    python benchmarks/reference_hashes.py --compare benchmarks/results/reference_hashes.json \
        --table benchmarks/results/reference_hashes.md                       # and the table of this run

Ray runs use fold_order=client (arrival order folds are equal only to float32 rounding). Last line:
``RESULT runs=N same=S changed=C new=M`` (same/changed/new only with --compare).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

BASE: dict[str, Any] = dict(model="mlp", model_width=8, batch_size=8, seed=3, local_steps=3, iterations=24, lr=0.2,
                            global_lr=1.3, prox_weight=0.01, stage_length=9, eval_every=6, tensorboard=False,
                            executor="inline")
RAY: dict[str, Any] = dict(executor="ray", fold_order="client", cpus_per_actor=0.25)


def clients_and_test(num_clients: int = 4, n: int = 40, d: int = 5, seed: int = 0):
    """Heterogeneous Gaussian clients (different sizes and prevalences) and a test set."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(d)
    out = []
    for k in range(num_clients):
        m = n + 8 * k
        n_pos = max(2, m // 4 + k)
        y = np.r_[np.ones(n_pos), np.zeros(m - n_pos)]
        x = rng.standard_normal((m, d)) + np.outer(2 * y - 1, u) * 0.8 + rng.standard_normal(d)
        out.append((x.astype(np.float32), y.astype(np.float32)))
    yt = np.r_[np.ones(40), np.zeros(60)]
    xt = (rng.standard_normal((100, d)) + np.outer(2 * yt - 1, u) * 0.8).astype(np.float32)
    return out, (xt, yt.astype(np.float32))


def cases() -> dict[str, dict[str, Any]]:
    inline = {f"inline/{a}": dict(algorithm=a) for a in
              ("codasca", "coda_plus", "coda", "fedavg", "scaffold", "fedprox", "fedprox_auc")}
    inline.update({
        "inline/npa": dict(algorithm="npa", local_steps=1),
        "inline/centralized": dict(algorithm="centralized", num_clients=1),
        "inline/codasca-margin": dict(algorithm="codasca", objective="auc_margin"),
        "inline/codasca-sampled-weighted": dict(algorithm="codasca", clients_per_round=2,
                                                client_weighting="samples"),
        "inline/scaffold-sampled": dict(algorithm="scaffold", clients_per_round=3),
        "inline/codasca-momentum": dict(algorithm="codasca", momentum=0.9),
        "inline/codasca-geometric": dict(algorithm="codasca", schedule="geometric", rounds_per_stage=3,
                                         stage_growth=2),
        "inline/codasca-bf16": dict(algorithm="codasca", transfer_precision="bf16"),
        "inline/codasca-bf16-ef-sampled": dict(algorithm="codasca", transfer_precision="bf16", error_feedback=True,
                                               clients_per_round=3),
        "inline/coda_plus-fp16": dict(algorithm="coda_plus", transfer_precision="fp16"),
        "inline/codasca-hosted": dict(algorithm="codasca", clients_per_actor=2),
    })
    ray = {
        "ray/classic-star": dict(algorithm="codasca"),
        "ray/classic-star-sampled-weighted": dict(algorithm="codasca", clients_per_round=2,
                                                  client_weighting="samples"),
        "ray/classic-hosted": dict(algorithm="codasca", clients_per_actor=2),
        "ray/classic-node": dict(algorithm="codasca", reduce="node"),
        "ray/classic-bf16-ef": dict(algorithm="codasca", transfer_precision="bf16", error_feedback=True),
        "ray/classic-deadline": dict(algorithm="codasca", round_deadline=600),
        "ray/compiled": dict(algorithm="codasca", transport="compiled"),
        "ray/collective": dict(algorithm="codasca", transport="collective"),
        "ray/collective-sampled": dict(algorithm="scaffold", transport="collective", clients_per_round=3),
    }
    return {**{k: {**BASE, **v} for k, v in inline.items()}, **{k: {**BASE, **RAY, **v} for k, v in ray.items()}}


def state_hash(state: Any, history: list[dict]) -> str:
    h = hashlib.sha256()
    for name, x in sorted(state.vectors().items()):
        h.update(name.encode())
        if x is None:
            h.update(b"none")
        else:
            a = np.ascontiguousarray(x)
            h.update(str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
    h.update(f"{state.round}/{state.iteration}".encode())
    h.update(json.dumps([h_.get("test_auc") for h_ in history]).encode())
    return h.hexdigest()


def run_case(name: str, config: dict[str, Any], folder: Path) -> str:
    import fdam_ray

    clients, test = clients_and_test(num_clients=config.pop("num_clients", 4))
    result = fdam_ray.train_arrays(config, clients, test, save=False)
    return state_hash(result.state, result.history)


def run_flower(folder: Path, case: dict[str, Any]) -> str | None:
    try:
        from fdam_ray.flower.client_app import app as client_app
        from fdam_ray.flower.inprocess import InProcessGrid, server_context
        from fdam_ray.flower.server_app import run_federation
    except ImportError:
        return None
    clients, test = clients_and_test(num_clients=3)
    for k, (x, y) in enumerate(clients):
        np.savez(folder / f"site{k}.npz", x=x, y=y)
    np.savez(folder / "test.npz", x=test[0], y=test[1])
    nodes = [{"site": k, "data": str(folder / f"site{k}.npz")} for k in range(3)]
    result = run_federation(InProcessGrid(client_app, nodes), server_context(),
                            {**case, "num_clients": 3, "flower": {"test_data": str(folder / "test.npz")}})
    return state_hash(result.state, result.history)


FLOWER = {"flower/codasca": dict(BASE, model="linear", algorithm="codasca"),
          "flower/codasca-sampled-weighted": dict(BASE, model="linear", algorithm="codasca", clients_per_round=2,
                                                  client_weighting="samples")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the hashes here (JSON)")
    parser.add_argument("--compare", help="a JSON file of hashes to compare with")
    parser.add_argument("--only", nargs="*", default=None, help="name prefixes to run (inline, ray, flower, ...)")
    parser.add_argument("--table", help="write this run's table (Markdown, between the results markers) here")
    args = parser.parse_args(argv)
    work: dict[str, Callable[[Path], str | None]] = {}
    for name, config in cases().items():
        work[name] = lambda folder, n=name, c=config: run_case(n, dict(c), folder)
    for name, config in FLOWER.items():
        work[name] = lambda folder, c=config: run_flower(folder, dict(c))
    if args.only:
        work = {k: v for k, v in work.items() if any(k.startswith(p) for p in args.only)}
    known = json.loads(Path(args.compare).read_text()) if args.compare else {}
    got: dict[str, str] = {}
    rows = ["| run | hash (first 16 hex digits) | against the record | seconds |", "|---|---|---|---|"]
    same = changed = new = 0
    for name, fn in work.items():
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            digest = fn(Path(tmp))
        if digest is None:
            print(f"{name:40s} skipped (Flower not installed)", flush=True)
            continue
        got[name] = digest
        verdict = ""
        if args.compare:
            if name not in known:
                verdict, new = "new", new + 1
            elif known[name] == digest:
                verdict, same = "same", same + 1
            else:
                verdict, changed = "CHANGED", changed + 1
        seconds = time.perf_counter() - started
        print(f"{name:40s} {digest[:16]}  {verdict:8s} {seconds:6.1f} s", flush=True)
        rows.append(f"| {name} | `{digest[:16]}` | {verdict or '-'} | {seconds:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    result = f"RESULT runs={len(got)} same={same} changed={changed} new={new}"
    if args.table:
        from _common import write_results

        command = "python benchmarks/reference_hashes.py " + " ".join(sys.argv[1:] if argv is None else argv)
        write_results(Path(args.table), "Reference runs: hashes of their final states", command,
                      "\n".join([*rows, "", result]))
    print(result)
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
