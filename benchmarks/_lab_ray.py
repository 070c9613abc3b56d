"""The fault lab's Ray part: a head and three worker nodes on netlab's loopback addresses, real ``fdam train``
drivers joining it by address, and three faults injected at seeded points of a small CODASCA study.

- ``raylet_kill``: a worker node's raylet SIGKILLed mid-round (``on_client_failure: abort``: the run stops with
  one line, its last checkpoint is the round's start with every client's state; ``fdam train --resume`` on the
  two nodes left ends bit for bit where the uninterrupted study ends);
- ``driver_kill``: the ``fdam train`` process SIGKILLed mid-round, then resumed;
- ``disk_full``: the run folder on a small tmpfs filled at a seeded round so that a checkpoint write fails; the
  space freed, then resumed.

No tc shaping here (``start_cluster`` only): the network faults are another part of the lab's. Everything this
module starts is stopped by its pid; :class:`LabRayCluster` is reusable (a soak drives it round after round).
Nothing here is imported by the package or the default tests.

Use (a soak)::

    with LabRayCluster(netlab) as cluster:            # head 127.0.0.6, workers .7-.9, 1 CPU and 200 MB each
        study = Study(cluster, work, seed)
        study.baseline()                              # the uninterrupted study: rows, final state, round time
        fault = driver_kill(study)                    # or disk_full / raylet_kill (which adds a fresh node after)
        proc = cluster.driver([...fdam train args...], work / "x.log")   # any driver; cluster.pids() to sample
        node = cluster.kill_raylet(0); cluster.remove(node); cluster.add_worker()
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import _lab_net as net
from _lab_common import BIT_FOR_BIT, RESUMED, Fault, audit, max_difference, metric_rows, seeded_point

ROOT = Path(__file__).resolve().parents[1]
FIRST_OCTET = 6  # head 127.0.0.6, workers .7 .. .9
ROUNDS = 12
LOCAL_STEPS = 150
# the study: 6 clients, 2 per actor, one actor per worker node (SPREAD); fold_order=client and reduce=star make a
# Ray run repeat bit for bit whatever the order the partial sums arrive in and wherever the actors run
STUDY = ["executor=ray", "algorithm=codasca", "dataset=synthetic", "model=mlp", "model.width=64", "num_clients=6",
         "samples_per_client=400", "clients_per_actor=2", "cpus_per_actor=0.5", "placement_strategy=SPREAD",
         "fold_order=client", "reduce=star", f"local_steps={LOCAL_STEPS}", f"iterations={ROUNDS * LOCAL_STEPS}",
         f"eval_every={LOCAL_STEPS}", "stage_length=100000", "checkpoint_every=1", "seed=0", "tensorboard=false",
         "batch_size=32"]
STATE_FIELDS = ("v", "alpha", "buffers", "c_v", "c_alpha")


class LabRayCluster:
    """A ``ray.cluster_utils.Cluster`` of a head (no CPUs) and ``workers`` nodes on 127.0.0.<first_octet>..., each
    node's processes sending from its own address (netlab's shim), and the ``fdam train`` drivers run against it.

    Args:
        netlab: netlab's folder (``../shared/netlab``).
        workers: worker nodes (resource ``site_<i>`` each).
        cpus_per_worker: logical CPUs of a worker node.
        object_store_mb: each node's object store.
    """

    def __init__(self, netlab: Path, *, workers: int = 3, cpus_per_worker: float = 1.0, object_store_mb: int = 200,
                 first_octet: int = FIRST_OCTET) -> None:
        self.nc = net.load_netlab(netlab)
        self.workers, self.cpus_per_worker = workers, cpus_per_worker
        self.object_store_bytes = object_store_mb * 2**20
        self.first_octet = first_octet
        self.cluster: Any = None
        self.ips: list[str] = []
        self.shim: Path | None = None
        self.drivers: list[subprocess.Popen] = []

    # -- up and down ----------------------------------------------------------------------------------------
    def start(self) -> LabRayCluster:
        # a Ray temp folder of the lab's own: Ray records the cluster it starts as the machine's current one in its
        # temp folder, and in the shared /tmp/ray every `fdam train` without an address would join the lab's nodes
        self._saved_tmpdir = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="fdl", dir="/tmp")  # short: Ray's socket paths
        self.shim = self.nc.build_shim()
        self.cluster, self.ips = self.nc.start_cluster(self.workers, self.cpus_per_worker,
                                                       object_store_bytes=self.object_store_bytes,
                                                       first_octet=self.first_octet)
        self._next_site = self.workers
        return self

    def stop(self) -> None:
        """Every driver still running killed, every node's processes stopped (by pid)."""
        for proc in self.drivers:
            kill_tree(proc)
        self.drivers = []
        if self.cluster is None:
            self._own_tmpdir_back()
            return
        left = [p for n in self.nodes() for p in net.tree(n.all_processes["raylet"][0].process.pid)] \
            if self.cluster else []
        with contextlib.suppress(Exception):
            self.cluster.shutdown()
        self.cluster = None
        self._own_tmpdir_back()
        for pid in left:  # workers of a node that outlived its raylet
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _own_tmpdir_back(self) -> None:
        """RAY_TMPDIR as it was before :meth:`start`; the lab's Ray folder removed."""
        if not hasattr(self, "_saved_tmpdir"):
            return
        mine = os.environ.pop("RAY_TMPDIR", None)
        if self._saved_tmpdir is not None:
            os.environ["RAY_TMPDIR"] = self._saved_tmpdir
        del self._saved_tmpdir
        if mine:
            shutil.rmtree(mine, ignore_errors=True)

    def __enter__(self) -> LabRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the nodes --------------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def head_ip(self) -> str:
        return self.ips[0]

    def nodes(self) -> list[Any]:
        return [n for n in [self.cluster.head_node, *self.cluster.worker_nodes] if n is not None]

    def worker_nodes(self) -> list[Any]:
        return list(self.cluster.worker_nodes)

    @staticmethod
    def raylet_pid(node: Any) -> int:
        return node.all_processes["raylet"][0].process.pid

    def kill_raylet(self, index: int = 0) -> Any:
        """SIGKILL worker node ``index``'s raylet (its workers lose it and end); the node is returned, still listed
        (:meth:`remove` clears what is left of it)."""
        node = self.worker_nodes()[index]
        os.kill(self.raylet_pid(node), signal.SIGKILL)
        return node

    def remove(self, node: Any) -> None:
        """What is left of ``node`` (its other processes, workers that outlived the raylet) stopped."""
        left = net.tree(self.raylet_pid(node))
        with contextlib.suppress(Exception):
            self.cluster.remove_node(node, allow_graceful=False)
        if node in self.cluster.worker_nodes:
            self.cluster.worker_nodes.remove(node)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def add_worker(self) -> Any:
        """A fresh worker node at the next free address of the lab's (as many worker nodes as at the start)."""
        used = {n.node_ip_address for n in self.worker_nodes()}
        ip = next(ip for ip in self.ips[1:] if ip not in used)
        with self.nc._node_env(self.shim, ip):
            node = self.cluster.add_node(node_ip_address=ip, num_cpus=self.cpus_per_worker,
                                         resources={f"site_{self.ips.index(ip) - 1}": 1},
                                         object_store_memory=self.object_store_bytes)
        return node

    def wait_dead(self, alive_workers: int, timeout_s: float = 90) -> float:
        """Wait until the GCS counts ``alive_workers`` worker nodes (a killed raylet's node marked dead); seconds."""
        t0 = time.monotonic()
        import ray

        while time.monotonic() - t0 < timeout_s:
            with contextlib.suppress(Exception):
                nodes = ray.util.state.list_nodes(address=self.address, filters=[("state", "=", "ALIVE")])
                if len([n for n in nodes if not n.is_head_node]) == alive_workers:
                    return time.monotonic() - t0
            time.sleep(1)
        raise RuntimeError(f"the cluster did not count {alive_workers} live worker nodes in {timeout_s:g} s")

    # -- drivers ------------------------------------------------------------------------------------------
    def env(self, ip: str | None = None) -> dict[str, str]:
        """A process of node ``ip`` (the head's by default): sends from that address, imports this checkout."""
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        parts = [p for p in env.get("LD_PRELOAD", "").split() if "srcbind.so" not in p]
        env.update(LD_PRELOAD=" ".join([str(self.shim), *parts]), NETCLUSTER_SRC=ip or self.head_ip,
                   PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
                   PYTHONUNBUFFERED="1")
        return env

    def driver(self, args: Sequence[str], log: Path, *, cwd: Path | None = None) -> subprocess.Popen:
        """``fdam train --address <head> args`` (this checkout's package), output to ``log``; started, not waited."""
        cmd = [sys.executable, "-m", "fdam_ray", "train", "--address", self.address, "--no-progress", *args]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=cwd or log.parent, env=self.env(), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.drivers.append(proc)
        return proc

    def pids(self) -> dict[str, list[int]]:
        """The processes to sample: the head's and each worker node's (raylet and below), the drivers (and below)."""
        out: dict[str, list[int]] = {"head": [], "workers": [], "drivers": []}
        if self.cluster is not None:
            head = self.cluster.head_node
            if head is not None:
                out["head"] = sorted({p.process.pid for procs in head.all_processes.values() for p in procs})
            for node in self.worker_nodes():  # the node's own processes, the raylet's workers and agents below it
                mine = {p.process.pid for procs in node.all_processes.values() for p in procs}
                out["workers"].extend(sorted(mine | set(net.tree(self.raylet_pid(node)))))
        for proc in self.drivers:
            if proc.poll() is None:
                out["drivers"].extend(net.tree(proc.pid))
        return out


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """``proc``'s session (started with start_new_session) killed with ``sig``, then reaped."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def cluster_ips(first_octet: int, workers: int) -> list[str]:
    return [f"127.0.0.{first_octet + i}" for i in range(workers + 1)]


def _node_of(pid: int) -> str | None:
    """The lab node address a process runs as (NETCLUSTER_SRC in its environment), if any."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"NETCLUSTER_SRC="):
            return item.split(b"=", 1)[1].decode()
    return None


