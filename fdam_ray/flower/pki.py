"""The consortium's keys and certificates themselves (what :mod:`.certs`, the command line, and :mod:`.renewal`
make): its certificate authority, the SuperLink's TLS certificate, the sites' EC key pairs in OpenSSH form and
their ``SHA256:`` fingerprints, and the checks on names, addresses, counts and lifetimes. Files are written
once (``_write_new``: never over an existing one; private keys 0600)."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import hashlib
import ipaddress
import logging
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_DAYS = 365  # the SuperLink's certificate
DEFAULT_CA_DAYS = 3650  # the authority's: it signs the next server certificates
MAX_DAYS, MAX_CA_DAYS = 3650, 10950
WARN_DAYS = 30  # `check` warns of a certificate expiring this soon
MAX_SITES = 10_000  # a consortium's site count; more is a slip of the keyboard (each key takes milliseconds)
MAX_NAME = 64  # characters of a host name on the certificate (the common name's limit in RFC 5280)
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


@dataclasses.dataclass(frozen=True)
class Certificates:
    """The TLS files of a SuperLink: the authority's certificate (for every party) and the server's pair."""

    ca: Path
    server_cert: Path
    server_key: Path


@dataclasses.dataclass(frozen=True)
class NodeKey:
    """A site's SuperNode key pair (OpenSSH format) and the public key's fingerprint."""

    private: Path
    public: Path
    fingerprint: str


def fingerprint(public_key: Any) -> str:
    """``SHA256:<base64>`` of an EC public key (a key object, or its PEM or OpenSSH bytes): the SHA-256 of the key's
    OpenSSH wire form, as ``ssh-keygen -lf <key>.pub`` prints it."""
    from cryptography.hazmat.primitives import serialization

    if isinstance(public_key, (bytes, str)):
        data = public_key.encode() if isinstance(public_key, str) else public_key
        public_key = (serialization.load_pem_public_key(data) if data.lstrip().startswith(b"-----")
                      else serialization.load_ssh_public_key(data))
    line = public_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    blob = base64.b64decode(line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def _make_folder(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents, each 0700 whatever the umask; the folders made, outermost first."""
    missing = []
    for level in [folder, *folder.parents]:
        if level.exists():
            break
        missing.append(level)
    made = []
    for level in reversed(missing):
        os.mkdir(level, 0o700)
        made.append(level)
        os.chmod(level, 0o700)
    return made


def _write_new(path: Path, data: bytes, *, private: bool) -> None:
    """Write a file that must not exist yet (0600 for a private key, 0644 otherwise)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _refuse_existing(paths: Iterable[Path]) -> None:
    found = [str(p) for p in paths if p.exists()]
    if found:
        raise FileExistsError(f"{found[0]} exists{f' (and {len(found) - 1} more)' if len(found) > 1 else ''}: "
                              "nothing is overwritten; remove them or choose another folder")


def _names(dns: Sequence[str], ips: Sequence[str]) -> list[Any]:
    from cryptography import x509

    if not dns and not ips:
        raise ValueError("the SuperLink's certificate needs at least one host name or IP address")
    out: list[Any] = []
    for name in dns:
        check_host_name(name)
        out.append(x509.DNSName(name))
    for ip in ips:
        out.append(x509.IPAddress(check_address(ip)))
    return out


def check_host_name(name: Any) -> None:
    """A DNS name a certificate can hold: ASCII letters, digits and hyphens in dot-separated labels (a label
    neither starts nor ends with a hyphen), at most :data:`MAX_NAME` characters; else a one-line ValueError."""
    ok = (isinstance(name, str) and 0 < len(name) <= MAX_NAME and name.isascii()
          and all(_LABEL.fullmatch(label) for label in name.removesuffix(".").split(".")))
    if not ok:
        shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else repr(name[:40] + "...") + \
            f" ({len(name)} characters)"
        raise ValueError(f"--name {shown} is not allowed (a DNS name of at most {MAX_NAME} characters: ASCII "
                         "letters, digits and hyphens in labels separated by dots)")


def check_address(ip: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IP address a server is reached at: IPv4 or IPv6, neither unspecified (``0.0.0.0``, ``::``) nor
    multicast; else a one-line ValueError."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        raise ValueError(f"IP address {ip!r} is not an IPv4 or IPv6 address") from None
    if address.is_unspecified or address.is_multicast:
        kind = "unspecified" if address.is_unspecified else "multicast"
        raise ValueError(f"--ip {ip!r} is not allowed ({kind}: no client reaches a server there; give the address "
                         "the sites dial)")
    return address


def check_sites(sites: Any) -> None:
    """A count of site key pairs: a whole number in [0, :data:`MAX_SITES`]; else a one-line ValueError."""
    if not isinstance(sites, int) or isinstance(sites, bool) or not 0 <= sites <= MAX_SITES:
        raise ValueError(f"--sites {sites!r} is not allowed (a count of sites in [0, {MAX_SITES}])")


def check_days(days: Any, ca_days: Any = None) -> None:
    """A server certificate's ``days`` in (0, :data:`MAX_DAYS`] and an authority's ``ca_days`` in (0,
    :data:`MAX_CA_DAYS`], at least ``days`` (an authority that expires first ends TLS with it); else one line."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v

    def shown(v: Any) -> str:
        return f"{v:g}" if number(v) else repr(v)

    if not number(days) or not 0 < days <= MAX_DAYS:
        raise ValueError(f"--days {shown(days)} is not allowed (a number of days in (0, {MAX_DAYS}])")
    if ca_days is not None and (not number(ca_days) or not 0 < ca_days <= MAX_CA_DAYS):
        raise ValueError(f"--ca-days {shown(ca_days)} is not allowed (a number of days in (0, {MAX_CA_DAYS}])")
    if ca_days is not None and ca_days < days:
        raise ValueError(f"--ca-days {ca_days:g} is not allowed (at least --days {days:g}: the authority must outlive "
                         "the server certificate it signs)")


