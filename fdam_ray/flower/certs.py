"""A consortium's certificates and SuperNode keys: its own certificate authority, the SuperLink's TLS certificate
for the host names and addresses it is reached by, and one EC key pair per site for node authentication.

A consortium needs two kinds of credentials. TLS: the SuperLink presents a certificate for the names the sites
dial (``superlink.example.org``, its IP address), signed by a certificate authority that is the consortium's own,
whose certificate every SuperNode and ``flwr`` user is given (``--root-certificates``); nothing a public
authority signs is trusted. Node authentication: each site's SuperNode holds a private key (an EC key on a NIST
curve, in OpenSSH format, as ``flower-supernode --auth-supernode-private-key`` reads it) whose public key the
coordinator registers with ``flwr supernode register``; a SuperLink started with ``--enable-supernode-auth``
lets only registered keys in. A key's fingerprint (``SHA256:...``, the form ``ssh-keygen -lf`` prints) is what
the server binds a site number to (:mod:`.identity`).

Run as ``python -m fdam_ray.flower.certs --folder consortium-certs --name superlink.example.org --ip 10.0.0.5
--sites 3``. Private keys are written 0600, and nothing is overwritten: an existing file stops the command
before anything is written. The authority outlives the certificates it signs (``--ca-days`` 3650, ``--days``
365 by default); later, ``renew`` signs the SuperLink's certificate again with it, ``rotate-site`` gives one
site a new key pair and ``check`` warns of a certificate that expires within 30 days (:mod:`.renewal`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from fdam_ray.flower.pki import (  # noqa: F401 (the names this module has always given)
    DEFAULT_CA_DAYS,
    DEFAULT_DAYS,
    MAX_CA_DAYS,
    MAX_DAYS,
    MAX_NAME,
    MAX_SITES,
    WARN_DAYS,
    Certificates,
    NodeKey,
    _make_folder,
    _names,
    _refuse_existing,
    _server_cert,
    _write_new,
    check_address,
    check_days,
    check_host_name,
    check_sites,
    fingerprint,
    make_certificates,
    make_node_key,
    make_site_keys,
)

COMMANDS = ("renew", "rotate-site", "check")  # the later commands (:mod:`.renewal`)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fdam_ray.flower.certs", description=(
        "Make a consortium's certificate authority, the SuperLink's TLS certificate for the names the sites "
        "reach it by, and one SuperNode key pair per site. Nothing is overwritten; private keys are 0600."))
    p.add_argument("--folder", required=True, help="where the files go (created; must not hold them already)")
    p.add_argument("--name", action="append", default=[], metavar="DNS",
                   help="a DNS name of the SuperLink (repeat for more)")
    p.add_argument("--ip", action="append", default=[], metavar="ADDRESS",
                   help="an IP address of the SuperLink (repeat for more)")
    p.add_argument("--days", type=float, default=DEFAULT_DAYS,
                   help=f"the SuperLink certificate's validity in days (default {DEFAULT_DAYS})")
    p.add_argument("--ca-days", type=float, default=DEFAULT_CA_DAYS,
                   help=f"the authority's validity in days, at least --days (default {DEFAULT_CA_DAYS})")
    p.add_argument("--sites", type=int, default=0, help="how many site key pairs to make (site0 .. site<N-1>)")
    p.epilog = ("Later: `renew --folder F [--days N]` signs the SuperLink's certificate again with the folder's "
                "authority; `rotate-site --folder F --site K` makes site K a new key pair; `check FILE ...` warns "
                f"of a certificate that expires within {WARN_DAYS} days.")
    return p


def _undo(folder: Path, made: Sequence[Path], sites: int) -> None:
    """Remove what a failed run wrote (every file it writes, then the folders it made); nothing else is there,
    since an existing file stops it before anything is written."""
    keys = folder / "keys"
    names = ["ca.key", "ca.crt", "server.key", "server.pem"]
    for path in [*(folder / n for n in names), *(keys / f"site{k}{e}" for k in range(sites) for e in ("", ".pub"))]:
        try:
            path.unlink()
        except OSError:
            pass
    for level in [keys, *reversed(made)]:
        try:
            level.rmdir()
        except OSError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: writes the files and prints what goes where, with each site key's fingerprint."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        from fdam_ray.flower.renewal import command

        return command(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    folder = Path(args.folder)
    made: list[Path] = []
    try:
        check_sites(args.sites)  # before a path is formed: a huge count would take minutes and memory
        check_days(args.days, args.ca_days)
        _names(args.name, args.ip)
        _refuse_existing([folder / "keys" / f"site{k}{e}" for k in range(args.sites) for e in ("", ".pub")])
        made = _make_folder(folder)
        certs = make_certificates(folder, dns=args.name, ips=args.ip, days=args.days, ca_days=args.ca_days)
        keys = make_site_keys(folder / "keys", args.sites)
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # permission, a file where a folder goes, a full disk: what was written goes again
        _undo(folder, made, args.sites)
        print(f"error: {exc.filename or folder}: {exc.strerror or exc} (nothing was written)", file=sys.stderr)
        return 2
    print(f"certificate authority: {certs.ca} (valid {args.ca_days:g} days; give it to every SuperNode and flwr "
          f"user; keep {folder / 'ca.key'} offline: it signs the renewed server certificates)")
    print(f"SuperLink: --ssl-ca-certfile {certs.ca} --ssl-certfile {certs.server_cert} --ssl-keyfile "
          f"{certs.server_key} (valid {args.days:g} days for {', '.join([*args.name, *args.ip])}; renew: "
          f"python -m fdam_ray.flower.certs renew --folder {folder})")
    for k, key in enumerate(keys):
        print(f"site {k}: --auth-supernode-private-key {key.private}; register {key.public} "
              f"(fingerprint {key.fingerprint})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
