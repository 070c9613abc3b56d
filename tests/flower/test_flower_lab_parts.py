"""The consortium's node addresses and SuperLink database (fdam_ray.flower.deployment): the command lines and
environments its processes get, without starting any."""

from __future__ import annotations

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