def make_certificates(folder: str | Path, *, dns: Sequence[str] = ("localhost",), ips: Sequence[str] = ("127.0.0.1",),
                      days: float = DEFAULT_DAYS, authority: str = "fdam consortium CA",
                      ca_days: float | None = None) -> Certificates:
    """A new certificate authority (``ca.crt``, its key ``ca.key``), valid ``ca_days`` (default the larger of
    :data:`DEFAULT_CA_DAYS` and ``days``), and a server certificate for ``dns`` and ``ips`` (``server.pem``,
    ``server.key``) signed by it, valid ``days`` from now; files already there stop it before anything is
    written."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_days = max(DEFAULT_CA_DAYS, days) if ca_days is None and isinstance(days, (int, float)) else ca_days
    check_days(days, ca_days)
    sans = x509.SubjectAlternativeName(_names(dns, ips))
    folder = Path(folder)
    out = Certificates(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    ca_key_path = folder / "ca.key"
    _refuse_existing([out.ca, ca_key_path, out.server_cert, out.server_key])
    _make_folder(folder)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    now = datetime.datetime.now(datetime.UTC)
    start = now - datetime.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name(authority)).issuer_name(name(authority))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(now + datetime.timedelta(days=ca_days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _server_cert(ca, ca_key, key.public_key(), sans, days)

    def pkcs8(k: Any) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    _write_new(ca_key_path, pkcs8(ca_key), private=True)
    _write_new(out.ca, ca.public_bytes(serialization.Encoding.PEM), private=False)
    _write_new(out.server_key, pkcs8(key), private=True)
    _write_new(out.server_cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return out


def _server_cert(ca: Any, ca_key: Any, public_key: Any, sans: Any, days: float) -> Any:
    """A server certificate for ``sans`` signed by the authority ``ca``, valid ``days`` from now."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    first = next((n.value for n in sans if isinstance(n, x509.DNSName)), str(next(iter(sans)).value))
    return (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, first)]))
            .issuer_name(ca.subject).public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(sans, critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))


def make_node_key(folder: str | Path, name: str) -> NodeKey:
    """A SuperNode's key pair: ``<name>`` (the private key, OpenSSH format, 0600) and ``<name>.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = Path(folder)
    private, public = folder / name, folder / f"{name}.pub"
    _refuse_existing([private, public])
    _make_folder(folder)
    key = ec.generate_private_key(ec.SECP256R1())
    _write_new(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()), private=True)
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write_new(public, pub + f" {name}\n".encode(), private=False)
    return NodeKey(private, public, fingerprint(key.public_key()))


def make_site_keys(folder: str | Path, sites: int) -> list[NodeKey]:
    """One key pair per site 0..sites-1 (``site0``, ``site0.pub``, ...); an existing one stops it first."""
    check_sites(sites)
    folder = Path(folder)
    _refuse_existing([folder / f"site{k}{ext}" for k in range(sites) for ext in ("", ".pub")])
    return [make_node_key(folder, f"site{k}") for k in range(sites)]
