"""Placements a cluster can never hold fail within seconds, saying what was asked and what the nodes offer; a wait
for a placement that may come (an autoscaler, busy resources) says so, and a stop or a cluster that goes away ends
it at once."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from raytest import pids_using, ray_session

from fdam_ray.config import build_config
from fdam_ray.executors.ray import compat, placement
from fdam_ray.executors.ray.placement import Placement, wait_for_group
from fdam_ray.features.interrupts import RunStopped, clear_stop_request, request_stop

ARRAYS = dict(dataset="arrays", model="mlp", model_width=8, batch_size="full")


@pytest.fixture(scope="module", autouse=True)
def session():
    with ray_session():  # one node, 4 logical CPUs, no autoscaler
        yield


def no_leftover_groups() -> bool:
    return all(g["state"] == "REMOVED" for g in placement_group_table().values())


def test_a_ray_of_our_own_has_no_autoscaler():
    assert compat.autoscaler_configured() is False


def test_strict_spread_over_more_actors_than_nodes_fails_at_once_naming_the_nodes():
    config = build_config(dict(ARRAYS, num_clients=2, cpus_per_client=0.5, placement_strategy="STRICT_SPREAD"))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"STRICT_SPREAD puts each of the 2 actors on a node of its own, but the "
                                         r"cluster has 1 live node \(node [0-9.]+: CPU 4\) and no autoscaler"):
        Placement(config, 60.0).place(2, local=False)  # a joined cluster: Ray alone waits ray_timeout_s
    assert time.monotonic() - t0 < 30 and no_leftover_groups()


def test_more_cpus_than_a_joined_cluster_without_an_autoscaler_has_fails_at_once():
    config = build_config(dict(ARRAYS, num_clients=3, cpus_per_client=2.0))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"3 actors need more than the cluster offers \(CPU: 6 needed, 4 in the "
                                         r"cluster; 1 live node \(node [0-9.]+: CPU 4\), no autoscaler\)"):
        Placement(config, 60.0).place(3, local=False)
    assert time.monotonic() - t0 < 30 and no_leftover_groups()


def test_a_group_ray_finds_infeasible_ends_the_wait_when_nothing_can_grow():
    group = placement_group([{"CPU": 0.5}] * 2, strategy="STRICT_SPREAD")
    t0 = time.monotonic()
    try:
        with pytest.raises(ValueError, match=r"can never place two bundles: 1 live node .* no autoscaler"):
            wait_for_group(group, what="two bundles", timeout_s=60.0, grows=False)
    finally:
        remove_placement_group(group)
    assert time.monotonic() - t0 < 30


def test_with_an_autoscaler_the_wait_goes_on_with_a_progress_line(monkeypatch, caplog):
    monkeypatch.setattr(compat, "autoscaler_configured", lambda: True)
    config = build_config(dict(ARRAYS, num_clients=3, cpus_per_client=2.0))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fdam_ray.executors.ray.placement"):
        with pytest.raises(RuntimeError, match=r"was not placed within ray_timeout_s=4 s"):
            Placement(config, 4.0).place(3, local=False)
    assert 3.5 < time.monotonic() - t0 < 30 and no_leftover_groups()
    assert "waiting up to 4 s for its autoscaler to add nodes" in caplog.text
    assert "for the cluster to place 3 actor bundles {'CPU': 2.0} (PACK): an autoscaler may add nodes" in caplog.text


def test_a_stop_asked_for_while_waiting_for_a_placement_is_acted_on_within_seconds():
    """What ``fdam train``'s SIGTERM handler does (request_stop) ends the wait, with nothing trained."""
    blocker = placement_group([{"CPU": 4}])  # the cluster can hold the group, but not while this one is there
    ray.get(blocker.ready(), timeout=60)
    config = build_config(dict(ARRAYS, num_clients=2, cpus_per_client=1.0))
    timer = threading.Timer(1.0, request_stop, args=("received SIGTERM",))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(RunStopped, match=r"^received SIGTERM: stopped while waiting for the cluster to place 2 "
                                             r"actor bundles \{'CPU': 1.0\} \(PACK\); nothing was trained$"):
            Placement(config, 600.0).place(2, local=False)
    finally:
        timer.cancel()
        clear_stop_request()
        remove_placement_group(blocker)
    assert time.monotonic() - t0 < 5
    time.sleep(0.5)
    assert no_leftover_groups()


