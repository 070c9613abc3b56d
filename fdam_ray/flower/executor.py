"""The server side on Flower: fdam-ray's executor interface over a Flower Grid.

:class:`~fdam_ray.loop.federation.Federation` runs the paper's outer loop here as it
does inline or on Ray (stages, rounds, the server step of
:mod:`fdam_ray.algorithms.server` with eta_g, the global c, CODA's alpha,
client sampling and weights of docs/algorithms.md s.3b, evaluation); this
executor only moves what the loop hands it. Each site is one client, hosted on
its own SuperNode; the updates of a round are folded in site order, one
partial sum per site as the inline executor folds them with
``clients_per_actor: 1``, so a Flower run equals an inline run.

A site whose reply does not come within ``round_timeout_s`` is left out of the
round: the others' updates make the round (their weights renormalised) and the
global c moves by their changes of c^k over the total weight of all K sites
(SCAFFOLD's rule for partial participation), so c stays the weighted mean of
every site's c^k. The site is told at its next message that its round was not
counted, and goes on from its state before it. The round is recorded (the loop's participation
record), so the run equals its replay from that record. A site whose node restarts is
found again by its site number; it keeps its state if it kept a file of it
(``state-dir``), else (or when that file is damaged) it starts as a replaced
client (its c^k set to the global c, a fresh sampler).

Which node is which site, and the nodes that can never take part (another
fdam-ray version, a site bound to another node's key, ...), is the roster's
(:mod:`.roster`). A site whose messages fail (its code raises) follows the
config's failure policy over its failures in a row: ``on_client_failure``
retry or abort stops the run past ``max_client_retries``, drop drops it once
(it stays in c by the partial-participation rule, and comes back when its node
restarts).
"""

from __future__ import annotations

from fdam_ray.flower import needs_flower  # noqa: F401 (first: without Flower, says what to install)

# isort: split
import hashlib
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.executors.base import Executor, ExecutorSetup
from fdam_ray.flower import records
from fdam_ray.flower.identity import NodeIdentity, SiteBindings
from fdam_ray.flower.roster import SiteRefused, SiteRoster, SiteShapes, SiteSilent, _first_line

__all__ = ["FlowerExecutor", "SiteRefused", "SiteShapes", "SiteSilent"]
from fdam_ray.core.state import (
    ClientInfo,
    ClientState,
    ClientUpdate,
    GlobalState,
    RoundPlan,
    ScoreHistogram,
    Scores,
    ScoreSums,
)
from fdam_ray.executors.flower_section import FlowerSection
from fdam_ray.scores.histogram import Binning

if TYPE_CHECKING:
    from fdam_ray.data import DataSource

log = logging.getLogger(__name__)