@contextlib.contextmanager
def nothing_left_of(ips: Sequence[str]) -> Iterator[None]:
    """At the end, raises when a Ray or fdam process running as one of ``ips`` is still alive (this lab's nodes
    only: other processes of the machine, and other parts of the lab, are not its own)."""
    before = set(net._children_pids())
    yield
    deadline = time.monotonic() + 10  # the workers of a stopped node take a moment to notice
    while True:
        left = [p for p in net._children_pids()
                if p not in before and net._is_ours(p) and _node_of(p) in set(ips)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if left:
        raise RuntimeError(f"processes left running after the Ray lab: {sorted(left)[:10]}")


# -- the study -------------------------------------------------------------------------------------------------
def _rows(run: Path) -> list[dict]:
    try:
        return metric_rows(run)
    except (ValueError, OSError):  # a row being written
        return []


def final_state(run: Path) -> dict[str, Any]:
    """The global state's vectors in ``run``'s checkpoint."""
    from fdam_ray.checkpoint import load_checkpoint

    state = load_checkpoint(run / "checkpoint.pt").loop.state
    return {name: getattr(state, name) for name in STATE_FIELDS}


def checkpoint_round(run: Path) -> int | None:
    from fdam_ray.checkpoint import load_checkpoint

    try:
        return int(load_checkpoint(run / "checkpoint.pt").loop.state.round)
    except Exception:
        return None


def _wait(proc: subprocess.Popen, log: Path, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise RuntimeError(f"the driver ran past {timeout_s:g} s:\n{log.read_text()[-2000:]}") from None


def _until(condition: Callable[[], bool], proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before the fault:\n{log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no fault point within {timeout_s:g} s:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)


class Study:
    """The lab's study on ``cluster``: the uninterrupted run (baseline) and faulted runs compared with it."""

    def __init__(self, cluster: LabRayCluster, work: Path, seed: int, progress: Callable[[str], None] = print,
                 extra: Sequence[str] = ()) -> None:
        self.cluster, self.work, self.seed, self.progress = cluster, Path(work), seed, progress
        self.args = [*STUDY, *extra]
        self.work.mkdir(parents=True, exist_ok=True)

    def start(self, out_dir: Path, name: str, *extra: str) -> subprocess.Popen:
        out_dir.mkdir(parents=True, exist_ok=True)
        return self.cluster.driver([*self.args, *extra, f"out_dir={out_dir}", f"run_name={name}"],
                                   self.work / f"{name}.log", cwd=self.work)

    def resume(self, run: Path, name: str, timeout_s: float = 400) -> tuple[int, float, str]:
        """``fdam train --resume run``: (exit code, seconds, output)."""
        log = self.work / f"{name}.resume.log"
        t0 = time.monotonic()
        proc = self.cluster.driver(["--resume", str(run)], log, cwd=self.work)
        rc = _wait(proc, log, timeout_s)
        return rc, time.monotonic() - t0, log.read_text()

    def baseline(self) -> dict:
        t0 = time.monotonic()
        proc = self.start(self.work / "runs", "baseline")
        rc = _wait(proc, self.work / "baseline.log", 600)
        wall = time.monotonic() - t0
        if rc != 0:
            raise RuntimeError(f"the baseline failed ({rc}):\n{(self.work / 'baseline.log').read_text()[-3000:]}")
        self.base_dir = self.work / "runs" / "baseline"
        self.base_rows = metric_rows(self.base_dir)
        self.base_state = final_state(self.base_dir)
        walls = [r["wall_s"] for r in self.base_rows]
        steps = sorted(b - a for a, b in itertools.pairwise(walls[1:]))
        self.round_s = steps[len(steps) // 2]
        self.base_wall = wall
        what = (f"CODASCA, synthetic data, 6 clients (2 per actor, one actor per worker node: SPREAD), {ROUNDS} "
                f"rounds of {LOCAL_STEPS} local steps, evaluated and checkpointed every round, reduce=star, "
                f"fold_order=client, training seed 0; a head and 3 worker nodes at {', '.join(self.cluster.ips)}; "
                f"a round {self.round_s:.2f} s")
        self.progress(f"[ray] baseline: {wall:.1f} s ({what})")
        return {"wall_s": round(wall, 2), "what": what, "round_s": round(self.round_s, 3)}

    def at(self, name: str) -> tuple[int, float]:
        return seeded_point(self.seed, name, 2, ROUNDS - 1)

    def strike_at(self, run: Path, proc: subprocess.Popen, log: Path, r: int, offset: float) -> float:
        """Wait until round ``r`` has begun (round r-1's metric row written) plus ``offset`` of a round; seconds
        after the row."""
        _until(lambda: any(int(x["round"]) >= r - 1 for x in _rows(run)), proc, log)
        time.sleep(offset * self.round_s)
        return offset * self.round_s

    def judged(self, name: str, what: str, at: str, run: Path, wall: float, outcome: str, message: str = "",
               rc_resume: int = 0, resume_out: str = "") -> Fault:
        """The row of a fault whose run ended (resumed) in ``run`` after ``wall`` seconds in all."""
        if rc_resume != 0:
            return Fault(name, what, at, f"the resume failed ({rc_resume}): {_last_line(resume_out)}", False,
                         round(wall - self.base_wall, 2), ["the run did not finish"], message)
        diff = max_difference(final_state(run), self.base_state)
        lost = audit(run, self.base_rows, checkpoint_round=checkpoint_round(run), same_training=True)
        if diff != 0.0:
            outcome = f"finished {diff:.3g} from the uninterrupted study (not bit for bit)"
        survived = diff == 0.0 and not lost and outcome.startswith((BIT_FOR_BIT, RESUMED))
        return Fault(name, what, at, outcome, survived, round(wall - self.base_wall, 2), lost, message, diff)


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else ""


def _fdam_lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith("fdam:")]


# -- the faults ------------------------------------------------------------------------------------------------
def driver_kill(study: Study) -> Fault:
    """SIGKILL the ``fdam train`` process mid-round (its actors go with it), then ``fdam train --resume``."""
    name = "driver_kill"
    r, offset = study.at(name)
    out = study.work / "runs"
    run, log = out / name, study.work / f"{name}.log"
    t0 = time.monotonic()
    proc = study.start(out, name)
    after = study.strike_at(run, proc, log, r, offset)
    os.kill(proc.pid, signal.SIGKILL)  # the driver alone, as the OOM killer or a lost login would
    proc.wait(timeout=30)
    kill_tree(proc)  # anything of its session that outlived it
    killed_wall = time.monotonic() - t0
    held = checkpoint_round(run)
    lock = (run / ".lock").read_text().strip() if (run / ".lock").exists() else "(none)"
    rows_at_kill = len(_rows(run))
    at = f"round {r} + {after:.2f} s"
    what = (f"the fdam train process SIGKILLed {after:.2f} s into round {r} (its checkpoint then: round {held}, "
            f"{rows_at_kill} metric rows; its lock left behind: {lock!r}), then fdam train --resume")
    study.progress(f"[ray] {name}: killed at {at}; checkpoint round {held}; resuming")
    rc, resume_s, text = study.resume(run, name)
    outcome = (f"{BIT_FOR_BIT} (after fdam train --resume from round {held}; a SIGKILLed driver prints "
               "nothing, and its lock did not block the resume)")
    what += f" (the killed run {killed_wall:.1f} s, the resume {resume_s:.1f} s)"
    return study.judged(name, what, at, run, killed_wall + resume_s, outcome, rc_resume=rc, resume_out=text)


def raylet_kill(study: Study) -> Fault:
    """SIGKILL a worker node's raylet mid-round under ``on_client_failure: abort``: the run stops with one line, its
    last checkpoint (the round's start: checkpoint_every 1) holds every client's state; ``fdam train --resume`` on
    the two nodes left. (``retry`` rebuilds the lost clients as replaced ones, fresh samplers and the global
    control variates: the run finishes, near the baseline only; ``raylet_kill_retry`` measures it.)"""
    return _raylet_kill(study, "raylet_kill", "abort")


def raylet_kill_retry(study: Study) -> Fault:
    """As :func:`raylet_kill` under ``on_client_failure: retry`` (the default): the lost clients are replaced."""
    return _raylet_kill(study, "raylet_kill_retry", "retry")


def _raylet_kill(study: Study, name: str, policy: str) -> Fault:
    import random

    cluster = study.cluster
    r, offset = study.at(name)
    index = random.Random(f"{study.seed}:{name}:node").randrange(len(cluster.worker_nodes()))
    out = study.work / "runs"
    run, log = out / name, study.work / f"{name}.log"
    t0 = time.monotonic()
    proc = study.start(out, name, f"on_client_failure={policy}")
    after = study.strike_at(run, proc, log, r, offset)
    node = cluster.kill_raylet(index)
    ip = node.node_ip_address
    t_kill = time.monotonic()
    rc = _wait(proc, log, 600)
    stop_s = time.monotonic() - t_kill
    wall = time.monotonic() - t0
    text = log.read_text()
    lines, held = _fdam_lines(text), checkpoint_round(run)
    cluster.remove(node)  # what is left of the node (its agents); the node stays lost
    at = f"round {r} + {after:.2f} s"
    what = (f"worker node {ip}'s raylet SIGKILLed {after:.2f} s into round {r} (on_client_failure={policy}); ")
    try:
        if policy == "retry":
            what += f"the run went on and ended {stop_s:.1f} s later (exit {rc})"
            replaced = text.count("(replacement)") + (run / "train.log").read_text().count("replaced")
            outcome = BIT_FOR_BIT if rc == 0 else f"exit {rc}: {_last_line(text)}"
            study.progress(f"[ray] {name}: {ip} killed at {at}; exit {rc} after {stop_s:.1f} s ({replaced} "
                           "replacement lines)")
            return study.judged(name, what, at, run, wall, outcome, rc_resume=rc, resume_out=text)
        what += (f"the run stopped {stop_s:.1f} s later (exit {rc}, checkpoint round {held}); then fdam train "
                 "--resume on the two worker nodes left")
        study.progress(f"[ray] {name}: {ip} killed at {at}; exit {rc} after {stop_s:.1f} s, checkpoint round "
                       f"{held}; {len(lines)} fdam: lines; resuming on the nodes left")
        message = lines[0] if lines else _last_line(text)
        rc2, resume_s, resumed = study.resume(run, name)
        if rc == 0 or len(lines) != 1:
            outcome = f"did not stop with one line (exit {rc}, {len(lines)} fdam: lines)"
        else:
            outcome = f"{RESUMED} (from round {held}, on the two worker nodes left)"
        what += f" (the stopped run {wall:.1f} s, the resume {resume_s:.1f} s)"
        return study.judged(name, what, at, run, wall + resume_s, outcome, message, rc2, resumed)
    finally:
        cluster.add_worker()  # the lab's three worker nodes again, for what follows


def disk_full(study: Study) -> Fault:
    """The run folder on a small tmpfs, filled (a filler file takes every free byte) once round r-1's checkpoint
    is written: round r's writes fail. Expected: one line naming the folder and the failure, a non-zero exit, the
    previous checkpoint intact, no temporary file and no half-written metric row left; then the filler removed and
    ``fdam train --resume``."""
    name = "disk_full"
    r, offset = study.at(name)
    mnt = study.work / "tmpfs"
    mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], check=True, timeout=30)
    proc = None
    try:
        out = mnt / "runs"
        run, log = out / name, study.work / f"{name}.log"
        t0 = time.monotonic()
        proc = study.start(out, name)
        _until(lambda: (checkpoint_round(run) or -1) >= r - 1, proc, log)
        time.sleep(offset * study.round_s)
        filled = fill(mnt / "filler")
        before = (run / "checkpoint.pt").read_bytes()
        held_before = checkpoint_round(run)
        rc = _wait(proc, log, 300)
        wall = time.monotonic() - t0
        text = log.read_text()
        lines, held = _fdam_lines(text), checkpoint_round(run)
        damage = folder_damage(run)
        if (run / "checkpoint.pt").read_bytes() != before and held != r:
            damage.append("the checkpoint changed but does not hold round r")
        at = f"round {r} + {offset * study.round_s:.2f} s"
        what = (f"the run folder's tmpfs (6 MB) filled ({filled / 1e6:.2f} MB filler) {offset * study.round_s:.2f} s "
                f"after round {r - 1}'s checkpoint (round {held_before}); the run stopped (exit {rc}, checkpoint "
                f"round {held}); the filler removed, then fdam train --resume")
        study.progress(f"[ray] {name}: filled at {at}; exit {rc}; {len(lines)} fdam: lines; checkpoint round {held}; "
                       f"damage {damage}")
        message = lines[0] if lines else _last_line(text)
        (mnt / "filler").unlink()
        rc2, resume_s, resumed = study.resume(run, name)
        if rc == 0 or len(lines) != 1 or str(run) not in message or damage:
            outcome = f"did not stop cleanly (exit {rc}, {len(lines)} fdam: lines, damage: {damage})"
        else:
            outcome = f"{RESUMED} (from round {held}, after the space was freed)"
        what += f" (the stopped run {wall:.1f} s, the resume {resume_s:.1f} s)"
        fault = study.judged(name, what, at, run, wall + resume_s, outcome, message, rc2, resumed)
        fault.lost = [*damage, *fault.lost]
        fault.survived = fault.survived and not damage
        return fault
    finally:
        if proc is not None:
            kill_tree(proc)
        for proc_ in study.cluster.drivers:  # a resume still writing there
            kill_tree(proc_)
        if subprocess.run(["umount", str(mnt)], timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], timeout=30)