def test_a_lost_actor_waiting_to_be_placed_again_stops_when_asked(monkeypatch):
    config = build_config(dict(ARRAYS, num_clients=1, cpus_per_client=1.0, placement_timeout_s=600))
    where = Placement(config, 60.0)
    where.place(1, local=False)
    import ray.util

    monkeypatch.setattr(ray.util, "placement_group_table", lambda group: {"state": "RESCHEDULING"})  # not placed
    request_stop("received SIGTERM")
    t0 = time.monotonic()
    try:
        with pytest.raises(placement.PlacementError, match=r"^received SIGTERM: stopped while waiting for the "
                                                           r"cluster to place the bundle of actor 0 \(clients 0\) "
                                                           r"again"):
            where.wait_placed(0, [0])
    finally:
        clear_stop_request()
        where.release()
    assert time.monotonic() - t0 < 5


def test_a_gcs_query_that_hangs_ends_when_the_check_beside_it_raises():
    hung = threading.Event()
    calls = []

    def check():
        calls.append(time.monotonic())
        if len(calls) >= 3:
            raise placement.PlacementError("gone")

    t0 = time.monotonic()
    with pytest.raises(placement.PlacementError, match=r"^gone$"):
        placement.ask_gcs(lambda: hung.wait(60), check, poll_s=0.05)
    assert time.monotonic() - t0 < 2 and len(calls) == 3
    hung.set()
    assert placement.ask_gcs(lambda: 7, check) == 7  # an answer comes back, no check needed
    with pytest.raises(KeyError, match="missing"):  # the query's own error, raised in the caller
        placement.ask_gcs(lambda: {}["missing"], lambda: None)


def test_a_gcs_that_dies_during_a_placement_query_ends_the_wait_in_one_line(monkeypatch):
    """The GCS killed between the wait's check and its query: the query hangs (Ray reconnects for a minute, then
    ends the process); the wait must still end at once with the cluster named as gone."""
    blocker = placement_group([{"CPU": 4}])  # the group waits: the cluster is busy
    ray.get(blocker.ready(), timeout=60)
    group = placement_group([{"CPU": 1}])
    answers = iter([True])  # the GCS answers the first check, then never again
    release = threading.Event()
    monkeypatch.setattr("ray.util.placement_group_table", lambda g: release.wait(60) and {})
    monkeypatch.setattr(placement, "gcs_answers", lambda: next(answers, False))
    t0 = time.monotonic()
    try:
        with pytest.raises(placement.PlacementError, match=r"^the Ray cluster at [0-9.]+:[0-9]+ went away while "
                                                           r"placing one bundle \(its GCS no longer answers\); "
                                                           r"nothing was trained$"):
            wait_for_group(group, what="one bundle", timeout_s=600.0, grows=False)
    finally:
        release.set()
        remove_placement_group(group)
        remove_placement_group(blocker)
    assert time.monotonic() - t0 < 5


# -- a joined cluster that goes away while the actors wait to be placed ------------------------------------
VANISHING_SCRIPT = textwrap.dedent("""
    import threading, time
    import ray
    from ray.cluster_utils import Cluster
    from fdam_ray.config import build_config
    from fdam_ray.executors.ray.placement import Placement
    from fdam_ray.executors.errors import PlacementError

    from fdam_ray.executors.ray.compat import loopback_node
    with loopback_node():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                                "node_ip_address": "127.0.0.1"})
        ray.init(address=cluster.address)
    blocker = ray.util.placement_group([{"CPU": 1}])  # the actor fits the cluster, but not now: a wait
    ray.get(blocker.ready(), timeout=60)
    config = build_config(dict(dataset="arrays", model="mlp", num_clients=1, cpus_per_client=1.0))
    threading.Timer(3.0, lambda: cluster.head_node.kill_all_processes(check_alive=False, allow_graceful=False)).start()
    t0 = time.monotonic()
    try:
        Placement(config, 120.0).place(1, local=False)
        print("PLACED")
    except PlacementError as exc:
        print("ERROR", round(time.monotonic() - t0), str(exc).count(chr(10)), exc, flush=True)  # before exit
""")



