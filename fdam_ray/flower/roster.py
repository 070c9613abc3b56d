"""Which node is which site: the server side's roster of the Flower nodes of a run.

Each node says which site it is at its first message (``query.hello``); the
roster asks every node it has not seen, forgets nodes that left, and finds a
restarted SuperNode again by its site number. A node that can never take part
is not left out round after round: a node whose ``require-secagg`` the run does
not meet, two nodes claiming one site number, a node that cannot say which site
it is (or names none of this run's) while a site is missing, a site's data of
another shape, each stops the run with one line (:class:`SiteRefused`) naming
the site, the node and what to do, and the nodes concerned log it too. So does,
while a site is missing, a node that runs another fdam-ray version (both
versions named) or one that claims a site bound to another node's public key
(:mod:`fdam_ray.flower.identity`: the first node to take a site binds it to its
key; only ``flower.site_keys`` changes that); with every site there, such a
node is refused in one log line (on the server and on the node) and asked
nothing more. A site whose SuperNode is down, or cannot reach the SuperLink,
is not a misconfigured one: when it has not answered within
``flower.connect_timeout_s``, the run stops with one line (:class:`SiteSilent`)
naming it and saying it did not answer.
"""

from __future__ import annotations

from fdam_ray.flower import needs_flower  # noqa: F401 (first: without Flower, says what to install)

# isort: split
import logging
import time
from collections.abc import Sequence
from typing import NoReturn

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

import fdam_ray
from fdam_ray.executors.flower_section import FlowerSection
from fdam_ray.flower import records
from fdam_ray.flower.identity import NodeIdentity, SiteBindings, node_identities

log = logging.getLogger("fdam_ray.flower.executor")  # one logger for the server side's lines


class SiteRefused(RuntimeError):
    """A site or node that can never take part in this run: one line naming it and what to do; the run stops."""


class SiteSilent(SiteRefused):
    """A site that did not answer before the start (its SuperNode down or cut off): one line naming it."""


_UNAVAILABLE = (3, 4, 5)  # Flower's ErrorCode MESSAGE_, REPLY_MESSAGE_ and NODE_UNAVAILABLE: nobody answered


def _first_line(text: object) -> str:
    lines = [line for line in str(text).splitlines() if line.strip()]
    return (lines[0] if lines else "no reason given")[:300]


class SiteShapes:
    """What the sites said of their data when they connected (the driver's replica needs it)."""

    def __init__(self, input_shape: tuple[int, ...], num_tasks: int, task_names: tuple[str, ...]) -> None:
        self.input_shape, self.num_tasks, self.task_names = input_shape, num_tasks, task_names


