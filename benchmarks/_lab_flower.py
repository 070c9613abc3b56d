"""The fault lab's Flower part: a real SuperLink and three real SuperNodes (TLS, node authentication), each on its
own node address, faults injected mid-study at seeded points.

The SuperLink listens on 127.0.0.2 and site k's SuperNode on 127.0.0.(3+k); every process sends from its node's
address through netlab's shim, so netlab's tc filters are the links between them (``flwr run`` itself comes from
127.0.0.1, outside the lab's links). Each study is a small CODASCA on the Flower tests' three sites (6 rounds of 2
local steps, a stage every 3 rounds, one evaluation per round, so the metric rows are the completed rounds), with
the server's run folder given (``run-dir``) so it can be audited and resumed.

Faults (each at ``seeded_point(seed, name, first, last)``: a round and an offset, as a share of the study's own
previous round, after that round began, i.e. after the previous round's metric row appeared):

- baseline: the uninterrupted study; its final state against ``fdam_ray.train_arrays`` inline (<= 1e-6).
- ``supernode_kill``: a site's SuperNode and its process tree SIGKILLed mid-round, restarted 5 s later with the same
  state-dir. Expected: bit for bit the baseline, or (its round's reply lost) its replay from the participation
  record in the server's checkpoint.
- ``superlink_kill``: the SuperLink and its process tree (the ServerApp with it) SIGKILLed mid-round, restarted on
  the same port and database; ``flwr run`` again into the same run folder continues from its checkpoint.
  Expected: RESUMED, bit for bit the baseline.
- ``link_cut_short``: a site's links cut for 30 s (quick: 15 s) mid-round, then healed; round_timeout_s is longer.
  Expected: bit for bit.
- ``link_cut_long``: a site's links cut for longer than round_timeout_s, then healed: the site is left out of that
  round (recorded) and rejoins. Expected: REPLAYED.
- ``site_state_damaged``: between rounds, a site's SuperNode SIGKILLed, its state file (site-k.pt) overwritten with
  garbage, the SuperNode restarted (a running SuperNode keeps the state in its node state and never rereads the
  file): the site sets the file aside and rejoins as a replaced client (a fresh client, c^k = the global c of the
  first round it trains, recorded in the checkpoint's ``rebuilt``). Expected: REPLAYED (the inline replay
  rebuilds the site in that round), or bit for bit when the site trained no round after it rejoined.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from _lab_common import BIT_FOR_BIT, REPLAYED, RESUMED, Fault, audit, max_difference, metric_rows, seeded_point
from _lab_net import Links, load_netlab

SUPERLINK_IP = "127.0.0.2"
ROUNDS = 6
CASE = dict(algorithm="codasca", model="linear", batch_size=8, seed=3, executor="inline", local_steps=2,
            iterations=2 * ROUNDS, lr=0.2, global_lr=1.3, prox_weight=0.01, stage_length=6, eval_every=2)
ROUND_TIMEOUT_S = 50.0  # above the short cut (30 s) and a round's ~20 s, below the long cut
LONG_CUT_S = 58.0


def site_ip(k: int) -> str:
    return f"127.0.0.{3 + k}"


def three_sites(folder: Path) -> tuple[list, tuple]:
    """The Flower tests' three sites and test set (tests/flower_helpers.py), as arrays and .npz files."""
    rng = np.random.default_rng(0)

    def site(n: int, shift: float) -> tuple[np.ndarray, np.ndarray]:
        x = rng.normal(size=(n, 4)).astype(np.float32) + shift
        y = (x[:, 0] + 0.5 * rng.normal(size=n) > shift).astype(np.float32)
        return x, y

    clients, test = [site(30, 0.0), site(50, 0.3), site(40, -0.2)], site(60, 0.0)
    folder.mkdir(parents=True, exist_ok=True)
    for k, (x, y) in enumerate(clients):
        np.savez(folder / f"site{k}.npz", x=x, y=y)
    np.savez(folder / "test.npz", x=test[0], y=test[1])
    return clients, test


