"""Which node may be which site: each site number bound to the public key of the node that first took it.

A node says which site it is (its node config's ``site``); that alone would let any node that reaches the
SuperLink take a hospital's place. The SuperLink knows each node's public key (a node signs every request with
its private key; with ``--enable-supernode-auth`` only keys the coordinator registered get in), and the ServerApp
sees it (``Grid.get_nodes``). So the first node to take site k binds k to its key's fingerprint; a node with
another key that later claims k is refused, and the server's log names the site, the bound node and the claiming
node in one line. The binding changes only when the operator says so (``flower.site_keys``: site ->
fingerprint; given for every site, it binds them all from the first message on). Kept in
``site-bindings.json`` in a folder the server gives, the binding outlives the server process; without one it
lasts the run.

A grid that reports no public keys (the in-process grid) binds nothing: there is no identity to bind to.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BINDINGS_FILE = "site-bindings.json"
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class NodeIdentity:
    """What the SuperLink says of a node: its key's fingerprint ('' if none) and when it last came online."""

    key: str
    activated: str = ""


def node_identities(grid: Any) -> dict[int, NodeIdentity]:
    """Node id -> identity, for the nodes whose public key the grid reports (none: an empty mapping)."""
    from fdam_ray.flower.certs import fingerprint

    try:
        nodes = list(grid.get_nodes())
    except NotImplementedError:
        return {}
    out: dict[int, NodeIdentity] = {}
    for node in nodes:
        key = getattr(node, "public_key", b"")
        if not key:
            continue
        try:
            out[int(node.node_id)] = NodeIdentity(fingerprint(bytes(key)), str(getattr(node, "last_activated_at", "")))
        except ValueError as exc:  # a key the SuperLink accepted but that is not one: no identity
            log.warning("node %s: its public key cannot be read (%s); it cannot be bound to a site", node.node_id, exc)
    return out


def node_name(node: int, key: str) -> str:
    return f"node {node} ({key})" if key else f"node {node}"


class SiteBindings:
    """Site -> the fingerprint (and last node id) bound to it; a JSON file in ``folder`` when one is given.

    Args:
        folder: where ``site-bindings.json`` is kept (None: in memory, for this run).
        pinned: the operator's word (``flower.site_keys``): site -> the fingerprint of the key that is that site,
            applied now and kept (it replaces what was bound).
    """

    def __init__(self, folder: str | Path | None = None, pinned: Mapping[int, str] | None = None) -> None:
        self.pinned = dict(pinned or {})
        self.path: Path | None = None
        self.sites: dict[int, dict[str, Any]] = {}
        self.keep_in(folder)

    def keep_in(self, folder: str | Path | None) -> None:
        """Keep the binding in ``folder`` from now on: what its file holds (if any) is the binding, with
        ``pinned`` applied; what was bound in memory before is kept where the file says nothing of a site."""
        if folder is not None:
            self.path = Path(folder) / BINDINGS_FILE
            self.sites = {**self.sites, **self._load()}
        changed = False
        for site, key in sorted(self.pinned.items()):
            old = self.sites.get(site)
            if old is not None and old["key"] == key:
                continue
            self.sites[site] = {"key": key, "node": None, "bound_at": _now(), "by": "flower.site_keys"}
            if old is None:
                log.info("site %d is bound to the node with key %s (flower.site_keys)", site, key)
            else:
                log.warning("site %d is bound to the node with key %s by flower.site_keys (it was %s)", site, key,
                            _holder(old))
            changed = True
        if changed or (self.path is not None and self.sites and not self.path.exists()):
            self.save()

    def _load(self) -> dict[int, dict[str, Any]]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            return {int(k): {"key": str(v["key"]), "node": v.get("node"), "bound_at": v.get("bound_at", ""),
                             "by": v.get("by", "")} for k, v in data["sites"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RuntimeError(f"{self.path} cannot be read ({exc}): it binds the sites to their nodes' keys; restore "
                               "it, or remove it to bind each site anew to the first node that claims it") from None

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "sites": {str(k): v for k, v in sorted(self.sites.items())}},
                                  indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)

    def refusal(self, site: int, node: int, key: str) -> str | None:
        """Why ``node`` (key ``key``) may not be site ``site``, in one line; None: it may (it holds the bound
        key, or the site is not bound yet, or the node has no key to check)."""
        bound = self.sites.get(site)
        if bound is None or not key or bound["key"] == key:
            return None
        return (f"site {site} is bound to {_holder(bound)}; {node_name(node, key)} claims it and is refused: if "
                f"that site's node was replaced on purpose, set flower.site_keys: {{'{site}': '{key}'}} in the study's "
                "config")

    def bind(self, site: int, node: int, key: str) -> None:
        """``node`` (key ``key``) is site ``site`` now: bound if the site was not; the node id noted."""
        if not key:
            return
        bound = self.sites.get(site)
        if bound is not None and bound["key"] == key and bound["node"] == node:
            return
        if bound is None:
            log.info("site %d is bound to %s", site, node_name(node, key))
            self.sites[site] = {"key": key, "node": node, "bound_at": _now(), "by": "first claim"}
        else:
            bound["node"] = node
        self.save()

    def bound(self) -> Iterable[tuple[int, str]]:
        return [(k, v["key"]) for k, v in sorted(self.sites.items())]


def _holder(bound: Mapping[str, Any]) -> str:
    return f"key {bound['key']}" if bound["node"] is None else node_name(int(bound["node"]), str(bound["key"]))


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
