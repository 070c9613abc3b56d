"""Who may be a site: each site number bound to its node's public key (a different node claiming it is refused
and named, unless the operator says so with flower.site_keys), the binding kept in a file that outlives the
server, every site on the server's fdam-ray version, and the consortium's certificates and node keys. A real
consortium with node authentication (an unregistered node kept out, a registered impostor refused) is
tests/flower/test_flower.py's deployment test."""

from __future__ import annotations

import base64
import datetime
import hashlib
import importlib.util
import ipaddress
import json
import logging
import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest

from fdam_ray.config import ConfigError

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # before flwr is imported: nothing leaves 127.0.0.0/8
pytestmark = pytest.mark.skipif(importlib.util.find_spec("flwr") is None, reason="Flower is not installed")

CODASCA = dict(algorithm="codasca", model="linear", batch_size=8, seed=3, executor="inline", local_steps=2,
               iterations=6, lr=0.2, global_lr=1.3, prox_weight=0.01, stage_length=6, eval_every=6)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flower-auth-sites")
    rng = np.random.default_rng(1)
    for k, n in enumerate((30, 40, 36)):
        x, x_test = rng.normal(size=(n, 4)).astype(np.float32), rng.normal(size=(20, 4)).astype(np.float32)
        np.savez(folder / f"site{k}.npz", x=x, y=(x[:, 0] > 0).astype(np.float32), x_test=x_test,
                 y_test=(x_test[:, 0] > 0).astype(np.float32))
    return folder


def node_config(folder, site):
    return {"site": site, "data": str(folder / f"site{site}.npz")}


def new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1()).public_key()


def pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def ssh_fingerprint(key) -> str:
    """ssh-keygen -lf's fingerprint, recomputed here from the key's OpenSSH line."""
    from cryptography.hazmat.primitives import serialization

    line = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    digest = hashlib.sha256(base64.b64decode(line.split()[1])).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def keyed_grid(folder, app=None, sites=3):
    """An in-process grid whose nodes hold key pairs, as SuperNodes under node authentication: the grid reports
    each node's public key (``get_nodes``) and a restarted node keeps its key (a new node id, as a SuperNode
    restarted without the SuperLink's registration would get)."""
    from flwr.proto.node_pb2 import NodeInfo

    from fdam_ray.flower.client_app import app as client_app
    from fdam_ray.flower.inprocess import InProcessGrid

    class KeyedGrid(InProcessGrid):
        def __init__(self, *args, **kwargs):
            self.keys, self.told, self.activated = {}, [], {}
            super().__init__(*args, **kwargs)

        def add_node(self, node_config, key=None):
            node = super().add_node(node_config)
            self.keys[node] = key or new_key()
            return node

        def restart_node(self, node):
            key, config = self.keys.pop(node), self.contexts.pop(node).node_config
            return self.add_node(config, key)

        def get_nodes(self):
            return [NodeInfo(node_id=n, public_key=pem(self.keys[n]), last_activated_at=self.activated.get(n, "t0"))
                    for n in self.get_node_ids()]

        def push_messages(self, messages):
            messages = list(messages)
            self.told += [(m.metadata.message_type, m.metadata.dst_node_id) for m in messages]
            return super().push_messages(messages)

    return KeyedGrid(app or client_app, [node_config(folder, k) for k in range(sites)])


def executor(grid, bindings_dir=None, **flower):
    from fdam_ray.executors.flower_section import FlowerSection
    from fdam_ray.flower.executor import FlowerExecutor

    return FlowerExecutor(grid, FlowerSection(connect_timeout_s=5, **flower), run_key="r", num_sites=3,
                          bindings_dir=bindings_dir)


def bindings_of(path: Path) -> dict[int, str]:
    return {int(k): v["key"] for k, v in json.loads((path / "site-bindings.json").read_text())["sites"].items()}