class FlowerExecutor(SiteRoster, Executor):
    """The K clients of a federation as K Flower sites reached through ``grid``.

    Args:
        grid: the ServerApp's grid.
        flower: the config's Flower section.
        run_key: names this run at the sites (their kept state belongs to it).
        num_sites: K; the sites are numbered 0..K-1 by their node config.
        bindings_dir: where the binding of sites to their nodes' public keys is kept (``site-bindings.json``), so
            it outlives this server process; None: it lasts this run.
    """

    # each site builds its client from the run config; the driver puts the privacy settings it resolves (sigma)
    # into that config (fdam_ray/privacy/driver.py), so every dp mode runs here
    clients_from_setup = False
    leaves_clients_out = True  # a site past round_timeout_s: its rounds are recorded, the run replayable from them

    def __init__(self, grid: Grid, flower: FlowerSection, *, run_key: str, num_sites: int,
                 bindings_dir: str | Path | None = None) -> None:
        self.grid = grid
        self.flower = flower
        self.run_key = run_key
        self.num_sites = num_sites
        self.node_of: dict[int, int] = {}  # site -> node id
        self.site_of: dict[int, int] = {}  # node id -> site
        self.synced: dict[int, int] = {}  # site -> setup version it has applied
        self.counted: dict[int, int] = {k: -1 for k in range(num_sites)}  # site -> last round of it folded
        self.version = 0
        self.config_json = ""
        self.positive_ratio: np.ndarray | None = None
        self.stage = 0
        self.reference: np.ndarray | None = None
        self.reset = True
        self.weights: np.ndarray | None = None  # w_k by site (None: uniform)
        self.shapes: SiteShapes | None = None
        self.secure: Callable[..., PartialSum | None] | None = None  # set by secagg.enable
        self.secure_histogram: Callable[..., ScoreHistogram | None] | None = None  # set by secagg.enable
        self.replaced: set[int] = set()  # sites that lost their state mid-run (they start from the global c)
        self.rebuilding: set[int] = set()  # replaced sites whose first update has not been folded yet
        self.rebuilt: dict[int, list[int]] = {}  # round -> sites folded as rebuilt clients' first (take_rebuilt)
        self.with_tests: list[int] = []  # sites holding a test split of their own
        self.unusable: dict[int, str] = {}  # node id -> why it cannot take part (said once, not asked again)
        self.silent: dict[int, str] = {}  # node id -> how it failed to answer (listed, its SuperNode gone)
        self.failures: dict[int, int] = {}  # site -> messages it failed in a row
        self.last_error: dict[int, str] = {}  # site -> its last failure, in one line
        self.dropped: set[int] = set()  # sites dropped under on_client_failure=drop (until their node restarts)
        self.on_failure, self.max_retries = "retry", 2  # the config's on_client_failure, max_client_retries
        self.private = False  # dp: client: the updates are the sites' clipped (noised) changes, c^k is not sent
        self.bindings = SiteBindings(bindings_dir, flower.site_keys) if flower.bind_sites else None
        self.identity: dict[int, NodeIdentity] = {}  # node id -> its key's fingerprint, when it was last activated

    def keep_bindings_in(self, folder: str | Path) -> None:
        """Keep the sites' binding to their nodes' keys in ``folder`` (``site-bindings.json``) from now on, so that
        it outlives this server process (a server that restarts in the same folder finds it)."""
        if self.bindings is not None:
            self.bindings.keep_in(folder)

    # -- one wave of messages ----------------------------------------------------------------
    def header(self, site: int, **more: object) -> dict[str, object]:
        return {"run_key": self.run_key, "version": self.version, "counted": self.counted[site], **more}

    def ask(self, message_type: str, contents: dict[int, RecordDict]) -> dict[int, RecordDict]:
        """Send one message per site and return the replies by site (a site that failed or timed out is absent)."""
        messages = [Message(c, dst_node_id=self.node_of[k], message_type=message_type)
                    for k, c in contents.items() if k in self.node_of and k not in self.dropped]
        out: dict[int, RecordDict] = {}
        for reply in self.grid.send_and_receive(messages, timeout=self.flower.round_timeout_s):
            site = self.site_of.get(reply.metadata.src_node_id)
            if site is None:
                continue
            if reply.has_error():
                self._failed(site, message_type, reply.error.reason)
                continue
            self.failures.pop(site, None)
            out[site] = reply.content
        return out

    def _failed(self, site: int, action: str, reason: str | None) -> None:
        """A site answered with an error: the failure policy (``on_client_failure``, ``max_client_retries``) over
        its failures in a row. A site that keeps failing stops the run, or (``drop``) is dropped once: asked no
        more, left out of every further round under the partial-participation rule, until its node restarts."""
        n = self.failures[site] = self.failures.get(site, 0) + 1
        self.last_error[site] = line = (f"site {site} (node {self.node_of.get(site, '?')}): {action} failed: "
                                        f"{_first_line(reason)}")
        policy, retries = self.on_failure, self.max_retries
        if policy != "abort" and n <= retries:
            log.warning("%s (%d of %d failures in a row before on_client_failure=%s acts)", line, n, retries + 1,
                        policy)
            return
        if policy == "drop":
            self.dropped.add(site)
            log.warning("%s; after %d failure%s in a row it is dropped (on_client_failure=drop): it takes part in no "
                        "further round (its c^k stays in c, the partial-participation rule); restart its SuperNode to "
                        "bring it back", line, n, "s" if n > 1 else "")
            return
        self._refuse(f"{line}; after {n} failure{'s' if n > 1 else ''} in a row (on_client_failure={policy}, "
                     f"max_client_retries={retries}) the run stops: fix the site (its log says more) and start the "
                     "run again, or set on_client_failure: drop to go on without it",
                     tell=[self.node_of[site]] if site in self.node_of else [])

    def ensure_synced(self, sites: Iterable[int]) -> list[int]:
        """Bring the given sites up to the current setup (config, p, stage); the sites that are in step."""
        self.refresh()
        sites = [k for k in sites if k not in self.dropped]
        stale = [k for k in sites if k in self.node_of and self.synced.get(k, 0) != self.version]
        if stale:
            replies = self.ask("query.sync", {k: self._sync_content(k) for k in stale})
            for k in replies:
                self.synced[k] = self.version
                self.replaced.discard(k)
        return [k for k in sites if k in self.node_of and self.synced.get(k) == self.version]

    def _sync_content(self, site: int) -> RecordDict:
        cfg = self.header(site, config=self.config_json, stage=self.stage, reset=self.reset,
                          replaced=site in self.replaced)
        arrays = {"positive_ratio": self.positive_ratio, "reference": self.reference}
        return RecordDict({records.CONFIG: records.config(cfg), records.ARRAYS: records.arrays(arrays)})

    def train_sizes(self, config_json: str) -> list[int]:
        """Each site's number of training samples under the run config ``config_json`` (before the start: dp:
        sample solves sigma for them); every site must answer."""
        self.refresh()
        replies = self.ask("query.sizes", {k: RecordDict({records.CONFIG: records.config({"config": config_json})})
                                           for k in range(self.num_sites)})
        missing = [k for k in range(self.num_sites) if k not in replies]
        if missing:
            why = "; ".join(self.last_error.get(k, f"site {k} did not answer") for k in missing)
            raise RuntimeError(f"sites {missing} did not say their number of training samples ({why})")
        return [records.integer(replies[k].config_records[records.CONFIG], "num_train")
                for k in range(self.num_sites)]

    def _start_sites(self) -> dict[int, RecordDict]:
        """Give every site the run's setup now (a federation starts with all its sites)."""
        self.version += 1
        self.refresh()
        replies = self.ask("query.sync", {k: self._sync_content(k) for k in range(self.num_sites)
                                          if k in self.node_of})
        for k in replies:
            self.synced[k] = self.version
            self.replaced.discard(k)
        missing = [k for k in range(self.num_sites) if k not in replies]
        if missing:
            why = "; ".join(self.last_error.get(k, f"site {k} did not answer") for k in missing)
            raise RuntimeError(f"sites {missing} did not start ({why}); a federation starts with all its sites")
        return replies

    def _setup_changed(self) -> None:
        """p or the stage changed: each site receives the new setup before its next message (one wave fewer per
        change; a site that is away then catches up when it returns)."""
        self.version += 1

    # -- the executor interface ------------------------------------------------------------------
    def start(self, setup: ExecutorSetup, source: DataSource) -> list[ClientInfo]:
        self.config_json = records.to_json(dict(setup.run_config))  # each site builds its client from it
        self.private = setup.face.sends_changes
        self.drift = setup.algorithm.drift
        policy = setup.executor
        self.on_failure, self.max_retries = policy.on_client_failure, policy.max_client_retries
        self.run_key = f"{self.run_key}-{hashlib.sha256(self.config_json.encode()).hexdigest()[:12]}"
        self.stage, self.reference, self.positive_ratio = 0, None, None
        replies = self._start_sites()
        infos = [records.info_of(replies[k]) for k in range(self.num_sites)]
        self.with_tests = [i.client_id for i in infos if i.num_test > 0]
        for k, info in enumerate(infos):
            if info.client_id != k:
                raise RuntimeError(f"the node of site {k} answered as client {info.client_id}")
        self.weights = setup.algorithm.weights([i.num_train for i in infos])
        return infos

    def configure(self, positive_ratio: np.ndarray) -> None:
        self.positive_ratio = np.asarray(positive_ratio)
        self._setup_changed()

    def begin_stage(self, reference: np.ndarray, reset_control_variates: bool) -> None:
        self.stage += 1
        self.reference, self.reset = np.asarray(reference, dtype=np.float32), reset_control_variates
        self._setup_changed()

    def run_round(self, state: GlobalState, plan: RoundPlan, fold: Callable[[PartialSum], None],
                  clients: Sequence[int] | None = None) -> None:
        wanted = list(range(self.num_sites)) if clients is None else sorted(clients)
        if not wanted:  # an empty Poisson draw (dp: client): no site is asked, the reducer applies the noise alone
            return
        ready = self.ensure_synced(wanted)
        if self.secure is not None:
            total = self.secure(self, state, plan, ready, sampled=clients is not None)
            if total is None:
                raise RuntimeError(f"round {plan.round}: no site's update reached the server")
            came = [k for k in ready if self.counted[k] == plan.round]
            self._note_left_out(plan.round, wanted, came)
            self._note_rebuilt(plan.round, came)
            fold(total)
            return
        contents = {k: records.global_state_content(state, {**self.header(k), **records.plan_config(plan)})
                    for k in ready}
        replies = self.ask("train.round", contents)
        came = sorted(replies)
        if not came:
            raise RuntimeError(f"round {plan.round}: no site's update reached the server (sites {wanted} were "
                               "asked)")
        updates = {k: self._update_of(k, replies[k]) for k in came}
        left_out = self._note_left_out(plan.round, wanted, came)
        if left_out and clients is None and not self.private:  # dp: client: the server's c is post-processing
            self._partial_control(state, plan, updates)
        for k in came:
            part = PartialSum.zeros(state, control_variates=state.c_v is not None)
            part.fold(updates[k], None if self.weights is None else float(self.weights[k]))
            fold(part)
            self.counted[k] = plan.round
        self._note_rebuilt(plan.round, came)

    def _note_rebuilt(self, round_: int, came: list[int]) -> None:
        """Sites folded in ``round_`` whose state was lost before it: their first round as rebuilt clients."""
        first = [k for k in came if k in self.rebuilding]
        if first:
            self.rebuilt[round_] = sorted(first)
            self.rebuilding.difference_update(first)

    def take_rebuilt(self) -> dict[int, list[int]]:
        got, self.rebuilt = self.rebuilt, {}
        return got

    def _update_of(self, site: int, content: RecordDict) -> ClientUpdate:
        stats = records.stats_of(content.config_records[records.CONFIG])
        stats.client_id = site
        return ClientUpdate.from_vectors(records.state_vectors(content.array_records[records.STATE]),
                                         client_id=site, stats=stats)

    def _note_left_out(self, round_: int, wanted: list[int], came: list[int]) -> list[int]:
        left_out = [k for k in wanted if k not in came]
        if [k for k in left_out if k not in self.dropped]:  # a dropped site was said once, when it was dropped
            log.warning("round %d: sites %s sent no update (left, failed or past flower.round_timeout_s=%g s); the "
                        "round completes with sites %s under the partial-participation rule", round_, left_out,
                        self.flower.round_timeout_s, came)
        return left_out

    def _partial_control(self, state: GlobalState, plan: RoundPlan, updates: dict[int, ClientUpdate]) -> None:
        """A full round that some sites dropped out of: c <- c + sum_S w_k (c^k_new - c^k_old) / sum_all w, the
        drift correction's rule (:meth:`~fdam_ray.algorithms.drift.ControlVariates.moved_c`).

        The reducer of a full round divides the control sums by the weight of the sites that came, so each
        update's control variate is replaced by the value whose weighted mean is that c."""
        if state.c_v is None or state.c_alpha is None:
            return
        changes = self.ask("query.change", {k: RecordDict({records.CONFIG: records.config({"round": plan.round})})
                                             for k in updates})
        missing = [k for k in updates if k not in changes]
        if missing:
            raise RuntimeError(f"round {plan.round}: sites {missing} did not send the change of their control "
                               "variate")
        w = {k: 1.0 if self.weights is None else float(self.weights[k]) for k in updates}
        sent = {k: records.state_vectors(changes[k].array_records[records.STATE]) for k in sorted(updates)}
        for name in self.drift.names:
            weighted: list[tuple[float, np.ndarray]] = []
            for k, vectors in sent.items():
                change = vectors[name]
                if change is None:
                    raise RuntimeError(f"round {plan.round}: site {k} sent no change of {name}")
                weighted.append((w[k], change))
            moved = self.drift.moved_c(getattr(state, name), weighted,
                                       self.drift.total_weight(self.num_sites, self.weights))
            for k in updates:
                setattr(updates[k], name, moved.astype(np.float32))

    def evaluate(self, state: GlobalState, split: str = "test",
                 bins: Binning | None = None) -> list[Scores] | list[ScoreHistogram]:
        """Each site's scores of ``state`` on its own test split (or, ``split="val"``, its validation part); with
        ``bins`` its score histogram and own AUC per task instead. Under SecAgg+ with ``bins``: ONE histogram,
        the exact sum of every site's through the secure sum (client_id -1, no site's AUC; a site without such a
        part adds zeros), :func:`~fdam_ray.flower.secagg.run_secure_histogram`; no site's own reaches here."""
        asked = list(range(self.num_sites)) if split == "train" else self.with_tests  # train: a pAUC count pass
        if bins is not None and self.secure_histogram is not None:
            if not asked:  # as in the clear: no site holds such a part, none is asked
                return []
            summed = self.secure_histogram(self, state, split, bins, self.ensure_synced(range(self.num_sites)))
            return [] if summed is None else [summed]
        ready = self.ensure_synced(asked)  # a site without a test split of its own is not asked
        more = {"split": split} if bins is None else {"split": split, **records.binning_header(bins)}
        replies = self.ask("evaluate", {k: records.global_state_content(state, self.header(k, **more))
                                        for k in ready})
        if bins is not None:
            return [h for h in (records.histogram_of(replies[k]) for k in sorted(replies)) if h is not None]
        return [s for s in (records.scores_of(replies[k]) for k in sorted(replies)) if s is not None]

    def score_sums(self, state: GlobalState) -> list[ScoreSums]:
        ready = self.ensure_synced(range(self.num_sites))
        replies = self.ask("query.score_sums", {k: records.global_state_content(state, self.header(k))
                                             for k in ready})
        return [records.score_sums_of(replies[k]) for k in sorted(replies)]

    def client_states(self) -> list[ClientState | None]:
        """The sites keep their own states (c^k, sampler position): a checkpoint here holds none of them."""
        return [None] * self.num_sites

    def restore_client_states(self, states: list[ClientState | None]) -> None:
        raise ValueError("a Flower run is not resumed from a checkpoint: the sites keep their own states")

    @property
    def active_clients(self) -> int:
        return len(self.node_of)
