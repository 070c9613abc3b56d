"""The site's Flower ClientApp: each message runs one phase of the site's fdam-ray client.

Message types (the server side is :class:`~fdam_ray.flower.executor.FlowerExecutor`):

- ``query.hello``: which site this node is, its fdam-ray version and what it keeps for the run;
- ``query.sync``: the run's config, the global p, the stage's centre (and the stage's c^k reset); replies
  with the client's counts (:class:`~fdam_ray.core.state.ClientInfo`);
- ``train.round``: one round of local steps from the global state, the update in the clear;
- ``train``: the same round under SecAgg+ (``secaggplus_mod`` masks what the site sends, see :mod:`.secagg`);
  with a ``binning`` value, an evaluation's score histogram under SecAgg+ (only its sum reaches the server);
- ``query.change``: the change of c^k in the site's last round (a round another site dropped out of);
- ``evaluate``: scores of the global model on the site's own test split (with a ``bins`` value,
  ``test_scores: histogram``: its score histogram and own AUC per task instead, no per-sample value);
- ``query.score_sums``: score sums for CODA's closed-form alpha;
- ``query.sizes``: the site's number of training samples under a config (dp: sample solves sigma for them
  before the start);
- ``query.refused``: the server refuses this node or stops the run because of it (one line: why, and what to do).

The site's data come from its node config (:func:`~fdam_ray.flower.site.site_source`); ``state-dir`` names
where it keeps its state file, ``share-test-scores = false`` keeps its test scores and labels at home and
``require-secagg = true`` refuses rounds whose update would reach the server in the clear.
"""

from __future__ import annotations

from fdam_ray.flower import needs_flower  # noqa: F401 (first: without Flower, says what to install)

# isort: split
import dataclasses
import json
import logging
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp

import fdam_ray
from fdam_ray.config import build_config
from fdam_ray.core.state import ClientUpdate, GlobalState, RoundPlan, ScoreHistogram
from fdam_ray.flower import records
from fdam_ray.flower.secagg import secure_round
from fdam_ray.flower.site import (
    KeptState,
    SiteStore,
    build_client,
    site_drift,
    site_source,
    study_source,
    zero_control_variate,
)
from fdam_ray.privacy.driver import train_size
from fdam_ray.scores.histogram import Binning

log = logging.getLogger(__name__)

app = ClientApp()


@dataclasses.dataclass
class SiteCall:
    """One message's view of the site: its number, data, store and kept state (settled for the message)."""

    site: int
    source: Any
    store: SiteStore
    kept: KeptState
    node_config: Any


def open_site(context: Context, cfg: ConfigRecord | None, *, check_run: bool = True) -> SiteCall:
    site, source = site_source(context.node_config)
    store = SiteStore(context.state, _text(context.node_config.get("state-dir")), site, context.node_id)
    kept = store.load()
    if cfg is not None and check_run:
        if kept.run_key != cfg["run_key"] or kept.version != cfg["version"]:
            raise RuntimeError(f"site {site} is not in step with the server (run {kept.run_key or '-'} version "
                               f"{kept.version}, server {records.raw(cfg, 'run_key')} version "
                               f"{records.raw(cfg, 'version')}): sync first")
        kept.settle(records.integer(cfg, "counted"))
    return SiteCall(site, source, store, kept, context.node_config)


def _text(value: Any) -> str | None:
    return None if value in (None, "") else str(value)


def _flag(node_config: Any, key: str, default: bool) -> bool:
    value = node_config.get(key, default)
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def local_round(call: SiteCall, state: GlobalState, plan: RoundPlan) -> ClientUpdate:
    """The site's round: its client from the kept state, I local steps, the new state kept as pending."""
    kept = call.kept
    client = build_client(call.site, call.source, kept)
    if kept.client is None and kept.replaced and state.c_v is not None and state.c_alpha is not None:
        client.set_control_variate(state.c_v, state.c_alpha)  # a replaced client starts from c
    start = client.get_state()
    update = client.local_round(state, plan)
    kept.pending_round, kept.pending, kept.pending_start = plan.round, client.get_state(), start
    call.store.save(kept)
    update.stats.client_id = call.site
    return update


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    call = open_site(context, None, check_run=False)
    cfg = msg.content.config_records[records.CONFIG]
    same_run = call.kept.run_key == cfg["run_key"]
    src = call.source
    requires = _flag(call.node_config, "require-secagg", False)
    if requires and "secagg" in cfg and not cfg["secagg"]:
        log.error("site %d (node %d): this node takes part only in rounds under secure aggregation (require-secagg "
                  "= true) and the server's run has flower.secagg: false, so it can take part in none; set "
                  "flower.secagg: true in the study's config, or require-secagg = false on this node",
                  call.site, context.node_id)
    server_version = str(cfg.get("fdam_ray_version", "") or "")
    if server_version and server_version != fdam_ray.__version__:
        log.error("site %d (node %d) runs fdam-ray %s and the server fdam-ray %s: the server refuses this node; "
                  "install fdam-ray %s here", call.site, context.node_id, fdam_ray.__version__, server_version,
                  server_version)
    return Message(RecordDict({records.CONFIG: records.config({
        "site": call.site, "version": call.kept.version if same_run else 0,
        "fdam_ray_version": fdam_ray.__version__,
        "input_shape": [int(d) for d in src.input_shape], "num_tasks": int(src.num_tasks),
        "task_names": [str(t) for t in src.task_names], "require_secagg": requires,
        "lost_state": call.store.lost})}), reply_to=msg)