# -- sites bound to their nodes' keys ---------------------------------------------------------------------------
def test_at_the_start_each_site_is_bound_to_its_nodes_key_in_a_file(folder, tmp_path):
    grid = keyed_grid(folder)
    executor(grid, tmp_path).connect()
    expected = {k: ssh_fingerprint(grid.keys[grid.node_of_site(k)]) for k in range(3)}
    assert bindings_of(tmp_path) == expected
    assert len(set(expected.values())) == 3


def test_a_node_with_another_key_claiming_a_bound_site_is_refused_in_one_line_naming_both(folder, caplog):
    grid = keyed_grid(folder)
    ex = executor(grid)
    ex.connect()
    first = grid.node_of_site(1)
    impostor = grid.add_node(node_config(folder, 1))
    with caplog.at_level(logging.INFO):
        ex.refresh()
        ex.refresh()  # asked once, refused once
    lines = [r.getMessage() for r in caplog.records if r.name == "fdam_ray.flower.executor"
             and r.levelno >= logging.ERROR and "is refused" in r.getMessage()]  # the server's
    bound, claiming = ssh_fingerprint(grid.keys[first]), ssh_fingerprint(grid.keys[impostor])
    assert len(lines) == 1 and "\n" not in lines[0]
    assert (f"site 1 is bound to node {first} ({bound}); node {impostor} ({claiming}) claims it and is refused"
            in lines[0])
    assert f"flower.site_keys: {{'1': '{claiming}'}}" in lines[0]  # what to do, if it was on purpose (YAML)
    assert ex.node_of[1] == first and impostor not in ex.site_of
    assert ("query.refused", impostor) in grid.told  # the node is told, its own log says why
    site_side = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"site 1 (node {impostor}): "
                                                                                      "refused by the server")]
    assert site_side and f"node {impostor} ({claiming}) claims it" in site_side[0]
    assert [t for t, n in grid.told if n == impostor] == ["query.hello", "query.refused"]


def test_a_run_goes_on_with_the_bound_node_when_another_claims_its_site_mid_run(folder, caplog):
    from fdam_ray.flower.inprocess import server_context
    from fdam_ray.flower.server_app import run_federation

    grid = keyed_grid(folder)
    impostors = []
    push = grid.push_messages

    def push_and_join(messages):  # after round 1's messages, a node with its own key says it is site 1
        messages = list(messages)
        if not impostors and any(m.metadata.message_type == "train.round" for m in messages):
            impostors.append(grid.add_node(node_config(folder, 1)))
        return push(messages)

    grid.push_messages = push_and_join
    with caplog.at_level(logging.WARNING):
        result = run_federation(grid, server_context(), {**CODASCA, "num_clients": 3})
    assert result.state.iteration == CODASCA["iterations"]
    assert impostors and not [t for t, n in grid.told if n == impostors[0] and t not in ("query.hello",
                                                                                         "query.refused")]
    assert caplog.text.count(f"node {impostors[0]} (") == 2  # the server's line, and the node's own
    assert "is now node" not in caplog.text


def test_a_server_without_a_run_dir_keeps_the_bindings_in_the_run_folder_it_makes(folder, tmp_path):
    from fdam_ray.flower.inprocess import server_context
    from fdam_ray.flower.server_app import run_federation

    grid = keyed_grid(folder)
    result = run_federation(grid, server_context(), {**CODASCA, "num_clients": 3, "out_dir": str(tmp_path / "out")},
                            save=True)
    made = Path(result.run_dir)
    assert made.parent == tmp_path / "out"
    assert bindings_of(made) == {k: ssh_fingerprint(grid.keys[grid.node_of_site(k)]) for k in range(3)}