def fill(path: Path) -> int:
    """A file taking every free byte of ``path``'s filesystem; its size."""
    st = os.statvfs(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize)
        os.lseek(fd, 0, os.SEEK_END)
        chunk = bytes(4096)
        with contextlib.suppress(OSError):
            while os.write(fd, chunk) > 0:
                pass
    finally:
        os.close(fd)
    return path.stat().st_size


def folder_damage(run: Path) -> list[str]:
    """What a stopped run left damaged in its folder: temporary files, a checkpoint that does not load, a metric
    row half-written."""
    found = [f"a temporary file left: {p.name}" for p in run.iterdir() if p.name.endswith(".tmp")]
    if checkpoint_round(run) is None:
        found.append("checkpoint.pt does not load")
    for fname in ("metrics.jsonl", "metrics.csv"):
        path = run / fname
        if path.exists():
            data = path.read_bytes()
            tail = data.rsplit(b"\n", 1)[-1]
            if tail:
                found.append(f"{fname}: its last row half-written ({len(tail)} bytes)")
    return found


FAULTS: dict[str, Callable[[Study], Fault]] = {"driver_kill": driver_kill, "disk_full": disk_full,
                                               "raylet_kill": raylet_kill, "raylet_kill_retry": raylet_kill_retry}
DEFAULT = ["driver_kill", "disk_full", "raylet_kill"]  # raylet_kill_retry by name: the default policy's contrast
QUICK = ["driver_kill"]


