"""The fault lab: real faults injected into a real consortium and a real Ray cluster, each process on its own
address of netlab's shaped loopback network, and what each fault cost.

Two deployments, started here and stopped by pid:

- a consortium: a SuperLink (127.0.0.2) and three SuperNodes (127.0.0.3-5), TLS, node authentication, the
  sites bound to their keys (benchmarks/_lab_flower.py);
- a Ray cluster: a head (127.0.0.6) and three worker nodes (127.0.0.7-9), `fdam train` drivers joining it by
  address (benchmarks/_lab_ray.py).

Each fault is injected into a running study at a point drawn from ``--seed`` and the fault's name. For each,
the table gives the outcome (finished equal to the uninterrupted study bit for bit; finished equal to its
replay from the participation record; stopped with one line and resumed, then equal bit for bit), the time
lost against the uninterrupted study, and what was lost (a round counted twice, a metric row missing or
duplicated, a checkpoint older than the last completed round: benchmarks/_lab_common.py's audit)::

    python benchmarks/faults.py --netlab ../shared/netlab           # every fault (about 25 min on 2 cores)
    python benchmarks/faults.py --netlab ../shared/netlab --quick   # one of each deployment (a few minutes)
    python benchmarks/faults.py --netlab ../shared/netlab --soak 30 # the soak: studies and faults for 30 min

Needs root and tc (netlab shapes and cuts links on ``lo``), and fdam-ray's flower extra. Writes
benchmarks/results/faults.md (``--soak``: faults_soak.md) and ends with
``RESULT faults=N survived=N data_lost=N wall_s=S``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
from _lab_common import Fault

FLOWER_FAULTS = ("supernode_kill", "superlink_kill", "link_cut_short", "link_cut_long", "site_state_damaged")
RAY_FAULTS = ("raylet_kill", "driver_kill", "disk_full")
# by name only: what the default on_client_failure (retry) makes of a lost node (replaced clients: near, not equal)
BY_NAME = ("raylet_kill_retry",)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--netlab", required=True, help="netlab's folder (../shared/netlab)")
    p.add_argument("--quick", action="store_true", help="one fault of each deployment, shorter cuts")
    p.add_argument("--seed", type=int, default=0, help="draws each fault's point in its study (default 0)")
    p.add_argument("--faults", nargs="+", default=None, metavar="NAME",
                   help=f"only these faults: {', '.join(FLOWER_FAULTS + RAY_FAULTS + BY_NAME)}")
    p.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                   help="run the soak for this many minutes instead of the table")
    p.add_argument("--work", default=None, help="folder for the lab's files (default: a temporary one, removed)")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/faults.md)")
    args = p.parse_args(argv)
    known = FLOWER_FAULTS + RAY_FAULTS + BY_NAME
    unknown = sorted(set(args.faults or ()) - set(known))
    if unknown:
        p.error(f"--faults: unknown fault {unknown[0]!r} (known: {', '.join(known)})")
    if args.soak is not None and not 1 <= args.soak <= 240:
        p.error(f"--soak: {args.soak:g} minutes is not allowed (1 to 240)")
    return args


def preflight(netlab: Path) -> None:
    """One line and exit 2 when the lab cannot run here: not root, no tc, no netlab, no Flower."""
    problems = []
    if os.geteuid() != 0:
        problems.append("netlab shapes and cuts links with tc, which needs root")
    if shutil.which("tc") is None:
        problems.append("no `tc` on PATH")
    if not (netlab / "netcluster.py").is_file():
        problems.append(f"--netlab {netlab}: no netcluster.py there (give ../shared/netlab)")
    try:
        import flwr  # noqa: F401
    except ImportError:
        problems.append("Flower is not installed (pip install -e '.[flower]')")
    if problems:
        raise SystemExit(f"faults: cannot run the lab here: {'; '.join(problems)}")


def outcome_rows(faults: Sequence[Fault]) -> list[tuple[str, ...]]:
    """The results table's rows, one per fault."""
    rows = []
    for f in faults:
        diff = "" if f.max_diff is None else ("0" if f.max_diff == 0 else f"{f.max_diff:.1e}")
        outcome = f.outcome + (f" (\"{f.message}\")" if f.message else "")
        rows.append((f"`{f.name}`", f.what, f.at, outcome, "yes" if f.survived else "**no**",
                     f"{f.time_lost_s:+.1f}", "nothing" if not f.lost else "; ".join(f.lost), diff))
    return rows


def summary_line(faults: Sequence[Fault], wall_s: float) -> str:
    """``RESULT faults=N survived=N data_lost=N wall_s=S``; data_lost counts every item the audits found."""
    return C.result_line(faults=len(faults), survived=sum(f.survived for f in faults),
                         data_lost=sum(len(f.lost) for f in faults), wall_s=round(wall_s))


def table(faults: Sequence[Fault], baselines: dict[str, dict], wall_s: float, seed: int) -> str:
    body = C.table(["fault", "what", "injected at", "outcome", "survived", "time lost (s)", "lost",
                    "max |diff|"], outcome_rows(faults))
    base = [f"- {name}: {info.get('what', '')}; uninterrupted study {info.get('wall_s', float('nan')):.1f} s"
            + (f", its final state within {info['max_diff_vs_inline']:.1e} of the inline run"
               if info.get("max_diff_vs_inline") is not None else "") for name, info in baselines.items()]
    return (body + "\n\nThe uninterrupted studies each fault is measured against:\n\n" + "\n".join(base)
            + f"\n\nSeed {seed} (each fault's point: `_lab_common.seeded_point`); {len(faults)} faults, "
            f"{sum(f.survived for f in faults)} survived, {sum(len(f.lost) for f in faults)} items lost; "
            f"{wall_s:.0f} s wall in all.\n")


def run_table(args: argparse.Namespace, netlab: Path, work: Path) -> str:
    import _lab_flower
    import _lab_ray

    wanted = set(args.faults or FLOWER_FAULTS + RAY_FAULTS)
    start = time.monotonic()
    faults: list[Fault] = []
    baselines: dict[str, dict] = {}
    flower = [n for n in FLOWER_FAULTS if n in wanted]
    ray = [n for n in RAY_FAULTS + BY_NAME if n in wanted]
    if flower:
        info, got = _lab_flower.run_flower_faults(netlab, work / "flower", args.seed, quick=args.quick,
                                                  names=None if args.quick and not args.faults else flower,
                                                  progress=progress)
        baselines["consortium"], faults = info, faults + got
    if ray:
        info, got = _lab_ray.run_ray_faults(netlab, work / "ray", args.seed, quick=args.quick,
                                            names=None if args.quick and not args.faults else ray,
                                            progress=progress)
        baselines["Ray cluster"], faults = info, faults + got
    wall = time.monotonic() - start
    out = Path(args.out) if args.out else C.RESULTS_DIR / "faults.md"
    C.write_results(out, "The fault lab" + (" (quick)" if args.quick else ""),
                    C.command_line("faults.py", sys.argv[1:]), table(faults, baselines, wall, args.seed))
    line = summary_line(faults, wall)
    print(line)
    return line


def progress(text: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {text}", flush=True)


def main(argv: Sequence[str] | None = None) -> str:
    args = parse_args(argv)
    netlab = Path(args.netlab).resolve()
    preflight(netlab)
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="fdam-faults-"))
    try:
        if args.soak is not None:
            import _lab_soak

            return _lab_soak.soak(netlab, work, args, progress=progress)
        return run_table(args, netlab, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
