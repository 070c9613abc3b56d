"""The consortium's node addresses and SuperLink database (fdam_ray.flower.deployment): the command lines and
environments its processes get, without starting any."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography import x509
from flower_helpers import HAVE_FLOWER

pytestmark = pytest.mark.skipif(not HAVE_FLOWER, reason="Flower is not installed (fdam-ray's flower extra)")


def _after(args, flag):
    return args[args.index(flag) + 1]


def test_the_superlink_and_each_site_get_their_own_address_and_environment(tmp_path):
    from fdam_ray.flower.deployment import Consortium

    sites = [{"site": k, "data": f"site{k}.npz"} for k in range(2)]
    seen = []

    def env(ip, base):
        seen.append(ip)
        return {**base, "NODE": ip}

    c = Consortium(tmp_path, sites, superlink_host="127.0.0.2", site_hosts=["127.0.0.3", "127.0.0.4"],
                   host_env=env, database=tmp_path / "link.db")
    link = c.superlink_args()
    assert _after(link, "--host") == "127.0.0.2" and _after(link, "--database") == str(tmp_path / "link.db")
    assert "--enable-supernode-auth" in link
    for k, ip in enumerate(["127.0.0.3", "127.0.0.4"]):
        node = c.site_args(k)
        assert _after(node, "--superlink") == f"127.0.0.2:{c.port}" and _after(node, "--host") == ip
    assert f'address = "127.0.0.2:{c.port}"' in (c.home / "config.toml").read_text()
    sans = x509.load_pem_x509_certificate(c.certs.server_cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert {str(a) for a in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "127.0.0.2"}
    late = c.add_site({"site": 2, "data": "x.npz"}, host="127.0.0.9")
    assert c.site_host(late) == "127.0.0.9" and c.site_host(1) == "127.0.0.4"
    proc = c._start("probe", ["/bin/sh", "-c", 'echo "$NODE"'], "127.0.0.3")
    proc.wait(10)
    assert (tmp_path / "probe.log").read_text().strip() == "127.0.0.3" and seen == ["127.0.0.3"]


def test_without_the_new_options_everything_stays_on_127_0_0_1_in_memory(tmp_path):
    from fdam_ray.flower.deployment import Consortium

    c = Consortium(tmp_path, [{"site": 0, "data": "a.npz"}])
    link = c.superlink_args()
    assert _after(link, "--host") == "127.0.0.1" and "--database" not in link
    assert _after(c.site_args(0), "--host") == "127.0.0.1"
    assert _after(c.site_args(0), "--superlink") == f"127.0.0.1:{c.port}"
    assert c.site_host(0) == "127.0.0.1"


def test_stop_also_ends_a_process_of_the_consortium_that_outlived_its_parent(tmp_path):
    """A SuperNode that crashed leaves its detached SuperExec: stop() finds it by the consortium's FLWR_HOME and
    ends it; a process of another FLWR_HOME is left alone."""
    import subprocess
    import time

    from fdam_ray.flower.deployment import Consortium, _alive

    c = Consortium(tmp_path / "c", [{"site": 0, "data": "a.npz"}])
    other = Consortium(tmp_path / "other", [{"site": 0, "data": "a.npz"}])
    stray = subprocess.Popen(["sleep", "60"], env=c.env, start_new_session=True)
    bystander = subprocess.Popen(["sleep", "60"], env=other.env, start_new_session=True)
    try:
        time.sleep(0.2)
        assert stray.pid in c.strays() and bystander.pid not in c.strays()
        c.stop()
        stray.wait(10)
        assert not _alive(stray.pid) and bystander.poll() is None
    finally:
        for proc in (stray, bystander):
            proc.kill()
            proc.wait(10)


def test_a_round_a_site_missed_on_flower_is_recorded_and_the_run_equals_its_replay(tmp_path):
    """Site 2's reply of round 7 is lost (past round_timeout_s): the round completes without it, the checkpoint
    and the next metrics record name the round's sites, and the inline run forced to those sets
    (participation_record) is the Flower run."""
    from flower_helpers import write_three_sites

    import fdam_ray
    from fdam_ray.checkpoint import load_checkpoint
    from fdam_ray.flower.client_app import app as client_app
    from fdam_ray.flower.inprocess import InProcessGrid, server_context
    from fdam_ray.flower.server_app import run_federation

    clients, test, folder = write_three_sites(tmp_path)
    case = dict(algorithm="codasca", model="linear", batch_size=8, seed=3, executor="inline", local_steps=3,
                iterations=24, lr=0.2, global_lr=1.3, prox_weight=0.01, stage_length=9, eval_every=6)

    def lose(msg):
        cfg = msg.content.config_records.get("config")
        return (msg.metadata.message_type == "train.round" and cfg is not None and "plan_round" in cfg
                and int(cfg["plan_round"]) == 7 and msg.metadata.dst_node_id == 103)

    sites = [{"site": k, "data": str(folder / f"site{k}.npz")} for k in range(3)]
    run = run_federation(InProcessGrid(client_app, sites, lose_reply=lose), server_context(),
                         {**case, "num_clients": 3, "flower": {"test_data": str(folder / "test.npz")}},
                         run_dir=tmp_path / "run")
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt").loop.participation == {"7": [0, 1]}
    assert [h.get("participation") for h in run.history] == ["", "", "", "", "r7=0,1"]  # rounds 0, 2, 4, 6, 8
    replay = fdam_ray.train_arrays(dict(case, participation_record=str(tmp_path / "run")), clients, test)
    inline = fdam_ray.train_arrays(case, clients, test)
    gap = max(float(np.abs(x.astype(np.float64) - replay.state.vectors()[n]).max())
              for n, x in run.state.vectors().items() if x is not None and x.size)
    assert gap <= 1e-6
    assert max(float(np.abs(x.astype(np.float64) - inline.state.vectors()[n]).max())
               for n, x in run.state.vectors().items() if x is not None and x.size) > 1e-4  # round 7 lacked site 2