class LabConsortium:
    """A SuperLink on 127.0.0.2 and three SuperNodes on 127.0.0.3-5 (TLS, node authentication, a SuperLink
    database), their processes sending from their addresses through ``links``; usable for many studies in a row.

    Args:
        folder: everything it writes (logs, certificates, the sites' state, the studies' run folders).
        links: the lab's links (up), or None: no shim (every process on its address, sending from 127.0.0.1).
    """

    def __init__(self, folder: Path, links: Links | None, *, progress: Callable[[str], None] = print) -> None:
        from fdam_ray.flower.deployment import Consortium, write_app

        self.folder, self.links, self.progress = Path(folder), links, progress
        self.data = self.folder / "data"
        self.clients, self.test = three_sites(self.data)
        self.state_dir = self.folder / "site-state"
        self.app = write_app(self.folder / "app")
        sites = [{"site": k, "data": str(self.data / f"site{k}.npz"), "state-dir": str(self.state_dir)}
                 for k in range(3)]
        env = None if links is None else (lambda ip, base: links.env(ip, base))
        self.consortium = Consortium(self.folder / "consortium", sites, timeout=900, superlink_host=SUPERLINK_IP,
                                     site_hosts=[site_ip(k) for k in range(3)], host_env=env,
                                     database=self.folder / "consortium" / "superlink.db")
        self.studies = 0
        self.study_timeout = 900.0  # a study's wait for its result (the lab sets it from the baseline's wall time)
        self.resume_stopped = True  # a study the server stopped in one line: flwr run again into its folder
        self.stopped: dict[str, str] = {}  # study name -> the line its server stopped it with (then resumed)

    # -- processes -------------------------------------------------------------------------------
    def start(self) -> LabConsortium:
        self.consortium.start()
        return self

    def stop(self) -> None:
        self.consortium.stop()

    def __enter__(self) -> LabConsortium:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def heal(self) -> None:
        """Every process running again (after a fault that failed half way: the next study finds the consortium
        whole)."""
        c = self.consortium
        if "superlink" not in c.processes or c.processes["superlink"].poll() is not None:
            c.restart_superlink()
        for k in range(3):
            if f"site{k}" not in c.processes or c.processes[f"site{k}"].poll() is not None:
                self.restart_site(k)
        if self.links is not None:
            for ip in list(self.links.cut_now):
                self.links.heal(ip)

    def left_running(self) -> list[int]:
        """Live processes of this consortium that none of its running processes started (after :meth:`stop`: every
        one left)."""
        return self.consortium.strays()

    def pids(self) -> dict[str, int]:
        """The pid of each process the consortium started (superlink, site0..2), for memory sampling."""
        return {k: p.pid for k, p in self.consortium.processes.items() if p.poll() is None}

    def kill_site(self, k: int) -> list[int]:
        return self.consortium.kill_process(f"site{k}")

    def restart_site(self, k: int, patience: float = 300.0) -> float:
        """Start site ``k``'s SuperNode again, as a service manager would: a SuperNode whose key the SuperLink still
        holds active (its killed predecessor not yet timed out) exits with code 305 "Failed to activate SuperNode";
        it is started again every 5 s until one stays up 20 s. The seconds until then."""
        t0 = time.monotonic()
        self.consortium.stop_process(f"site{k}")
        while True:
            proc = self.consortium.start_site(k)
            up = time.monotonic()
            while time.monotonic() - up < 20.0 and proc.poll() is None:
                time.sleep(0.5)
            if proc.poll() is None:
                return time.monotonic() - t0
            self.consortium.processes.pop(f"site{k}", None)
            self._kill_orphans(site_ip(k))  # its SuperExec outlives it, detached
            if time.monotonic() - t0 > patience:
                raise RuntimeError(f"site {k}'s SuperNode did not stay up within {patience:g} s; see "
                                   f"{self.consortium.folder / f'site{k}.log'}")
            time.sleep(5.0)

    def _kill_orphans(self, ip: str) -> None:
        """This consortium's processes of node ``ip`` that no running process of it started (left by one that
        exited)."""
        for pid in self.consortium.strays(f"NETCLUSTER_SRC={ip}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def kill_superlink(self) -> list[int]:
        return self.consortium.kill_process("superlink")

    def restart_superlink(self) -> None:
        self.consortium.restart_superlink()

    # -- studies ---------------------------------------------------------------------------------
    def study_config(self, case: dict[str, Any], name: str) -> Path:
        keys = {str(k): self.consortium.keys[k].fingerprint for k in range(3)}  # type: ignore[union-attr]
        path = self.folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**case, "num_clients": 3, "flower": {
            "test_data": str(self.data / "test.npz"), "round_timeout_s": ROUND_TIMEOUT_S, "site_keys": keys}}))
        return path

    def submit(self, config: Path, result: Path, run_dir: Path) -> str:
        """``flwr run`` the study into ``run_dir`` (a folder that holds a checkpoint: it continues); its output."""
        from fdam_ray.flower.deployment import write_run_config

        c = self.consortium
        overrides = write_run_config(c.folder / f"run-config-{result.stem}.toml", config, result=result.resolve(),
                                     run_dir=run_dir.resolve())
        out = subprocess.run([c._bin("flwr"), "run", str(self.app), "consortium", "--run-config", str(overrides)],
                             env=c.env, cwd=c.folder, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"flwr run failed ({out.returncode}): {(out.stderr + out.stdout).strip()[-300:]}")
        return out.stdout + out.stderr

    def wait_result(self, result: Path, timeout: float = 900.0, stop: threading.Event | None = None,
                    run_dir: Path | None = None, seen: int = 0) -> str | None:
        """Until the study's result is written (None), or, with ``run_dir``, until the server stops the study: its
        train.log gains a ``run stopped:`` line past the ``seen`` ones (that line)."""
        deadline = time.monotonic() + timeout
        while not result.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result {result} within {timeout:g} s; see {self.consortium.folder}")
            if stop is not None and stop.is_set():
                return None
            stops = [] if run_dir is None else stop_lines(run_dir)
            if len(stops) > seen:
                return stops[-1]
            time.sleep(0.5)
        time.sleep(0.3)  # np.savez has finished writing when the name appears? give it a moment
        return None

    def fresh_name(self, name: str) -> str:
        """``name``, or ``name-2``, ``name-3``, ... when a study of that name ran before: a study submitted into a
        run folder that holds a checkpoint continues it (a finished one returns its stored result at once)."""
        n, out = 1, name
        while (self.folder / "runs" / out).exists() or (self.folder / "results" / f"{out}.npz").exists():
            n += 1
            out = f"{name}-{n}"
        return out

    def run_study(self, case: dict[str, Any] | None = None, name: str | None = None,
                  during: Callable[[Path], None] | None = None) -> tuple[dict[str, np.ndarray], Path, float]:
        """One study (``case``, default the lab's CODASCA) into a new run folder; ``during(run_dir)`` runs in a thread
        while it goes. Returns (the final state's arrays, the server's run folder, wall seconds)."""
        self.studies += 1
        name = self.fresh_name(name or f"study{self.studies}")
        run_dir, result = self.folder / "runs" / name, self.folder / "results" / f"{name}.npz"
        result.parent.mkdir(parents=True, exist_ok=True)
        config = self.study_config(case or CASE, name)
        t0 = time.monotonic()
        errors: list[BaseException] = []
        thread = None
        if during is not None:
            def go() -> None:
                try:
                    during(run_dir)
                except BaseException as exc:
                    errors.append(exc)
            thread = threading.Thread(target=go, name=f"fault-{name}", daemon=True)
            thread.start()
        seen = len(stop_lines(run_dir))
        self.submit(config, result, run_dir)
        stopped = self.wait_result(result, self.study_timeout, run_dir=run_dir, seen=seen)
        if stopped is not None and self.resume_stopped:  # a study stopped in one line: continued from its folder
            self.progress(f"[flower] {name}: the server stopped the study ({stopped.split('run stopped: ')[-1]}); "
                          "flwr run again into its run folder")
            self.stopped[name] = stopped.split("run stopped: ")[-1]
            if thread is not None:
                thread.join(120)
            self.heal()
            self.submit(config, result, run_dir)
            stopped = self.wait_result(result, self.study_timeout, run_dir=run_dir, seen=seen + 1)
        if stopped is not None:
            raise RuntimeError(f"the server stopped study {name}: {stopped}")
        wall = time.monotonic() - t0
        if thread is not None:
            thread.join(120)
        if errors:
            raise errors[0]
        return load_result(result), run_dir, wall


