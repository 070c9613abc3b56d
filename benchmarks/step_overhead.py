"""Time per local step inside ``Client.local_round`` against a bare PyTorch loop.

Both sides run the same network, minibatch size, thread count and math per
step (forward, AUC-margin objective, backward, primal step with the proximal
term and a control-variate correction, dual ascent with projection); the bare
loop does it the way one would write it by hand, over the parameter list with
``torch._foreach`` ops. Blocks of the two alternate so machine noise hits both
alike; the ratio is of the medians, and the range of the per-block ratios is
its noise. Target: the ratio at most 1.1 for every model.

    python benchmarks/step_overhead.py [--models cnn resnet20] [--steps 20] [--repeats 7]

Last line: ``RESULT step_ratio=... step_ratio_lo=... step_ratio_hi=... target_met=...`` (the model
with the largest ratio; target_met = 1 when every model's ratio is at most 1.1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import _common as C
import numpy as np
import torch

from fdam_ray.clients.client import Client
from fdam_ray.config import build_config
from fdam_ray.core.state import RoundPlan
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.models import build_model
from fdam_ray.objectives import Objective

LR, GAMMA = 0.05, 0.002
TARGET_RATIO = 1.1  # Client.local_round at most 10% slower per step than the bare loop


def make_data(n: int, shape: tuple[int, ...], seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    y = (rng.random(n) < 0.2).astype(np.float32)
    return x, y


class BareLoop:
    """A hand-written primal-dual loop over the parameter list (no flat buffers).

    ``device``, ``precision`` (fp32 or bf16: the forward pass under autocast, float32 logits to the objective)
    and ``channels_last`` (the whole model and its inputs in channels-last format, as one writes it by hand)
    set it up as a client with the same fields runs (benchmarks/gpu_throughput.py).
    """

    def __init__(self, model_name: str, shape, x, y, batch: int, seed: int, *, device: str | torch.device = "cpu",
                 precision: str = "fp32", channels_last: bool = False) -> None:
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"the bare loop runs fp32 or bf16, not {precision}")
        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if precision == "bf16" else None
        self.channels_last = channels_last
        self.model = build_model(model_name, shape, 1, seed=seed).to(self.device)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        dev = self.device
        self.a, self.b = torch.zeros(1, requires_grad=True, device=dev), torch.zeros(1, requires_grad=True, device=dev)
        self.alpha = torch.zeros(1, requires_grad=True, device=dev)
        self.params = [*self.model.parameters(), self.a, self.b]
        self.ref = [p.detach().clone() for p in self.params]
        self.corr = [torch.zeros_like(p) for p in self.params]  # c - c^k
        self.obj = Objective("auc_margin", num_tasks=1)
        self.obj.set_positive_ratio(0.2, device=dev)
        self.x, self.y = torch.from_numpy(x).to(dev), torch.from_numpy(y).reshape(-1, 1).to(dev)
        self.batch = batch
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.pos = torch.randperm(len(self.y), generator=self.gen), 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            if self.pos + self.batch > len(self.order):
                self.order, self.pos = torch.randperm(len(self.y), generator=self.gen), 0
            idx = self.order[self.pos : self.pos + self.batch].to(self.device)
            self.pos += self.batch
            for p in [*self.params, self.alpha]:
                p.grad = None
            loss = self.obj(self.forward(self.x[idx]), self.y[idx], self.a, self.b, self.alpha)
            loss.backward()
            with torch.no_grad():
                grads = [p.grad for p in self.params]
                d = torch._foreach_add(grads, torch._foreach_sub(self.params, self.ref), alpha=GAMMA)
                torch._foreach_add_(d, self.corr)
                torch._foreach_add_(self.params, d, alpha=-LR)
                self.alpha.add_(self.alpha.grad, alpha=LR).clamp_(min=0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.dtype is None:
            return self.model(x)
        with torch.autocast(self.device.type, dtype=self.dtype):
            return self.model(x).float()


def measure(model_name: str, shape, *, batch: int, steps: int, repeats: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    x, y = make_data(max(1024, 4 * batch), shape)
    cfg = build_config(dataset="arrays", num_clients=1, model=model_name, batch_size=batch, algorithm="codasca",
                       objective="auc_margin", lr=LR, prox_weight=GAMMA, executor="inline")
    client = Client(cfg, ArraysSource([(x, y)], (x[:64], y[:64])), 0, device=torch.device("cpu"))
    client.configure(np.array([0.2]))
    state = client.flat.initial_state()
    state.c_v, state.c_alpha = np.zeros_like(state.v), np.zeros_like(state.alpha)
    client.begin_stage(state.v.copy(), True)
    bare = BareLoop(model_name, shape, x, y, batch, seed=cfg.seed)
    plan = RoundPlan(round=1, stage=1, steps=steps, lr=LR, iteration=0)
    client.local_round(state, plan)  # warm-up both
    bare.run(steps)
    ours, theirs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        client.local_round(state, plan)
        ours.append((time.perf_counter() - t0) / steps)
        t0 = time.perf_counter()
        bare.run(steps)
        theirs.append((time.perf_counter() - t0) / steps)
    o, t = statistics.median(ours), statistics.median(theirs)
    blocks = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {"model": model_name, "params": client.flat.num_weights, "client_ms": 1e3 * o, "bare_ms": 1e3 * t,
            "ratio": o / t, "ratio_lo": min(blocks), "ratio_hi": max(blocks)}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet20"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/step_overhead.md)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    try:
        rows = [measure(m, (3, 32, 32), batch=args.batch, steps=args.steps, repeats=args.repeats,
                        threads=args.threads) for m in args.models]
    finally:
        torch.set_num_threads(threads)
    met = all(r["ratio"] <= TARGET_RATIO for r in rows)
    body = f"""
Inputs 3x32x32, batch {args.batch}, {args.threads} torch thread(s), CPU; {args.repeats} alternating blocks of \
{args.steps} steps; ms/step are medians over the blocks, ratio = client median / bare median, (lo..hi) the range \
of the blocks' own ratios. Target: ratio <= {TARGET_RATIO} for every model: {"met" if met else "not met"}.

{C.table(["model", "weights", "client ms/step", "bare loop ms/step", "ratio (lo..hi)"],
         [[r["model"], f"{r['params']:,}", f"{r['client_ms']:.2f}", f"{r['bare_ms']:.2f}",
           f"{r['ratio']:.3f} ({r['ratio_lo']:.3f}..{r['ratio_hi']:.3f})"] for r in rows])}
"""
    out = Path(args.out) if args.out else C.RESULTS_DIR / "step_overhead.md"
    C.write_results(out, "Step overhead: Client.local_round vs a bare PyTorch loop",
                    C.command_line("step_overhead.py", argv), body)
    print(body.strip())
    worst = max(rows, key=lambda r: r["ratio"])
    line = C.result_line(step_ratio=worst["ratio"], step_ratio_lo=worst["ratio_lo"], step_ratio_hi=worst["ratio_hi"],
                         client_ms=worst["client_ms"], bare_ms=worst["bare_ms"], target_met=int(met))
    print(f"worst model: {worst['model']}")
    print(line)
    return line


if __name__ == "__main__":
    main(sys.argv[1:])
