"""The in-process fault suite: every test marked ``fault`` (a process killed or signalled, a Ray node or a
cluster lost, a client's process replaced, a sweep stopped and resumed), run and tabled.

These tests inject real faults into real processes and take a minute or so each, so they are not part of the
default test run nor of ``pytest -m slow``; CI keeps one quick fault case in the slow tier
(``test_sigterm_stops_a_ray_run_the_same_way``) and this script runs the whole suite::

    python benchmarks/fault_tests.py            # every fault test (about 20 min on 2 CPU cores)
    python benchmarks/fault_tests.py --quick    # the three fastest: the suite's machinery, a few minutes

It writes one row per test (outcome, seconds) into benchmarks/results/fault_tests.md and ends with
``RESULT faults=N survived=N failed=N wall_s=S``: ``survived`` counts the tests that passed, each of which
asserts the fault was met as documented (stopped with one line and resumed, or recovered with nothing lost).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

ROOT = Path(__file__).resolve().parents[1]
# Three of the fastest fault tests (a few minutes together), for --quick: a client's data error mid-round under
# Ray, a Ray run stopped and resumed, and a collective member's process dying inside a run of rounds.
QUICK = ("(test_a_clients_data_error_mid_round_under_ray and classic) or test_a_ray_run_stopped_and_resumed or "
         "test_a_client_that_dies_inside_a_run")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="only the three fastest fault tests")
    p.add_argument("-k", dest="keyword", default=None, help="a pytest -k expression to pick tests")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/fault_tests.md)")
    return p.parse_args(argv)


def cases(report: Path) -> list[tuple[str, str, float]]:
    """(test id, outcome, seconds) of each test in a JUnit XML report, in the order they ran."""
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        rows.append((name, outcome, float(case.get("time", 0.0))))
    return rows


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    keyword = QUICK if args.quick else args.keyword
    out = Path(args.out) if args.out else C.RESULTS_DIR / "fault_tests.md"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "faults.xml"
        command = [sys.executable, "-m", "pytest", "-m", "fault", "-p", "no:cacheprovider", "-q",
                   f"--junitxml={report}", "tests"]
        if keyword:
            command[3:3] = ["-k", keyword]
        start = time.monotonic()
        done = subprocess.run(command, cwd=ROOT, check=False)
        wall = time.monotonic() - start
        if not report.exists():
            raise SystemExit(f"fault_tests: pytest wrote no report (exit {done.returncode}); see its output above")
        rows = cases(report)
    if not rows:
        raise SystemExit(f"fault_tests: no test is marked fault{' for -k ' + keyword if keyword else ''}")
    survived = sum(outcome == "passed" for _, outcome, _ in rows)
    failed = sum(outcome in ("failed", "error") for _, outcome, _ in rows)
    body = C.table(["fault test", "outcome", "seconds"], [(f"`{n}`", o, f"{s:.1f}") for n, o, s in rows])
    body += f"\n\n{len(rows)} fault tests, {survived} passed, {failed} failed, {wall:.0f} s wall in all.\n"
    C.write_results(out, "The in-process fault suite", C.command_line("fault_tests.py", argv), body)
    line = C.result_line(faults=len(rows), survived=survived, failed=failed, wall_s=round(wall, 1))
    print(line)
    return line


if __name__ == "__main__":
    main()