def stop_lines(run_dir: Path) -> list[str]:
    """The ``run stopped:`` lines of a server run folder's train.log (one per time the server stopped the study)."""
    path = run_dir / "train.log"
    if not path.exists():
        return []
    return [line.strip() for line in path.read_text(errors="replace").splitlines() if "run stopped:" in line]


def load_result(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as npz:
        return {k: npz[k] for k in npz.files if k != "history"}


def inline_state(case: dict[str, Any], clients: list, test: tuple) -> dict[str, np.ndarray]:
    import fdam_ray

    run = fdam_ray.train_arrays(case, clients, test)
    return {k: v for k, v in run.state.vectors().items() if v is not None}


def wait_rows(run_dir: Path, n: int, timeout: float = 900.0) -> list[dict]:
    """Until the run folder holds ``n`` metric rows (n rounds done); the rows then."""
    deadline = time.monotonic() + timeout
    while len(rows := metric_rows(run_dir)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run_dir}: {n} metric rows not written within {timeout:g} s")
        time.sleep(0.2)
    return rows


# -- the faults ------------------------------------------------------------------------------------
ALL = ["supernode_kill", "link_cut_short", "link_cut_long", "site_state_damaged", "superlink_kill"]
QUICK = ["supernode_kill", "link_cut_short"]


class Baseline:
    def __init__(self, state: dict[str, np.ndarray], rows: list[dict], wall: float) -> None:
        self.state, self.rows, self.wall = state, rows, wall
        self.round_s = wall / ROUNDS  # a round's share of the study, its start included


def _point(seed: int, name: str, base: Baseline) -> tuple[int, float, int, str]:
    """(round, share of a round into it, site, its words) of a fault."""
    r, frac = seeded_point(seed, name, 2, ROUNDS - 2)
    site = seeded_point(seed, name + ":site", 0, 2)[0]
    return r, frac, site, f"round {r} + {frac:.2f} of a round"


def _into_round(run_dir: Path, r: int, frac: float, where: list[str] | None = None) -> None:
    """``frac`` of a round after round r began (round r-1's row written; rows: rounds 0..r-1), a round being this
    study's own round r-1 (the time between its last two rows: a loaded machine's rounds vary several-fold from
    study to study, so a share of another study's round can miss this one); ``where`` gets the seconds and the
    round then in progress."""
    rows = wait_rows(run_dir, r)
    walls = [float(row["wall_s"]) for row in rows[-2:]]
    offset = frac * (walls[-1] - walls[0]) if len(walls) == 2 else 0.0
    time.sleep(offset)
    if where is not None:
        where.append(f" (+{offset:.1f} s, in round {len(metric_rows(run_dir))})")


def _judge(lab: LabConsortium, name: str, what: str, at: str, got: dict, run_dir: Path, wall: float,
           base: Baseline, *, resumed: bool = False, message: str = "", note: str = "",
           case: dict[str, Any] = CASE) -> Fault:
    """The fault's row. ``case``: the study's config when it is not the lab's (its ``base`` is then the inline
    run of it, which a Flower study equals within 1e-6, not bit for bit)."""
    from fdam_ray.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(run_dir / "checkpoint.pt")
    if run_dir.name in lab.stopped:  # the server stopped it in one line; the lab resumed it
        resumed, message = True, message or lab.stopped[run_dir.name]
    recorded = dict(checkpoint.loop.participation or {})
    rebuilt = dict(checkpoint.loop.rebuilt or {})
    if recorded or rebuilt:
        replay = inline_state(dict(case, participation_record=str(run_dir)), lab.clients, lab.test)
        diff, same = max_difference(got, replay), False
        said = "; ".join(([f"rounds without every site: {recorded}"] if recorded else [])
                         + ([f"sites rebuilt (round: sites): {rebuilt}"] if rebuilt else []))
        outcome = (f"{REPLAYED} ({said})" if diff <= 1e-6 else
                   f"finished with {said} recorded, but {diff:.3g} from their replay")
        if resumed:
            outcome += "; stopped with one line and resumed from its folder first"
    elif case is not CASE:  # against the inline run of its config
        diff, same = max_difference(got, base.state), False
        outcome = (f"{REPLAYED} (nothing recorded: the replay is the inline run of its config)" if diff <= 1e-6
                   else f"finished, nothing recorded, but {diff:.3g} from the inline run of its config")
    else:
        diff, same = max_difference(got, base.state), True
        outcome = ((RESUMED if resumed else BIT_FOR_BIT) if diff == 0.0 else
                   f"finished, no round recorded without a site, but {diff:.3g} from the uninterrupted study")
    if note:
        outcome += f"; {note}"
    lost = audit(run_dir, base.rows, checkpoint_round=int(checkpoint.loop.state.round), same_training=same)
    ok = outcome.startswith((BIT_FOR_BIT, REPLAYED, RESUMED)) and not lost
    lab.progress(f"[flower] {name}: {outcome}; lost {lost or 'nothing'}; {wall - base.wall:+.1f} s")
    return Fault(name, what, at, outcome, ok, round(wall - base.wall, 1), lost, message, diff)


def supernode_kill(lab: LabConsortium, base: Baseline, seed: int, quick: bool, site: int | None = None) -> Fault:
    """``site``: this site's SuperNode (default: one drawn from the seed)."""
    r, offset, k, at = _point(seed, "supernode_kill", base)
    k = k if site is None else site

    def fault(run_dir: Path) -> None:
        _into_round(run_dir, r, offset, where)
        killed = lab.kill_site(k)
        lab.progress(f"[flower] supernode_kill: site {k}'s SuperNode killed at {at} (pids {killed})")
        time.sleep(5.0)
        took.append(lab.restart_site(k))

    took: list[float] = []
    where: list[str] = []
    got, run_dir, wall = lab.run_study(name="supernode_kill", during=fault)
    return _judge(lab, "supernode_kill", f"site {k}'s SuperNode and its process tree SIGKILLed, started again 5 s "
                  f"later with the same state-dir, and every 5 s until the SuperLink let its key in again (up after "
                  f"{took[0] if took else float('nan'):.0f} s)", at + "".join(where), got, run_dir, wall, base)


def superlink_kill(lab: LabConsortium, base: Baseline, seed: int, quick: bool) -> Fault:
    r, offset, _, at = _point(seed, "superlink_kill", base)
    name = lab.fresh_name("superlink_kill")
    run_dir, result = lab.folder / "runs" / name, lab.folder / "results" / f"{name}.npz"
    config = lab.study_config(CASE, name)
    t0 = time.monotonic()
    lab.submit(config, result, run_dir)
    where: list[str] = []
    _into_round(run_dir, r, offset, where)
    killed = lab.kill_superlink()
    lab.progress(f"[flower] superlink_kill: SuperLink killed at {at} (pids {killed})")
    time.sleep(3.0)
    lab.restart_superlink()
    out = lab.submit(config, result, run_dir)
    lab.wait_result(result, lab.study_timeout)
    wall = time.monotonic() - t0
    train_log = (run_dir / "train.log").read_text(errors="replace").splitlines()  # the ServerApp's log is Flower's
    resumed = [line.split(" INFO ", 1)[-1].strip() for line in train_log if " resumed at round " in line]
    message = resumed[-1] if resumed else f"none (flwr run said: {out.strip().splitlines()[-1][:200]})"
    return _judge(lab, "superlink_kill", "the SuperLink and its process tree (the ServerApp) SIGKILLed, restarted 3 s "
                  "later on its port and database; flwr run again into the same run folder", at + "".join(where),
                  load_result(result),
                  run_dir, wall, base, resumed=True, message=message)


def _link_cut(lab: LabConsortium, base: Baseline, seed: int, name: str, seconds: float) -> Fault:
    r, offset, k, at = _point(seed, name, base)
    assert lab.links is not None
    where: list[str] = []

    def fault(run_dir: Path) -> None:
        _into_round(run_dir, r, offset, where)
        lab.progress(f"[flower] {name}: site {k}'s links cut for {seconds:g} s at {at}")
        lab.links.cut_for(site_ip(k), seconds).join()  # type: ignore[union-attr]

    got, run_dir, wall = lab.run_study(name=name, during=fault)
    return _judge(lab, name, f"site {k}'s links ({site_ip(k)}) cut for {seconds:g} s, then healed "
                  f"(round_timeout_s={ROUND_TIMEOUT_S:g})", at + "".join(where), got, run_dir, wall, base)


def link_cut_short(lab: LabConsortium, base: Baseline, seed: int, quick: bool) -> Fault:
    return _link_cut(lab, base, seed, "link_cut_short", 15.0 if quick else 30.0)


def link_cut_long(lab: LabConsortium, base: Baseline, seed: int, quick: bool) -> Fault:
    return _link_cut(lab, base, seed, "link_cut_long", LONG_CUT_S)


LONG_ROUNDS = 14  # site_state_damaged's study: a restarted SuperNode is let in ~70 s later, so it trains again


def site_state_damaged(lab: LabConsortium, base: Baseline, seed: int, quick: bool, site: int | None = None) -> Fault:
    """``site``: this site's state file (default: one drawn from the seed). A study of LONG_ROUNDS rounds, the
    fault after round 2 or 3, so that the restarted site trains again as a rebuilt client (recorded, replayed)."""
    _, _, k, _ = _point(seed, "site_state_damaged", base)
    r = seeded_point(seed, "site_state_damaged", 2, 3)[0]
    k = k if site is None else site
    case = dict(CASE, iterations=2 * LONG_ROUNDS)
    inline = Baseline(inline_state(case, lab.clients, lab.test), [{"round": i} for i in range(LONG_ROUNDS + 1)],
                      base.wall * LONG_ROUNDS / ROUNDS)
    path = lab.state_dir / f"site-{k}.pt"
    seen: list[str] = []

    def fault(run_dir: Path) -> None:
        # a running SuperNode keeps the site's state in its node state and rewrites the file after each round:
        # the file is read (and found damaged) only by a SuperNode that starts without it
        wait_rows(run_dir, r + 1)  # rows of rounds 0..r
        lab.kill_site(k)
        path.write_bytes(b"not a state file" * 8)
        lab.progress(f"[flower] site_state_damaged: site {k}'s SuperNode killed after round {r}'s row, {path} "
                     "overwritten, the SuperNode restarted")
        lab.restart_site(k)

    before = set(lab.state_dir.glob(f"site-{k}.pt.damaged*"))
    got, run_dir, wall = lab.run_study(case, name="site_state_damaged", during=fault)
    aside = sorted(set(lab.state_dir.glob(f"site-{k}.pt.damaged*")) - before)
    log = (lab.consortium.folder / f"site{k}.log").read_text(errors="replace").splitlines()
    seen = [line.strip() for line in log if "damaged" in line]
    note = (f"site {k} set the file aside as {aside[0].name} and rejoined as a replaced client" if aside else
            f"site {k} never read the damaged file (it was rewritten first)")
    return _judge(lab, "site_state_damaged", f"site {k}'s SuperNode SIGKILLed between rounds, its state file "
                  "overwritten with garbage, the SuperNode restarted",
                  f"after round {r} (of {LONG_ROUNDS})", got, run_dir, wall, inline,
                  message=seen[-1][-300:] if seen else "", note=note, case=case)


FAULTS = {f.__name__: f for f in (supernode_kill, superlink_kill, link_cut_short, link_cut_long, site_state_damaged)}


def run_flower_faults(netlab: Path, work: Path, seed: int, *, quick: bool, names: list[str] | None = None,
                      progress: Callable[[str], None] = print) -> tuple[dict, list[Fault]]:
    """The baseline study and each fault's (``names``; default all, quick: supernode_kill and link_cut_short) on
    one consortium. Returns (baseline info: wall_s, max_diff_vs_inline, what; one :class:`Fault` per fault)."""
    import shutil

    names = list(QUICK if quick else ALL) if names is None else list(names)  # []: the baseline only
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise SystemExit(f"unknown Flower faults {unknown}; known: {list(FAULTS)}")
    netcluster = load_netlab(netlab)
    folder = Path(work) / "flower-lab"
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(folder)
    faults: list[Fault] = []
    with Links(netcluster, [SUPERLINK_IP, *(site_ip(k) for k in range(3))]) as links:
        lab = LabConsortium(folder, links, progress=progress)
        try:
            lab.start()
            info = _run_all(lab, names, seed, quick, faults, progress)
        finally:
            lab.stop()
    time.sleep(1.0)
    left = lab.left_running()
    if left:
        raise RuntimeError(f"processes of the Flower lab left running: {left[:10]}")
    return info, faults


def _run_all(lab: LabConsortium, names: list[str], seed: int, quick: bool, faults: list[Fault],
             progress: Callable[[str], None]) -> dict:
    progress("[flower] baseline study (SuperLink 127.0.0.2, SuperNodes 127.0.0.3-5, TLS, node auth)")
    state, run_dir, wall = lab.run_study(name="baseline")
    base = Baseline(state, metric_rows(run_dir), wall)
    gap = max_difference(state, inline_state(CASE, lab.clients, lab.test))
    info = {"wall_s": round(wall, 1), "max_diff_vs_inline": gap,
            "what": f"CODASCA, 3 sites, {ROUNDS} rounds of {CASE['local_steps']} local steps, one evaluation a "
                    f"round, round_timeout_s={ROUND_TIMEOUT_S:g}; {len(base.rows)} metric rows"}
    progress(f"[flower] baseline: {wall:.1f} s, max diff vs inline {gap:.3g}")
    lab.study_timeout = 2 * wall + 240
    for name in names:
        progress(f"[flower] {name} ...")
        t0 = time.monotonic()
        try:
            faults.append(FAULTS[name](lab, base, seed, quick))
        except Exception as exc:
            line = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            progress(f"[flower] {name}: the lab failed: {line}")
            faults.append(Fault(name, name, "?", f"the lab failed: {line}", False,
                                round(time.monotonic() - t0 - base.wall, 1), ["the study did not finish"]))
            lab.heal()
    return info
