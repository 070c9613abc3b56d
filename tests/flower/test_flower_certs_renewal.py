"""A consortium's credentials a year on (fdam_ray.flower.certs, .renewal): the authority outlives the server
certificate, the server certificate is signed again by the same authority (a TLS client that trusts only the old
ca.crt accepts it), a site's key is replaced with both fingerprints printed, and a certificate that expires soon is
named with its date. Every refusal is one line, exit status 2, and leaves the files as they were."""

from __future__ import annotations

import datetime
import socket
import ssl
import stat
import threading

import pytest

pytest.importorskip("cryptography")

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fdam_ray.flower.certs import fingerprint, main


def cert(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def days_left(c):
    return (c.not_valid_after_utc - datetime.datetime.now(datetime.UTC)).total_seconds() / 86400


def files(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def one_line_error(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def made(tmp_path, capsys, *more):
    folder = tmp_path / "certs"
    assert main(["--folder", str(folder), "--name", "superlink.example.org", "--ip", "127.0.0.1", "--sites", "3",
                 *more]) == 0
    capsys.readouterr()
    return folder


def handshake(folder):
    """A TLS handshake over a socket pair: the server presents server.pem, the client trusts ca.crt only."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(folder / "server.pem", folder / "server.key")
    client_ctx = ssl.create_default_context(cafile=str(folder / "ca.crt"))
    a, b = socket.socketpair()
    errors = []

    def serve():
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except OSError as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    with client_ctx.wrap_socket(b, server_hostname="superlink.example.org") as c:
        c.sendall(b"x")
        seen = x509.load_der_x509_certificate(c.getpeercert(binary_form=True))
    thread.join(5)
    assert not errors
    return seen


def test_the_authority_outlives_the_server_certificate_by_default(tmp_path, capsys):
    folder = made(tmp_path, capsys)
    assert 3649.9 < days_left(cert(folder / "ca.crt")) <= 3650
    assert 364.9 < days_left(cert(folder / "server.pem")) <= 365


@pytest.mark.parametrize("args, named", [
    (["--days", "0"], "--days 0"), (["--days", "-5"], "--days -5"), (["--ca-days", "0"], "--ca-days 0"),
    (["--ca-days", "300"], "--ca-days 300 is not allowed (at least --days 365"),
    (["--days", "400", "--ca-days", "399"], "--ca-days 399 is not allowed (at least --days 400"),
])
def test_bad_lifetimes_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys, args, named):
    assert main(["--folder", str(tmp_path / "c"), "--name", "localhost", *args]) == 2
    assert named in one_line_error(capsys)
    assert not (tmp_path / "c").exists()


def test_renew_signs_the_server_certificate_again_with_the_same_authority(tmp_path, capsys):
    folder = made(tmp_path, capsys, "--days", "20")
    before = files(folder)
    old = cert(folder / "server.pem")
    assert main(["renew", "--folder", str(folder), "--days", "365"]) == 0
    assert "renewed, valid until" in capsys.readouterr().out
    new = cert(folder / "server.pem")
    assert 364.9 < days_left(new) <= 365 and days_left(old) < 21
    ca = cert(folder / "ca.crt")
    ca.public_key().verify(new.signature, new.tbs_certificate_bytes, ec.ECDSA(new.signature_hash_algorithm))
    assert new.serial_number != old.serial_number and new.issuer == ca.subject
    sans = x509.SubjectAlternativeName
    assert new.extensions.get_extension_for_class(sans).value == old.extensions.get_extension_for_class(sans).value
    after = files(folder)
    assert {p for p in after if after[p] != before[p]} == {folder / "server.pem"}  # the CA, the keys: untouched
    assert set(after) == set(before)  # no temporary file left beside it
    assert handshake(folder) == new  # a client that trusts only the old ca.crt accepts it


def test_renew_refuses_a_certificate_that_would_outlive_its_authority(tmp_path, capsys):
    folder = made(tmp_path, capsys, "--days", "30", "--ca-days", "100")
    before = files(folder)
    assert main(["renew", "--folder", str(folder), "--days", "365"]) == 2
    err = one_line_error(capsys)
    end = cert(folder / "ca.crt").not_valid_after_utc
    assert f"ca.crt expires on {end:%Y-%m-%d}" in err and "--days 99 or less" in err
    assert files(folder) == before
    assert main(["renew", "--folder", str(folder), "--days", "0"]) == 2
    assert "--days 0 is not allowed" in one_line_error(capsys)


def test_a_renewal_that_fails_at_the_rename_keeps_the_old_certificate_whole(tmp_path, capsys, monkeypatch):
    from fdam_ray.flower import renewal

    folder = made(tmp_path, capsys)
    before = files(folder)

    def full_disk(*args):
        raise OSError(28, "No space left on device", str(folder / "server.pem"))

    monkeypatch.setattr(renewal.os, "replace", full_disk)
    assert main(["renew", "--folder", str(folder)]) == 2
    assert "No space left on device" in one_line_error(capsys)
    assert files(folder) == before


def test_renew_without_the_authoritys_key_is_one_line(tmp_path, capsys):
    folder = made(tmp_path, capsys)
    (folder / "ca.key").unlink()
    assert main(["renew", "--folder", str(folder)]) == 2
    assert "ca.key does not exist" in one_line_error(capsys)


def test_rotating_a_site_key_replaces_that_pair_only_and_prints_both_fingerprints(tmp_path, capsys):
    folder = made(tmp_path, capsys)
    keys = folder / "keys"
    before = files(folder)
    old = fingerprint((keys / "site1.pub").read_bytes())
    assert main(["rotate-site", "--folder", str(folder), "--site", "1"]) == 0
    out = capsys.readouterr().out
    private = serialization.load_ssh_private_key((keys / "site1").read_bytes(), None)
    new = fingerprint((keys / "site1.pub").read_bytes())
    assert fingerprint(private.public_key()) == new != old
    assert f"fingerprint {new}, was {old}" in out and f"flower.site_keys: {{'1': '{new}'}}" in out
    assert stat.S_IMODE((keys / "site1").stat().st_mode) == 0o600
    after = files(folder)
    assert {p for p in after if after[p] != before[p]} == {keys / "site1", keys / "site1.pub"}
    assert set(after) == set(before)
    assert main(["rotate-site", "--folder", str(folder), "--site", "7"]) == 2  # no such key
    assert "site7.pub does not exist" in one_line_error(capsys)
    assert main(["rotate-site", "--folder", str(folder), "--site", "-1"]) == 2
    assert "--site -1 is not allowed" in one_line_error(capsys)


def test_check_names_each_certificate_that_expires_soon_with_its_date(tmp_path, capsys):
    from fdam_ray.flower.renewal import expiry_warnings

    folder = made(tmp_path, capsys, "--days", "10")
    server, ca = folder / "server.pem", folder / "ca.crt"
    assert main(["check", str(server), str(ca)]) == 0
    err = capsys.readouterr().err
    end = cert(server).not_valid_after_utc
    assert err.count("\n") == 1  # the server certificate only: the authority has 3650 days
    assert err.startswith(f"warning: {server} (the SuperLink certificate) expires on {end:%Y-%m-%d}")
    assert "renew --folder" in err
    assert main(["check", "--within", "5", str(server), str(ca)]) == 0 and capsys.readouterr().err == ""
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3640)
    lines = expiry_warnings([server, ca], now=later)
    assert len(lines) == 2 and "expired on" in lines[0]
    assert lines[1].startswith(f"{ca} (the authority) expires on") and "make a new authority" in lines[1]
    assert main(["check", str(folder / "missing.pem")]) == 2
    assert "missing.pem does not exist" in one_line_error(capsys)