class SiteRoster:
    """The sites' nodes of :class:`~fdam_ray.flower.executor.FlowerExecutor` (which sets these attributes)."""

    grid: Grid
    flower: FlowerSection
    run_key: str
    num_sites: int
    node_of: dict[int, int]  # site -> node id
    site_of: dict[int, int]  # node id -> site
    synced: dict[int, int]  # site -> setup version it has applied
    config_json: str
    shapes: SiteShapes | None
    replaced: set[int]
    rebuilding: set[int]  # sites replaced whose first update as a rebuilt client has not been folded yet
    unusable: dict[int, str]  # node id -> why it cannot take part (said once, not asked again)
    silent: dict[int, str]  # node id -> how it failed to answer (listed, but its SuperNode is gone)
    failures: dict[int, int]
    dropped: set[int]
    bindings: SiteBindings | None
    identity: dict[int, NodeIdentity]  # node id -> its key's fingerprint, when it was last activated

    def connect(self) -> SiteShapes:
        """Wait until every site 0..K-1 has connected; what their data look like.

        A node that cannot take part (it could not say which site it is, or names none of this run's) while a
        site is missing stops the run at once, naming it: it is most likely that site, misconfigured."""
        deadline = time.monotonic() + self.flower.connect_timeout_s
        while True:
            self.refresh()
            missing = [k for k in range(self.num_sites) if k not in self.node_of]
            if not missing:
                assert self.shapes is not None
                return self.shapes
            if self.unusable:
                nodes = "; ".join(why if f"node {n} " in why else f"node {n} {why}"
                                  for n, why in sorted(self.unusable.items()))
                self._refuse(f"sites {missing} have not connected and {nodes}: fix that node's config (site = "
                             f"0..{self.num_sites - 1}, its data) and restart its SuperNode; the run stops")
            if time.monotonic() > deadline:
                self._refuse(self._silent_line(missing), silent=True)
            time.sleep(0.5)

    def _silent_line(self, missing: list[int]) -> str:
        """The one line of sites that never answered before the start: who, for how long, and what to do."""
        who = f"site {missing[0]}" if len(missing) == 1 else f"sites {', '.join(map(str, missing))}"
        quiet = "; ".join(f"node {n} was listed but did not answer: {why}" for n, why in sorted(self.silent.items()))
        return (f"{who} did not answer within flower.connect_timeout_s={self.flower.connect_timeout_s:g} s "
                f"({len(self.node_of)} of {self.num_sites} sites did{'; ' + quiet if quiet else ''}): start "
                f"{'its SuperNode' if len(missing) == 1 else 'their SuperNodes'}, check that "
                f"{'it reaches' if len(missing) == 1 else 'they reach'} the SuperLink, and submit the study again; "
                "the run stops")

    def refresh(self) -> None:
        """Ask nodes not seen before which site they are; forget nodes that left. A site two listed nodes claim,
        or one that requires what this run does not do, stops the run (:class:`SiteRefused`)."""
        nodes = set(self.grid.get_node_ids())
        self._note_restarts()
        for node in [n for n in self.site_of if n not in nodes]:
            site = self.site_of.pop(node)
            if self.node_of.get(site) == node:
                del self.node_of[site]
                log.warning("site %d (node %d) left", site, node)
        new = sorted(n for n in nodes if n not in self.site_of and n not in self.unusable)
        if not new:
            return
        said = self._hello(new)
        claims: dict[int, list[int]] = {}
        for node, record in said.items():
            site = records.integer(record, "site")
            theirs = str(record.get("fdam_ray_version", "") or "an fdam-ray that does not say its version")
            refused = self.bindings.refusal(site, node, self._key(node)) if self.bindings is not None else None
            if theirs != fdam_ray.__version__:
                self._unusable(node, f"(site {site}) runs fdam-ray {theirs} and the server fdam-ray "
                                     f"{fdam_ray.__version__}: install fdam-ray {fdam_ray.__version__} on that site")
            elif not 0 <= site < self.num_sites:
                self._unusable(node, f"says it is site {site} (this run has sites 0..{self.num_sites - 1})")
            elif refused is not None:
                self._unusable(node, refused, tell=True)
            else:
                claims.setdefault(site, []).append(node)
        # a site already held by a node that is still listed: that node is asked again (a restarted SuperNode's
        # old node does not answer; a second SuperNode with the same site number does)
        holders = {self.node_of[k]: k for k in claims if self.node_of.get(k) in nodes}
        again = self._hello(sorted(holders), quiet=True) if holders else {}
        for node, record in again.items():
            if records.integer(record, "site") == holders[node]:
                claims[holders[node]].append(node)
        for site, claimants in sorted(claims.items()):
            if len(claimants) > 1:
                self._duplicate(site, sorted(claimants))
        for node in sorted(n for n in said if n not in self.unusable):
            self._adopt(node, said[node])

    def _note_restarts(self) -> None:
        """The public keys the grid reports; a known node that came online again since (a SuperNode restarted
        with the same key keeps its node id) is forgotten, so that it is asked again which site it is."""
        if self.bindings is None:
            return
        now = node_identities(self.grid)
        for node, ident in now.items():
            before = self.identity.get(node)
            if before is None or before.activated == ident.activated:
                continue
            self.unusable.pop(node, None)  # a SuperNode fixed and restarted: it is asked again
            if node in self.site_of:
                site = self.site_of.pop(node)
                if self.node_of.get(site) == node:
                    del self.node_of[site]
                log.warning("site %d (node %d) came online again: it is asked which site it is", site, node)
        self.identity.update(now)

    def _key(self, node: int) -> str:
        ident = self.identity.get(node)
        return "" if ident is None else ident.key

    def _hello(self, nodes: list[int], *, quiet: bool = False) -> dict[int, ConfigRecord]:
        """What each node says of itself (a node that failed to say is unusable, logged once)."""
        cfg = records.config({"run_key": self.run_key, "secagg": self.flower.secagg,
                              "fdam_ray_version": fdam_ray.__version__})
        messages = [Message(RecordDict({records.CONFIG: cfg}), dst_node_id=n, message_type="query.hello")
                    for n in nodes]
        out: dict[int, ConfigRecord] = {}
        for reply in self.grid.send_and_receive(messages, timeout=self.flower.round_timeout_s):
            node = reply.metadata.src_node_id
            if reply.has_error() and reply.error.code in _UNAVAILABLE:  # nobody there: not the node's config
                self.silent[node] = _first_line(reply.error.reason)
                continue
            if reply.has_error():
                if not quiet:
                    self._unusable(node, f"could not say which site it is ({_first_line(reply.error.reason)})")
                continue
            out[node] = reply.content.config_records[records.CONFIG]
            self.silent.pop(node, None)
        for node in nodes:  # listed, and no reply within the wait: its SuperNode is gone or cut off
            if node not in out and node not in self.unusable and not quiet:
                self.silent.setdefault(node, "no reply within flower.round_timeout_s="
                                             f"{self.flower.round_timeout_s:g} s")
        return out

    def _unusable(self, node: int, why: str, *, tell: bool = False) -> None:
        """A node that cannot take part: said once, and not asked again (a fixed SuperNode comes back as a new
        node). ``tell``: ``why`` is a whole line (it names the node), logged as it is and sent to the node."""
        self.unusable[node] = why
        if tell:
            log.error("%s", why)
            self._tell([node], why)
            return
        log.warning("node %d %s: it takes part in no round of this run; fix its config and restart its SuperNode",
                    node, why)

    def _duplicate(self, site: int, nodes: list[int]) -> None:
        names = ", ".join(map(str, nodes[:-1])) + f" and {nodes[-1]}"
        who = f"nodes {names} {'both' if len(nodes) == 2 else 'all'} say they are site {site}"
        reason = (f"{who}: give each SuperNode its own site number (node config site = 0..{self.num_sites - 1}), "
                  "stop the extra one, and start the run again")
        self._refuse(f"the run stops: {reason}", tell=nodes)

    def _refuse(self, line: str, tell: Sequence[int] = (), *, silent: bool = False) -> NoReturn:
        """Stop the run with one line (logged here, and on the nodes in ``tell``: each site's log names it)."""
        log.error("%s", line)
        self._tell(tell, line)
        raise (SiteSilent if silent else SiteRefused)(line)

    def _tell(self, nodes: Sequence[int], line: str) -> None:
        """Send ``line`` to ``nodes`` (``query.refused``: each logs it), whether or not they hear it."""
        if not nodes:
            return
        try:
            self.grid.send_and_receive([Message(RecordDict({records.CONFIG: records.config({"reason": line})}),
                                                dst_node_id=n, message_type="query.refused") for n in nodes],
                                       timeout=self.flower.round_timeout_s)
        except Exception as exc:  # the line stands whether or not the nodes heard it
            log.debug("telling nodes %s failed: %s", list(nodes), exc)

    def _adopt(self, node: int, said: ConfigRecord) -> None:
        site = records.integer(said, "site")
        if bool(said.get("require_secagg", False)) and not self.flower.secagg:
            self._refuse(f"site {site} (node {node}) takes part only in rounds under secure aggregation (its node "
                         "config has require-secagg = true) and this run has flower.secagg: false, so it can take "
                         "part in none: set flower.secagg: true in the config's flower section, or require-secagg "
                         "= false on that node; the run stops")
        shapes = SiteShapes(tuple(int(d) for d in records.raw(said, "input_shape")), records.integer(said, "num_tasks"),
                            tuple(str(t) for t in records.raw(said, "task_names")))
        if self.shapes is None:
            self.shapes = shapes
        elif (shapes.input_shape, shapes.num_tasks) != (self.shapes.input_shape, self.shapes.num_tasks):
            self._refuse(f"site {site} (node {node})'s samples have shape {shapes.input_shape} and "
                         f"{shapes.num_tasks} tasks, the other sites' {self.shapes.input_shape} and "
                         f"{self.shapes.num_tasks}: give that node the study's data; the run stops", tell=[node])
        old = self.node_of.get(site)
        if old is not None and old != node:
            self.site_of.pop(old, None)
            log.warning("site %d is now node %d (was node %d)", site, node, old)
        if site in self.dropped and old != node:  # a restarted SuperNode: the site may take part again
            self.dropped.discard(site)
            self.failures.pop(site, None)
        self.node_of[site], self.site_of[node] = node, site
        if self.bindings is not None:
            self.bindings.bind(site, node, self._key(node))
        self.synced[site] = records.integer(said, "version")
        lost = str(said.get("lost_state", "") or "")
        if self.config_json and self.synced[site] == 0:
            self.replaced.add(site)
            self.rebuilding.add(site)
            log.warning("site %d (node %d) kept no state of this run%s: it rejoins as a replaced client (c^k = the "
                        "global c, a fresh sampler)", site, node, f" ({lost})" if lost else "")
        elif lost:
            log.warning("site %d (node %d): %s; it starts this run afresh", site, node, lost)