def run_ray_faults(netlab: Path, work: Path, seed: int, *, quick: bool, names: list[str] | None = None,
                   progress: Callable[[str], None] = print) -> tuple[dict, list[Fault]]:
    """(baseline info dict: 'wall_s', 'what'), one Fault per fault.

    The cluster (head 127.0.0.6, workers .7-.9, no shaping) is started, the uninterrupted study run, then each
    fault of ``names`` (default: every fault, ``driver_kill`` only when ``quick``); everything is stopped after,
    and the lab fails when a process it started is left running."""
    chosen = names or (QUICK if quick else DEFAULT)
    unknown = [n for n in chosen if n not in FAULTS]
    if unknown:
        raise ValueError(f"unknown Ray faults {unknown}: choose from {', '.join(FAULTS)}")
    work = Path(work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    faults: list[Fault] = []
    with nothing_left_of(cluster_ips(FIRST_OCTET, 3)):
        cluster = LabRayCluster(netlab)
        try:
            cluster.start()
            progress(f"[ray] cluster up: head {cluster.head_ip}, workers {', '.join(cluster.ips[1:])}")
            study = Study(cluster, work, seed, progress)
            info = study.baseline()
            for name in chosen:
                fault = FAULTS[name](study)
                progress(f"[ray] {name}: {fault.outcome}; lost {fault.lost}; time lost {fault.time_lost_s} s")
                faults.append(fault)
        finally:
            cluster.stop()
    return info, faults
