"""The fault lab's soak: the lab's consortium and Ray cluster kept up for ``--soak`` minutes, studies back to back
with a fault in each, and what their long-lived processes hold sampled all along.

The consortium (benchmarks/_lab_flower.py: a SuperLink on 127.0.0.2 and three SuperNodes on 127.0.0.3-5, TLS, node
authentication) runs the lab's six-round CODASCA again and again, each study with one fault at a point drawn from
the study's number, in turn: a site's links cut for 15 s mid-round (healed), site 2's SuperNode SIGKILLed mid-round
and started again, or site 2's SuperNode SIGKILLed between rounds with its state file damaged (it rejoins rebuilt,
recorded and replayed). A study the server stops in one line is resumed from its folder. Between two studies the
Ray cluster (benchmarks/_lab_ray.py: a head on 127.0.0.6, workers on 127.0.0.7-9) runs the lab's twelve-round study
whose driver is SIGKILLed mid-round and resumed. So a fault every six to twelve rounds. Every study is judged as
the table's are (bit for bit, or its replay; nothing lost). Every 10 s the resident memory and open file
descriptors of the SuperLink and of each SuperNode (with the processes below them: the ServerApp and ClientApps of
each study), of the Ray nodes' own processes (GCS, raylets, agents; not the per-run workers below a raylet) and of
this process (the lab, with the inline replays it runs and the commands below it) are sampled, and every second the
peak resident memory (VmHWM) of each ``fdam train`` driver. The bound applies to those the target names: the
SuperLink, the SuperNodes and the drivers (``memory_growth_max``). Growth of a long-lived process is measured on
the processes that lived through the whole soak (a restarted SuperNode starts over): the median of the last five
samples over the median of the samples of minute 5 to 6, the target for a year's operation (memory under 10% growth
after the first 5 minutes), with its trend: the least-squares slope, in MB an hour, of its lowest sample in each 5
minutes from minute 5 on (what it holds between studies; a study's ServerApp or ClientApps below it make the
peaks). A driver lives one study, so its growth is across studies: the median peak of the last third of the drivers
that finished after minute 5 over that of the first third. The Ray nodes' own processes are Ray's and the lab
process is the harness: both are shown beside (``ray_node_growth_max``, ``lab_growth``). It stops by itself: no
study starts past the soak's end, and a study waits at most its timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import _common as C
import _lab_flower as LF
import _lab_ray as LR
from _lab_common import Fault, metric_rows
from _lab_net import Links, holds, load_netlab

SAMPLE_EVERY_S = 10.0
DRIVER_EVERY_S = 1.0
WARMUP_S = 300.0  # growth is measured from minute 5
GROWTH_BOUND = 0.10
FLOOR_WINDOW_S = 300.0  # a long-lived process's trend: the slope of its lowest sample of each 5 minutes


class Sampler:
    """Samples (seconds since start, pids, resident bytes, open fds) per process name in a thread; ``pids()`` gives
    each name's process (with everything below it) or list of processes."""

    def __init__(self, pids: Callable[[], dict[str, int | list[int]]],
                 drivers: Callable[[], list[subprocess.Popen]] = list) -> None:
        self.pids, self.samples = pids, {}  # name -> [(t, pid key, rss, fds)]
        self.drivers, self.peaks = drivers, {}  # pid -> [first seen (s), peak resident bytes, Popen]
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        last = -SAMPLE_EVERY_S
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a process gone between listing and reading: next sample
                self.sample_drivers()
                if time.monotonic() - last >= SAMPLE_EVERY_S:
                    last = time.monotonic()
                    self.sample()
            self._stop.wait(DRIVER_EVERY_S)

    def sample_drivers(self) -> None:
        """Each live driver's peak resident memory so far (VmHWM, which only grows: its last reading is its peak)."""
        now = time.monotonic() - self.start
        for proc in list(self.drivers()):
            peak = high_water(proc.pid) if proc.poll() is None else 0
            if peak:
                seen = self.peaks.setdefault(proc.pid, [now, 0, proc])
                seen[1] = max(seen[1], peak)

    def driver_peaks(self) -> list[tuple[float, int]]:
        """(first seen, peak bytes) of each driver that finished its study (exit status 0), in order."""
        return sorted((t, peak) for t, peak, proc in self.peaks.values() if proc.poll() == 0)

    def sample(self) -> None:
        now = time.monotonic() - self.start
        for name, pid in {**self.pids(), "lab": os.getpid()}.items():
            if isinstance(pid, int):
                key, (rss, fds) = pid, holds(pid)
            else:
                key, rss, fds = hash(tuple(sorted(pid))), 0, 0
                for p in pid:  # the listed processes themselves, not what runs below them
                    r, f = own(p)
                    rss, fds = rss + r, fds + f
            if rss:
                self.samples.setdefault(name, []).append((now, key, rss, fds))