@pytest.mark.fault  # a cluster of its own, killed: about a minute here (benchmarks/fault_tests.py)
def test_a_joined_cluster_that_goes_away_mid_placement_is_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = temp = tempfile.mkdtemp(prefix="fdv", dir="/tmp")  # short: Ray's socket paths
    try:
        out = subprocess.run([sys.executable, "-c", VANISHING_SCRIPT], capture_output=True, text=True, timeout=300,
                             env=env)
    finally:
        for pid in pids_using(temp):  # what the killed cluster left behind, and only that
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith(("ERROR", "PLACED"))), "")
    assert line.startswith("ERROR"), (out.stdout[-2000:], out.stderr[-3000:])
    _, took, newlines, message = line.split(" ", 3)
    assert int(took) < 30 and newlines == "0"
    assert "went away while placing 1 actor bundles {'CPU': 1.0} (PACK)" in message, message
    assert "Traceback" not in out.stdout


def test_a_resume_stopped_before_its_first_round_names_the_command_that_continues_it(tmp_path, monkeypatch, capsys):
    from fdam_ray.assembly import recipe
    from fdam_ray.cli import main
    from fdam_ray.executors.errors import PlacementError

    # a run to resume further (iterations=8 below): a finished run with its own plan is not trained again
    recipe.run(build_config(dict(dataset="synthetic", model="mlp", model_width=8, num_clients=2,
                                 samples_per_client=60, iterations=4, eval_every=2, executor="inline",
                                 out_dir=str(tmp_path), run_name="run", tensorboard=False)))
    gone = "the Ray cluster at 127.0.0.1:6379 went away while placing 2 actor bundles; nothing was trained"

    def cluster_went_away(*args, **kwargs):
        raise PlacementError(gone)

    monkeypatch.setattr(recipe, "federate", cluster_went_away)
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "run"), "executor=ray", "iterations=8"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"fdam: {gone}; its last checkpoint is kept: continue with: fdam train --resume {tmp_path / 'run'}"]

    def stopped(*args, **kwargs):
        raise RunStopped("received SIGTERM: stopped while waiting for the cluster to place 2 actor bundles", None)

    monkeypatch.setattr(recipe, "federate", stopped)
    assert main(["train", "--resume", str(tmp_path / "run"), "executor=ray", "iterations=8"]) == 143
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip().endswith(f"continue with: fdam train --resume {tmp_path / 'run'}")


# -- SIGTERM to `fdam train` while it waits for its actors to be placed -------------------------------------
WAITING_TRAIN = textwrap.dedent("""
    import sys
    import ray
    from ray.util.placement_group import placement_group
    from fdam_ray.cli import main
    from fdam_ray.executors.ray.compat import start_loopback_ray

    start_loopback_ray(num_cpus=1, include_dashboard=False)  # joined as a cluster fdam did not start (127.0.0.1)
    busy = placement_group([{"CPU": 1}])  # the actor fits the cluster, but not while this holds its CPU
    ray.get(busy.ready(), timeout=120)
    sys.exit(main(["train", "--no-progress", "executor=ray", "dataset=synthetic", "model=mlp", "num_clients=1",
                   "cpus_per_client=1", "iterations=2", "eval_every=1", "tensorboard=false",
                   "out_dir=" + sys.argv[1]]))
""")


def _wait_for_line(lines: list[str], start: str | None, contains: str, timeout_s: float) -> float:
    """Seconds until a line (read by another thread into ``lines``) starts with ``start`` or holds ``contains``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if any((start is not None and x.startswith(start)) or (contains and contains in x) for x in list(lines)):
            return time.monotonic() - t0
        time.sleep(0.1)
    pytest.fail(f"no such line within {timeout_s:g} s: {''.join(lines)[-3000:]}")


@pytest.mark.fault  # a Ray of its own and an fdam train process: about 20 s in CI (benchmarks/fault_tests.py)
def test_sigterm_to_fdam_train_waiting_for_its_placement_ends_it_within_seconds(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.Popen([sys.executable, "-c", WAITING_TRAIN, str(tmp_path / "runs")], env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        _wait_for_line(lines, None, "for the cluster to place 1 actor bundles", 180)  # the wait says so
        proc.send_signal(signal.SIGTERM)
        said = _wait_for_line(lines, "fdam: ", "", 30)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = "".join(lines)
    assert proc.returncode == 143, err[-3000:]
    assert said < 5, said  # acted on at the next poll, not after ray_timeout_s
    assert ("fdam: received SIGTERM: stopped while waiting for the cluster to place 1 actor bundles {'CPU': 1.0} "
            "(PACK); nothing was trained") in err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()