@app.query("refused")
def refused(msg: Message, context: Context) -> Message:
    """The server refuses this node (or stops the run because of it): the site's own log says so, in one line."""
    reason = str(msg.content.config_records[records.CONFIG]["reason"])
    log.error("site %s (node %d): refused by the server: %s",
              context.node_config.get("site", "?"), context.node_id, reason)
    return Message(RecordDict(), reply_to=msg)


@app.query("sync")
def sync(msg: Message, context: Context) -> Message:
    cfg = msg.content.config_records[records.CONFIG]
    call = open_site(context, None, check_run=False)
    kept = call.kept
    if kept.run_key != cfg["run_key"]:
        kept = call.kept = KeptState(run_key=str(cfg["run_key"]), replaced=bool(cfg["replaced"]))
    kept.settle(records.integer(cfg, "counted"))
    kept.config = str(cfg["config"])
    arrays = records.numpy_of(msg.content.array_records[records.ARRAYS])
    if "positive_ratio" in arrays:
        kept.positive_ratio = arrays["positive_ratio"]
    stage = records.integer(cfg, "stage")
    if stage > kept.stage:
        kept.reference = arrays["reference"]
        if cfg["reset"]:  # the stage starts every kept c^k at zero; a replaced client still adopts c (local_round)
            zero_control_variate(kept)
        kept.stage = stage
    kept.version = records.integer(cfg, "version")
    info = build_client(call.site, call.source, kept).info()
    call.store.save(kept)
    return Message(records.info_content(info), reply_to=msg)


@app.train("round")
def train_round(msg: Message, context: Context) -> Message:
    cfg = msg.content.config_records[records.CONFIG]
    call = open_site(context, cfg)
    if _flag(call.node_config, "require-secagg", False):
        raise PermissionError(f"site {call.site} takes part only in rounds under secure aggregation "
                              "(require-secagg); set flower.secagg: true on the server")
    update = local_round(call, records.global_state_of(msg.content), records.plan_of(cfg))
    return Message(RecordDict({records.STATE: records.arrays(update.vectors()),
                               records.CONFIG: records.config(records.stats_config(update.stats))}), reply_to=msg)


@app.train(mods=[secaggplus_mod])
def train_secure(msg: Message, context: Context) -> Message:
    return secure_round(msg, context, lambda cfg: open_site(context, cfg), local_round, site_histogram)


def site_histogram(call: SiteCall, state: GlobalState, split: str, bins: Binning) -> ScoreHistogram | None:
    """The site's score histogram of ``split`` (None: it has no such part, or ``share-test-scores = false``)."""
    if not _flag(call.node_config, "share-test-scores", True):
        return None
    return build_client(call.site, call.source, call.kept).score_histogram(state, split, bins)


@app.query("change")
def change(msg: Message, context: Context) -> Message:
    cfg = msg.content.config_records[records.CONFIG]
    call = open_site(context, None, check_run=False)
    kept, wanted = call.kept, records.integer(cfg, "round")
    if kept.pending is None or kept.pending_round != wanted or kept.pending_start is None:
        raise RuntimeError(f"site {call.site} holds no update of round {wanted}")
    new, old = kept.pending.control, kept.pending_start.control
    drift = site_drift(kept)
    names = drift.names
    delta = dict.fromkeys(names) if new is None or old is None else dict(zip(names, drift.change(new, old),
                                                                              strict=True))
    return Message(RecordDict({records.STATE: records.arrays(delta)}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg = msg.content.config_records[records.CONFIG]
    call = open_site(context, cfg)
    bins = cfg.get("bins")  # test_scores: histogram: counts of the scores, never the scores
    if not _flag(call.node_config, "share-test-scores", True):
        return Message(records.scores_content(None) if bins is None else records.histogram_content(None),
                       reply_to=msg)
    split = str(cfg.get("split", "test"))  # "val": the site's validation part (val_fraction > 0)
    client = build_client(call.site, call.source, call.kept)
    state = records.global_state_of(msg.content)
    if bins is not None:
        found = client.score_histogram(state, split, records.binning_of_header(cfg))
        return Message(records.histogram_content(found), reply_to=msg)
    return Message(records.scores_content(client.evaluate(state, split)), reply_to=msg)


@app.query("score_sums")
def score_sums(msg: Message, context: Context) -> Message:
    cfg = msg.content.config_records[records.CONFIG]
    call = open_site(context, cfg)
    client = build_client(call.site, call.source, call.kept)
    return Message(records.score_sums_content(client.score_sums(records.global_state_of(msg.content))),
                   reply_to=msg)



@app.query("sizes")
def sizes(msg: Message, context: Context) -> Message:
    """The site's n_k (training samples after the validation hold-out) under the config the server sends: what
    the driver counts when it holds the data itself (:func:`~fdam_ray.privacy.driver.train_size`)."""
    cfg = msg.content.config_records[records.CONFIG]
    call = open_site(context, None, check_run=False)
    config = build_config(json.loads(str(cfg["config"])))
    # an image site's data under this study
    n = train_size(study_source(call.source, config), call.site, config.val_fraction, config.seed)
    return Message(RecordDict({records.CONFIG: records.config({"num_train": n})}), reply_to=msg)