def own(pid: int) -> tuple[int, int]:
    """(resident bytes, open fds) of ``pid`` alone; (0, 0) when gone."""
    with contextlib.suppress(OSError, AttributeError, ValueError, IndexError):
        status = Path(f"/proc/{pid}/status").read_text()
        rss = int(status.split("VmRSS:")[1].split()[0]) * 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    return 0, 0


def high_water(pid: int) -> int:
    """Peak resident bytes of ``pid`` alone (VmHWM); 0 when gone."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/status").read_text().split("VmHWM:")[1].split()[0]) * 1024
    return 0


def slope_mb_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, bytes) points in MB an hour; nan with fewer than two times."""
    if len({t for t, _ in points}) < 2:
        return float("nan")
    mt = statistics.fmean(t for t, _ in points)
    mv = statistics.fmean(v for _, v in points)
    num = sum((t - mt) * (v - mv) for t, v in points)
    return num / sum((t - mt) ** 2 for t, _ in points) * 3600 / 2**20


def driver_growth(peaks: list[tuple[float, int]]) -> dict | None:
    """Growth across studies of the drivers' peaks: the median of the last third of those first seen from minute 5
    on over the median of the first third; None with fewer than three."""
    after = [p for t, p in sorted(peaks) if t >= WARMUP_S]
    if len(after) < 3:
        return None
    third = len(after) // 3
    p0, p1 = statistics.median(after[:third]), statistics.median(after[-third:])
    return {"rss_mb_at_5min": p0 / 2**20, "rss_mb_end": p1 / 2**20, "rss_growth": p1 / p0 - 1,
            "peak_mb": max(after) / 2**20, "drivers": len(after),
            "trend_mb_h": slope_mb_per_hour([(t, p) for t, p in peaks if t >= WARMUP_S])}


def growth(samples: list[tuple[float, int, int, int]], end_s: float) -> dict | None:
    """Growth of one process (or set of processes) over the soak, or None when it did not live through it
    (restarted, or started after minute 5): memory and fds, the median of the last five samples over the median
    of minute 5 to 6."""
    if not samples:
        return None
    key = samples[-1][1]
    mine = [s for s in samples if s[1] == key]
    early = [s for s in mine if WARMUP_S <= s[0] < WARMUP_S + 60]
    if not early or mine[0][0] > WARMUP_S or end_s - WARMUP_S < 120:
        return None
    late = mine[-5:]
    rss0, rss1 = statistics.median(s[2] for s in early), statistics.median(s[2] for s in late)
    fd0, fd1 = statistics.median(s[3] for s in early), statistics.median(s[3] for s in late)
    return {"rss_mb_at_5min": rss0 / 2**20, "rss_mb_end": rss1 / 2**20, "rss_growth": rss1 / rss0 - 1,
            "fds_at_5min": fd0, "fds_end": fd1, "peak_mb": max(s[2] for s in mine) / 2**20,
            "trend_mb_h": slope_mb_per_hour(floors([(s[0], s[2]) for s in mine if s[0] >= WARMUP_S]))}


