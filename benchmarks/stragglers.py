"""One slow client among fast ones: round time with and without ``round_deadline``.

Three settings on the Ray executor (classic transport, reduce star), K clients on a tiny MLP, each client's
round made to last about ``--step-s`` per local step by reading its samples slowly (no network needed); one
client ``--slow``x slower:

    no slow client, no deadline      the reference round time
    slow client, no deadline         the round waits for the slow client
    slow client, round_deadline      the round goes on without it (deadline = --deadline x the median client)

Prints the table and, last, ``RESULT straggler_ratio_deadline=... straggler_ratio_none=...`` (round times over
the reference); writes benchmarks/results/stragglers.md.

    python benchmarks/stragglers.py            (about a minute)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import _common as C
import raytest
from sample_clients import gaussian_clients

from fdam_ray.config import build_config
from fdam_ray.core.state import RoundPlan
from fdam_ray.data.arrays import ArraysSource
from fdam_ray.executors.base import ExecutorSetup
from fdam_ray.executors.ray.executor import RayExecutor

RESULTS = Path(__file__).resolve().parent / "results" / "stragglers.md"


class EverySlow(raytest.SlowClientSource):
    """Every client reads its samples slowly (a round of compute); client ``slow`` ``factor`` times slower."""

    def __init__(self, inner, slow: int | None, delay_s: float, factor: float) -> None:
        super().__init__(inner, -1, delay_s)
        self.slow_client, self.factor, self.base = slow, factor, delay_s

    def client_shard(self, client_id: int):
        self.slow = client_id
        self.delay_s = self.base * (self.factor if client_id == self.slow_client else 1.0)
        return super().client_shard(client_id)


def round_times(clients, test, slow: int | None, deadline, args) -> list[float]:
    batch = 4
    source = EverySlow(ArraysSource(clients, test), slow, args.step_s / batch, args.slow)
    config = build_config(dict(model="mlp", model_width=8, batch_size=batch, seed=0, local_steps=args.steps,
                               dataset="arrays", num_clients=len(clients), executor="ray", cpus_per_actor=0.5,
                               threads_per_actor=1, round_deadline=deadline))
    times = []
    with RayExecutor() as ex:
        ex.start(ExecutorSetup.for_config(config, ex.section), source)
        state = raytest.first_state(ex, config, source)
        for r in range(1, args.rounds + 2):
            t0 = time.monotonic()
            ex.run_round(state, RoundPlan(r, 1, args.steps, 0.05, (r - 1) * args.steps, partial=True),
                         lambda partial: None)
            if r > 1:  # the first round warms up
                times.append(time.monotonic() - t0)
    return times


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="local steps per round")
    parser.add_argument("--step-s", type=float, default=0.05, help="seconds per local step of a fast client")
    parser.add_argument("--slow", type=float, default=6.0, help="how many times slower the slow client is")
    parser.add_argument("--deadline", default="1.2x", help="round_deadline of the third setting")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/stragglers.md)")
    args = parser.parse_args(argv)
    clients, test = gaussian_clients(num_clients=args.clients)
    rows = []
    with raytest.ray_session(num_cpus=max(4, args.clients)):
        for name, slow, deadline in (("no slow client, no deadline", None, None),
                                     ("slow client, no deadline", 0, None),
                                     (f"slow client, round_deadline={args.deadline}", 0, args.deadline)):
            times = round_times(clients, test, slow, deadline, args)
            rows.append((name, statistics.median(times)))
            print(f"  {name}: {rows[-1][1]:.3f} s a round", file=sys.stderr, flush=True)
    ref = rows[0][1]
    table = C.table(["setting", "median round (s)", "/ no slow client"],
                    [[name, f"{t:.3f}", f"{t / ref:.2f}"] for name, t in rows])
    body = (f"\n{args.clients} clients, {args.steps} local steps of about {args.step_s} s (the slow client "
            f"{args.slow:g}x), median of {args.rounds} rounds, classic transport, reduce star.\n\n{table}\n\n"
            "A network's slow site, measured on a shaped multi-node cluster: `benchmarks/node_reduce.py --netlab` "
            "(benchmarks/results/node_reduce.md).\n")
    C.write_results(Path(args.out) if args.out else RESULTS, "One slow client among fast ones",
                    C.command_line("stragglers.py", argv), body)
    print(table)
    line = C.result_line(straggler_ratio_deadline=rows[2][1] / ref, straggler_ratio_none=rows[1][1] / ref)
    print(line)
    return line


if __name__ == "__main__":
    main()
