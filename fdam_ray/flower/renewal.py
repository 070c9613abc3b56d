"""A consortium's credentials a year on: the SuperLink's certificate signed again by the consortium's own
authority, one site's SuperNode key replaced, and a warning before a certificate expires.

:mod:`.certs` makes an authority that outlives the server certificates it signs (``--ca-days`` 3650, ``--days``
365), so renewing needs only the authority's key, where it is kept offline:

- ``python -m fdam_ray.flower.certs renew --folder F [--days N]``: ``server.pem`` signed again by ``ca.key`` for
  the same key ``server.key`` and the same names (or ``--name``/``--ip``), valid ``N`` days from now; one that
  would outlive the authority is refused (:func:`renew_server`);
- ``rotate-site --folder F --site K``: a new key pair ``keys/siteK``, ``keys/siteK.pub``, with the old and new
  fingerprints printed, for the SuperLink's registered keys and ``flower.site_keys`` (:func:`rotate_site_key`);
- ``check FILE ...``: a warning for each certificate that expires within ``--within`` days (30), naming the
  file and the date (:func:`expiry_warnings`); the SuperLink's service unit runs it before each start.

A file they replace is replaced only once its successor is whole on disk (written beside it, then renamed), and
errors are one line (exit status 2).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fdam_ray.flower.pki import (
    DEFAULT_DAYS,
    MAX_SITES,
    WARN_DAYS,
    Certificates,
    NodeKey,
    _names,
    _server_cert,
    _write_new,
    check_days,
    fingerprint,
)

log = logging.getLogger(__name__)


def _replace(path: Path, data: bytes, *, private: bool) -> None:
    """Replace ``path`` by ``data`` only once they are whole on disk: written beside it, then renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    try:
        tmp.unlink(missing_ok=True)
        _write_new(tmp, data, private=private)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path, what: str, parse: Any = bytes) -> Any:
    """``parse`` of the file's bytes; a missing or unreadable file is one line saying which and what it is."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist ({what})")
    try:
        return parse(path.read_bytes())
    except ValueError:
        raise ValueError(f"{path} is not {what} in PEM form") from None


def _load_cert(path: Path, what: str) -> Any:
    from cryptography import x509

    return _read(path, what, x509.load_pem_x509_certificate)


def renew_server(folder: str | Path, *, days: float = DEFAULT_DAYS, dns: Sequence[str] = (),
                 ips: Sequence[str] = ()) -> Certificates:
    """The SuperLink's certificate (``server.pem``) signed again by the folder's authority (``ca.crt``,
    ``ca.key``) for its key ``server.key``, valid ``days`` from now, for the names and addresses it had (or
    ``dns``/``ips`` when given). A certificate that would outlive the authority is refused in one line; the old
    ``server.pem`` stays until the new one is whole on disk."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    check_days(days)
    folder = Path(folder)
    out = Certificates(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    ca = _load_cert(out.ca, "the consortium's authority certificate")
    ca_key = _read(folder / "ca.key", "the authority's key (renew where it is kept)",
                   lambda b: serialization.load_pem_private_key(b, None))
    if ca.public_key().public_numbers() != ca_key.public_key().public_numbers():
        raise ValueError(f"{folder / 'ca.key'} is not the key of {out.ca}: renew with the authority's own key")
    key = _read(out.server_key, "the SuperLink's key", lambda b: serialization.load_pem_private_key(b, None))
    if dns or ips:
        sans = x509.SubjectAlternativeName(_names(dns, ips))
    else:
        sans = _load_cert(out.server_cert, "the certificate to renew").extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
    end = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=days)
    if end > ca.not_valid_after_utc:
        left = (ca.not_valid_after_utc - datetime.datetime.now(datetime.UTC)).days
        raise ValueError(f"--days {days:g} is not allowed: {out.ca} expires on {ca.not_valid_after_utc:%Y-%m-%d}, "
                         f"before such a certificate would ({end:%Y-%m-%d}); give --days {max(left, 0)} or less, or "
                         "make a new authority and give its ca.crt to every site")
    cert = _server_cert(ca, ca_key, key.public_key(), sans, days)
    _replace(out.server_cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return out


def rotate_site_key(folder: str | Path, site: int) -> tuple[str, NodeKey]:
    """A new key pair for site ``site`` in the keys ``folder`` (``site<k>``, ``site<k>.pub``), replacing its
    current one, which must be there; (the old public key's fingerprint, the new pair). The old files stay until
    both new ones are whole on disk."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not isinstance(site, int) or isinstance(site, bool) or not 0 <= site < MAX_SITES:
        raise ValueError(f"--site {site!r} is not allowed (a site number in [0, {MAX_SITES}))")
    folder = Path(folder)
    private, public = folder / f"site{site}", folder / f"site{site}.pub"
    old = _read(public, f"site {site}'s public key (made with --sites)", fingerprint)
    key = ec.generate_private_key(ec.SECP256R1())
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _replace(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                        serialization.NoEncryption()), private=True)
    _replace(public, pub + f" site{site}\n".encode(), private=False)
    return old, NodeKey(private, public, fingerprint(key.public_key()))


def expiry_warnings(paths: Iterable[str | Path], *, within: float = WARN_DAYS,
                    now: datetime.datetime | None = None) -> list[str]:
    """One line for each certificate in ``paths`` that expires within ``within`` days of ``now`` (or has),
    naming the file, the date and what to do; none for the others."""
    now = now or datetime.datetime.now(datetime.UTC)
    out = []
    for path in map(Path, paths):
        cert = _load_cert(path, "a certificate to check")
        end = cert.not_valid_after_utc
        if end - now > datetime.timedelta(days=within):
            continue
        authority = cert.issuer == cert.subject
        todo = ("make a new authority and give its ca.crt to every site and study member" if authority else
                "renew it: python -m fdam_ray.flower.certs renew --folder <the folder of ca.key>")
        when = (f"expired on {end:%Y-%m-%d %H:%M} UTC" if end <= now else
                f"expires on {end:%Y-%m-%d %H:%M} UTC, in {(end - now).days} days")
        out.append(f"{path} ({'the authority' if authority else 'the SuperLink certificate'}) {when}: {todo}")
    return out


def parsers() -> dict[str, argparse.ArgumentParser]:
    def command(name: str, text: str) -> argparse.ArgumentParser:
        return argparse.ArgumentParser(prog=f"python -m fdam_ray.flower.certs {name}", description=text)

    renew = command("renew", "Sign the SuperLink's certificate (server.pem) again with the folder's authority "
                    "(ca.crt, ca.key), for its key server.key, valid --days from now (default: the same names).")
    renew.add_argument("--folder", required=True, help="the folder of ca.crt, ca.key, server.pem and server.key")
    renew.add_argument("--days", type=float, default=DEFAULT_DAYS, help=f"validity in days (default {DEFAULT_DAYS})")
    renew.add_argument("--name", action="append", default=[], metavar="DNS", help="a DNS name (repeat for more)")
    renew.add_argument("--ip", action="append", default=[], metavar="ADDRESS", help="an IP address (repeat)")
    rotate = command("rotate-site", "Give site K a new key pair (keys/siteK, keys/siteK.pub); prints both "
                     "fingerprints.")
    rotate.add_argument("--folder", required=True, help="the folder given when the keys were made")
    rotate.add_argument("--site", type=int, required=True, help="the site number K")
    check = command("check", "Warn of each certificate that expires within --within days (exit status 0).")
    check.add_argument("files", nargs="+", metavar="FILE", help="a certificate (ca.crt, server.pem)")
    check.add_argument("--within", type=float, default=WARN_DAYS, help=f"days ahead (default {WARN_DAYS})")
    return {"renew": renew, "rotate-site": rotate, "check": check}


def command(name: str, argv: Sequence[str]) -> int:
    """``renew``, ``rotate-site`` or ``check``: errors in one line (exit status 2)."""
    args = parsers()[name].parse_args(argv)
    try:
        if name == "renew":
            out = renew_server(args.folder, days=args.days, dns=args.name, ips=args.ip)
            end = _load_cert(out.server_cert, "the renewed certificate").not_valid_after_utc
            print(f"SuperLink: {out.server_cert} renewed, valid until {end:%Y-%m-%d %H:%M} UTC (key {out.server_key} "
                  "kept): copy it to the SuperLink host and restart the SuperLink")
        elif name == "rotate-site":
            old, key = rotate_site_key(Path(args.folder) / "keys", args.site)
            print(f"site {args.site}: new key {key.private} (to the site only), {key.public} (register it: flwr "
                  f"supernode register {key.public} <federation>); fingerprint {key.fingerprint}, was {old}")
            print(f"in the study's config: flower.site_keys: {{'{args.site}': '{key.fingerprint}'}} (the server "
                  f"binds site {args.site} to the new key; the old one is refused)")
        else:
            for line in expiry_warnings(args.files, within=args.within):
                print(f"warning: {line}", file=sys.stderr)
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc.filename or args.folder}: {exc.strerror or exc} (nothing was replaced)", file=sys.stderr)
        return 2
    return 0