def floors(points: list[tuple[float, int]], window_s: float = FLOOR_WINDOW_S) -> list[tuple[float, int]]:
    """The lowest sample of each ``window_s`` window (its middle, its bytes): what a process holds between
    studies, without the peaks of the study running at a sample (its ServerApp or ClientApps, below it)."""
    if not points:
        return []
    t0 = points[0][0]
    out: dict[int, tuple[float, int]] = {}
    for t, v in points:
        w = int((t - t0) // window_s)
        out[w] = (t0 + (w + 0.5) * window_s, min(v, out.get(w, (0.0, v))[1]))
    return [out[w] for w in sorted(out)]


def soak(netlab: Path, work: Path, args: argparse.Namespace, *, progress: Callable[[str], None]) -> str:
    minutes = float(args.soak)
    netcluster = load_netlab(netlab)
    folder = Path(work) / "soak"
    studies: list[Fault] = []
    started = time.monotonic()
    end = started + minutes * 60
    with Links(netcluster, [LF.SUPERLINK_IP, *(LF.site_ip(k) for k in range(3))]) as links, \
            LR.nothing_left_of(LR.cluster_ips(LR.FIRST_OCTET, 3)):
        lab = LF.LabConsortium(folder / "flower", links, progress=progress)
        cluster = LR.LabRayCluster(netlab)
        try:
            lab.start()
            cluster.start()
            with Sampler(lambda: {**lab.pids(), **ray_nodes(cluster)}, lambda: cluster.drivers) as sampler:
                progress("[soak] the baselines: a consortium study and a Ray study")
                state, run_dir, wall = lab.run_study(name="baseline")
                base = LF.Baseline(state, metric_rows(run_dir), wall)
                lab.study_timeout = 2 * wall + 240
                study = LR.Study(cluster, folder / "ray" / "baseline", args.seed, progress)
                study.baseline()
                i = 0
                while time.monotonic() + base.wall + study.base_wall < end:
                    i += 1
                    name = ("link_cut_short", "supernode_kill", "site_state_damaged")[(i - 1) % 3]
                    progress(f"[soak] round of studies {i} ({(time.monotonic() - started) / 60:.1f} of "
                             f"{minutes:g} min): {name}, then driver_kill")
                    studies.append(_guarded(lab, name, _flower, lab, base, name, args.seed * 1000 + i))
                    study.work, study.seed = folder / "ray" / f"study{i}", args.seed * 1000 + i
                    study.work.mkdir(parents=True, exist_ok=True)
                    studies.append(_guarded(None, "driver_kill", LR.driver_kill, study))
                with contextlib.suppress(Exception):  # the last sample; the thread's are taken the same way
                    sampler.sample()
                end_s = time.monotonic() - sampler.start
        finally:
            cluster.stop()
            lab.stop()
    time.sleep(1.0)
    left = lab.left_running()
    wall = time.monotonic() - started
    grown = {name: growth(s, end_s) for name, s in sorted(sampler.samples.items())}
    grown["fdam train drivers"] = driver_growth(sampler.driver_peaks())
    return _write(args, studies, grown, left, wall, {"consortium": base.wall, "Ray cluster": study.base_wall})


def ray_nodes(cluster: LR.LabRayCluster) -> dict[str, list[int]]:
    """The Ray nodes' own processes (GCS, raylet, agents), per node; not the workers a run starts below them."""
    out: dict[str, list[int]] = {}
    if cluster.cluster is None:
        return out
    nodes = [("ray-head", cluster.cluster.head_node)] + [(f"ray-worker{i}", n)
                                                         for i, n in enumerate(cluster.worker_nodes())]
    for name, node in nodes:
        if node is not None:
            out[name] = sorted({p.process.pid for procs in node.all_processes.values() for p in procs})
    return out


def _guarded(lab: LF.LabConsortium | None, name: str, run: Callable[..., Fault], *args: object) -> Fault:
    """``run(*args)``; a study the lab could not finish is a row that did not survive (the consortium healed)."""
    try:
        return run(*args)
    except Exception as exc:
        line = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        if lab is not None:
            lab.heal()
        return Fault(name, name, "?", f"the lab failed: {line}", False, 0.0, ["the study did not finish"])


def _flower(lab: LF.LabConsortium, base: LF.Baseline, name: str, seed: int) -> Fault:
    # site 2 only is killed: sites 0 and 1 live through the soak and their growth is measured
    if name == "supernode_kill":
        return LF.supernode_kill(lab, base, seed, True, site=2)
    if name == "site_state_damaged":
        return LF.site_state_damaged(lab, base, seed, True, site=2)
    return LF.link_cut_short(lab, base, seed, True)


def _write(args: argparse.Namespace, studies: list[Fault], grown: dict, left: list[int], wall: float,
           base_walls: dict[str, float]) -> str:
    lost_rounds = sum(len(f.lost) for f in studies)
    survived = sum(f.survived for f in studies)
    measured = {n: g for n, g in grown.items() if g is not None}
    # the bound is on the processes the target names (the SuperLink, the SuperNodes, the drivers); the Ray nodes' own
    # processes (Ray's GCS, raylets and agents) and the lab's own process are measured and shown beside them
    bounded = {n: g for n, g in measured.items() if not n.startswith("ray-") and n != "lab"}
    worst = max((g["rss_growth"] for g in bounded.values()), default=float("nan"))
    worst_ray = max((g["rss_growth"] for n, g in measured.items() if n.startswith("ray-")), default=float("nan"))
    lab_growth = measured.get("lab", {}).get("rss_growth", float("nan"))
    rows = [(f"{i + 1}", f"`{f.name}`", f.at, f.outcome, "yes" if f.survived else "**no**",
             "nothing" if not f.lost else "; ".join(f.lost)) for i, f in enumerate(studies)]
    body = C.table(["study", "fault", "injected at", "outcome", "survived", "lost"], rows)
    mem = [(f"`{n}`" + (f" ({g['drivers']}, peaks)" if "drivers" in g else ""), "yes" if n in bounded else "no",
            f"{g['rss_mb_at_5min']:.1f}", f"{g['rss_mb_end']:.1f}", f"{100 * g['rss_growth']:+.1f}%",
            f"{g['trend_mb_h']:+.1f}", f"{g['peak_mb']:.1f}",
            f"{g['fds_at_5min']:.0f} -> {g['fds_end']:.0f}" if "fds_end" in g else "-") for n, g in measured.items()]
    body += ("\n\nWhat the long-lived processes held (resident memory with the processes below each; medians of "
             "minute 5-6 and of the last five samples; the trend is the slope of the lowest sample of each 5 minutes "
             "from minute 5 on, the drivers' that of their peaks) and "
             "the `fdam train` drivers' peaks (first third of those after minute 5 against the last third):\n\n"
             + C.table(["process", "bounded", "MB at 5 min", "MB at the end", "growth", "trend MB/h", "peak MB",
                        "open fds"], mem))
    skipped = [n for n, g in grown.items() if g is None]
    if skipped:
        body += f"\n\nNot measured (restarted during the soak, or the soak too short): {', '.join(skipped)}."
    bases = ", ".join(f"{n} {w:.0f} s" for n, w in base_walls.items())
    body += (f"\n\n{len(studies)} studies after the baselines ({bases}), each with one fault; "
             f"{survived} survived, {lost_rounds} items lost; worst memory growth of the SuperLink, the "
             f"SuperNodes and the drivers {100 * worst:+.1f}% (bound {100 * GROWTH_BOUND:.0f}%), of the Ray nodes' "
             f"own processes {100 * worst_ray:+.1f}%, of the lab's process {100 * lab_growth:+.1f}%; processes "
             f"left running after it: {len(left)}; "
             f"{wall / 60:.1f} min in all.\n")
    out = Path(args.out) if args.out else C.RESULTS_DIR / "faults_soak.md"
    C.write_results(out, f"The soak ({args.soak:g} minutes)", C.command_line("faults.py", sys.argv[1:]), body)
    line = C.result_line(studies=len(studies), survived=survived, data_lost=lost_rounds,
                         memory_growth_max=round(worst, 4), ray_node_growth_max=round(worst_ray, 4),
                         lab_growth=round(lab_growth, 4),
                         left_running=len(left), minutes=round(wall / 60, 1))
    print(line)
    return line