def test_the_binding_outlives_the_server_and_a_new_node_for_a_site_stops_the_start_naming_it(folder, tmp_path):
    from fdam_ray.flower.executor import SiteRefused

    grid = keyed_grid(folder)
    executor(grid, tmp_path).connect()
    old = grid.node_of_site(1)
    grid.contexts.pop(old)  # site 1's machine is replaced: a node with a new key, nobody said so
    new = grid.add_node(node_config(folder, 1))
    with pytest.raises(SiteRefused) as caught:
        executor(grid, tmp_path).connect()  # a restarted server, the same folder
    message = str(caught.value)
    assert "\n" not in message and "sites [1] have not connected" in message
    assert f"site 1 is bound to node {old} ({ssh_fingerprint(grid.keys[old])})" in message
    assert f"node {new} ({ssh_fingerprint(grid.keys[new])}) claims it" in message


def test_flower_site_keys_replaces_a_sites_node_explicitly_and_the_old_one_is_refused(folder, tmp_path, caplog):
    grid = keyed_grid(folder)
    executor(grid, tmp_path).connect()
    old = grid.node_of_site(1)
    new = grid.add_node(node_config(folder, 1))
    replacement = ssh_fingerprint(grid.keys[new])
    ex = executor(grid, tmp_path, site_keys={1: replacement})
    with caplog.at_level(logging.WARNING):
        ex.connect()
    assert ex.node_of[1] == new and old not in ex.site_of
    assert bindings_of(tmp_path)[1] == replacement
    assert re.search(rf"site 1 is bound to (key|node {new}) \(?{re.escape(replacement)}\)?; node {old} \(",
                     caplog.text)
    assert f"site 1 is bound to the node with key {replacement} by flower.site_keys (it was node {old}" in caplog.text


def test_a_restarted_node_with_its_key_takes_its_site_back(folder, caplog):
    grid = keyed_grid(folder)
    ex = executor(grid)
    ex.connect()
    old = grid.node_of_site(2)
    new = grid.restart_node(old)
    with caplog.at_level(logging.WARNING):
        ex.refresh()
    assert ex.node_of[2] == new and "is refused" not in caplog.text


def test_a_supernode_restarted_under_the_same_node_id_is_asked_again_which_site_it_is(folder, caplog):
    """Under node authentication a restarted SuperNode keeps its node id (the SuperLink binds it to the key);
    that it came online again is what says it restarted (its node state is gone)."""
    from flwr.app import RecordDict

    grid = keyed_grid(folder)
    ex = executor(grid)
    ex.connect()
    node = grid.node_of_site(2)
    grid.contexts[node].state = RecordDict()
    grid.activated[node] = "t1"
    with caplog.at_level(logging.WARNING):
        ex.refresh()
    assert [t for t, n in grid.told if n == node].count("query.hello") == 2
    assert ex.node_of[2] == node and f"site 2 (node {node}) came online again" in caplog.text
    assert "is refused" not in caplog.text


def test_a_grid_that_reports_no_keys_binds_nothing_and_bind_sites_false_binds_nothing(folder, tmp_path):
    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.inprocess import InProcessGrid

    executor(InProcessGrid(app, [node_config(folder, k) for k in range(3)]), tmp_path).connect()
    assert not (tmp_path / "site-bindings.json").exists()
    grid = keyed_grid(folder)
    ex = executor(grid, tmp_path, bind_sites=False)
    ex.connect()
    assert ex.bindings is None and not (tmp_path / "site-bindings.json").exists()


# -- the same fdam-ray on every site ----------------------------------------------------------------------------
def test_a_site_on_another_fdam_ray_version_is_refused_at_its_first_message_naming_both(folder, caplog,
                                                                                         monkeypatch):
    import fdam_ray
    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.executor import SiteRefused

    def site_2_runs_0_0_1(msg, context):
        if int(context.node_config["site"]) != 2:
            return app(msg, context)
        with monkeypatch.context() as m:
            m.setattr(fdam_ray, "__version__", "0.0.1")
            return app(msg, context)

    grid = keyed_grid(folder, site_2_runs_0_0_1)
    with caplog.at_level(logging.WARNING), pytest.raises(SiteRefused) as caught:
        executor(grid).connect()
    message, node, ours = str(caught.value), grid.node_of_site(2), fdam_ray.__version__
    assert "\n" not in message and "sites [2] have not connected" in message
    assert f"node {node} (site 2) runs fdam-ray 0.0.1 and the server fdam-ray {ours}" in message
    site_side = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
                 and r.getMessage().startswith(f"site 2 (node {node}) runs fdam-ray 0.0.1")]
    assert site_side and f"the server fdam-ray {ours}" in site_side[0]
    assert [t for t, n in grid.told if n == node] == ["query.hello"]  # refused at its first message


def test_a_site_that_does_not_say_its_version_is_refused(folder):
    from fdam_ray.flower import records
    from fdam_ray.flower.client_app import app
    from fdam_ray.flower.executor import SiteRefused

    def older_site_0(msg, context):
        reply = app(msg, context)
        if msg.metadata.message_type == "query.hello" and int(context.node_config["site"]) == 0:
            del reply.content.config_records[records.CONFIG]["fdam_ray_version"]
        return reply

    with pytest.raises(SiteRefused, match=r"runs fdam-ray an fdam-ray that does not say its version"):
        executor(keyed_grid(folder, older_site_0)).connect()


# -- the flower section's new fields ----------------------------------------------------------------------------
@pytest.mark.parametrize("values, field", [
    ({"bind_sites": "yes"}, "bind_sites"),
    ({"site_keys": {1: "not a fingerprint"}}, "site_keys"),
    ({"site_keys": {-1: "SHA256:" + "A" * 43}}, "site_keys"),
    ({"site_keys": {"one": "SHA256:" + "A" * 43}}, "site_keys"),
    ({"site_keys": ["SHA256:" + "A" * 43]}, "site_keys"),
])
def test_the_binding_fields_refuse_bad_values_in_one_line(values, field):
    from fdam_ray.flower import split_config

    with pytest.raises(ConfigError, match=rf"^config field 'flower\.{field}': .* is not allowed \(.+\)$"):
        split_config({"flower": values})
    _, section = split_config({"flower": {"site_keys": {"2": " SHA256:" + "b" * 43}}})
    assert section.site_keys == {2: "SHA256:" + "b" * 43} and section.bind_sites


# -- a consortium's certificates and node keys ------------------------------------------------------------------
def test_the_certificate_tool_makes_a_ca_a_server_certificate_for_its_names_and_site_keys(tmp_path, capsys):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from fdam_ray.flower.certs import main

    out = tmp_path / "certs"
    args = ["--folder", str(out), "--name", "superlink.consortium.example", "--name", "localhost",
            "--ip", "127.0.0.1", "--days", "30", "--sites", "2"]
    assert main(args) == 0
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["superlink.consortium.example", "localhost"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    ca.public_key().verify(server.signature, server.tbs_certificate_bytes, ec.ECDSA(server.signature_hash_algorithm))
    assert server.issuer == ca.subject and ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    days = (server.not_valid_after_utc - datetime.datetime.now(datetime.UTC)).total_seconds() / 86400
    assert 29.9 < days <= 30.0
    printed = capsys.readouterr().out
    for k in range(2):
        private = serialization.load_ssh_private_key((out / "keys" / f"site{k}").read_bytes(), None)
        public = serialization.load_ssh_public_key((out / "keys" / f"site{k}.pub").read_bytes())
        assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp256r1"
        assert pem(private.public_key()) == pem(public)
        assert f"site {k}: " in printed and ssh_fingerprint(public) in printed
    for private in [out / "ca.key", out / "server.key", out / "keys" / "site0", out / "keys" / "site1"]:
        assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(args) == 2  # nothing is overwritten
    assert "exists" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    with pytest.raises(ValueError, match="not an IPv4"):
        from fdam_ray.flower.certs import make_certificates

        make_certificates(tmp_path / "other", dns=[], ips=["superlink.example"])
