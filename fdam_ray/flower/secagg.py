"""A round under Flower's SecAgg+: the server learns only the sum of the sites' updates.

CODASCA's server needs only sums (docs/algorithms.md s.3): sum_k w_k v^k,
sum_k w_k alpha^k, the BatchNorm statistics' sum, and the change of the global
c, sum_k w_k (c^k_new - c^k_old). Each site sends one vector,

    s_k * [v^k - v, alpha^k - alpha, buffers^k - buffers, c_v^k change, c_alpha^k change] + [loss, samples / 1e4,
    not finite, out of range]          with s_k = w_k / (sum of the planned sites' w)

through Flower's ``secaggplus_mod``, which quantises it and masks it; the
``SecAggPlusWorkflow`` on the server unmasks only the mean over the sites that
completed the protocol. Sending differences from the round's start (not the
end points) keeps the values small, so the fixed-point grid is fine where it
matters.

Fixed-point quantisation (Flower's): every value is clipped to
[-flower.secagg_clipping_range, +range] (default 8) and mapped onto
flower.secagg_quantization_range integer levels (default 2**24) with stochastic
rounding, so each value carries an error of at most 2 * 8 / 2**24 = 9.5e-7 per
site and round; a site refuses to send a value outside the range (it would be
clipped silently), and the server stops the run naming the setting. Integer
buffers (num_batches_tracked, the same on every site) are sent in the clear;
so is nothing else.

Under ``dp: client`` a site's update is already its clipped change D~_k (with its noise share under
``dp_noise_at: clients``, added before the masking) and zeros in place of c^k: it is sent as it is, s_k * D~_k,
and the server's private reducer post-processes the unmasked sum (fdam_ray/privacy/client_level.py), so under
``dp_noise_at: clients`` no party sees a sum without noise.

Score histograms (``test_scores: histogram``): an evaluation goes through SecAgg+ too, as a round of its own
(:func:`run_secure_histogram`), so the server learns only the SUM of the sites' counts (no site's histogram, no
site's own AUC: ``client_auc`` is absent under SecAgg+). Its quantisation is chosen for exactness, not taken from
the flower section: clipping range 1 and L = min(2**30, 2**31 / (the sites, rounded up to a power of two))
levels (:func:`histogram_levels`); a site sends each count c (c <= L) as c * 2 / L - 1, which Flower maps to the
integer c exactly (powers of two only, no rounding; the stochastic rounding of an integer is the integer); the
masked integers sum modulo 2**32 > sites * L, so the unmasked sum is every count's exact sum, read back with
``rint``. A site whose count exceeds L refuses (one line).

Every secure round uses the partial-participation form of the control-variate
step, c <- c + sum_S w_k (change of c^k) / sum_all w, which is the full-round
mean when every site completes and stays right when SecAgg+ completes a round
without a site that dropped.
"""

from __future__ import annotations

from fdam_ray.flower import needs_flower  # noqa: F401 (first: without Flower, says what to install)

# isort: split
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

from fdam_ray.algorithms.server import PartialSum
from fdam_ray.core.state import GlobalState, RoundPlan, Rule, ScoreHistogram, StepStats, vector_names
from fdam_ray.executors.flower_section import FlowerSection
from fdam_ray.flower import records
from fdam_ray.loop.evaluation import SUMMED
from fdam_ray.scores.histogram import Binning

if TYPE_CHECKING:
    from fdam_ray.algorithms.drift import DriftCorrection
    from fdam_ray.flower.executor import FlowerExecutor

log = logging.getLogger(__name__)

SAMPLES_SCALE = 1e-4  # samples enter the secure sum as samples * 1e-4 (inside the clipping range)
_DIFFERENCES = ("v", "alpha", "buffers")  # sent as x^k - x; the control vectors as the change of c^k
_SUMMED = (*_DIFFERENCES, *vector_names(Rule.CONTROL))
_STATS = 4  # loss, samples * SAMPLES_SCALE, not finite, out of range


# -- site side ------------------------------------------------------------------------------------
def secure_round(msg: Message, context: Context, open_call: Callable[[ConfigRecord], Any],
                 local_round: Callable[..., Any], score: Callable[..., ScoreHistogram | None] | None = None
                 ) -> Message:
    """The site's round inside the SecAgg+ protocol: the update as one scaled difference vector."""
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    cfg = fitins.config
    if "binning" in cfg:  # an evaluation's histogram round, not a training round
        if score is None:
            raise RuntimeError("this site cannot send a score histogram under secure aggregation")
        return secure_histogram(msg, context, open_call, score)
    header = records.config({k: cfg[k] for k in ("run_key", "version", "counted")})
    call = open_call(header)
    names = str(cfg["names"]).split(",")
    vectors: dict[str, np.ndarray | None] = dict.fromkeys(vector_names())
    vectors.update(zip(names, parameters_to_ndarrays(fitins.parameters), strict=True))
    state = GlobalState.from_vectors(vectors, round=int(cfg["round"]), iteration=int(cfg["iteration"]))
    plan = RoundPlan(round=int(cfg["plan_round"]), stage=int(cfg["plan_stage"]), steps=int(cfg["plan_steps"]),
                     lr=float(cfg["plan_lr"]), iteration=int(cfg["plan_iteration"]), partial=True)
    update = local_round(call, state, plan)
    own = call_weight(call)
    weight = 1.0 if own is None else own
    scale = weight * float(cfg["scale"])
    private = call_private(call)  # the update is the clipped change itself
    parts = []
    for name in _SUMMED:
        x = getattr(update, name)
        if x is None:
            continue
        start = getattr(state, name) if name in _DIFFERENCES and not private else 0.0
        parts.append((np.asarray(x, dtype=np.float64) - start) * scale)
    body = np.concatenate(parts) if parts else np.zeros(0)
    clip = float(cfg["clip"])
    out_of_range = bool(body.size and np.abs(body).max() > clip)
    if out_of_range:
        log.warning("site %d: a value of its update is %.3g, outside flower.secagg_clipping_range=%g", call.site,
                    float(np.abs(body).max()), clip)
    stats = np.array([float(np.clip(update.stats.loss, -clip, clip)), update.stats.samples * SAMPLES_SCALE,
                      0.0 if update.stats.finite else 1.0, 1.0 if out_of_range else 0.0])
    res = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters([np.concatenate([body, stats])]), 1,
                 {"counters": json.dumps([int(c) for c in update.counters]), "steps": update.stats.steps})
    return Message(compat.fitres_to_recorddict(res, keep_input=True), reply_to=msg)


def call_weight(call: Any) -> float | None:
    """w_k of the site (None: uniform): its training-set size under client_weighting ``samples``."""
    config = json.loads(call.kept.config)
    if config.get("client_weighting", "uniform") == "uniform":
        return None
    return float(len(call.source.client_shard(call.site).train))


def call_private(call: Any) -> bool:
    """Whether the site's run is dp: client (its update is then its clipped change, not its end point)."""
    return bool(json.loads(call.kept.config).get("dp", "off") == "client")


HISTOGRAM_CLIP = 1.0  # the histogram round's clipping range (a power of two: the grid is exact)
_HIST_STATS = 3  # samples, nan outputs, sites that contributed


def histogram_levels(sites: int) -> int:
    """L, the histogram round's quantisation levels: sites * L <= 2**31 < 2**32, Flower's modulus, which also
    holds the sum of the sites' factors, sites * L (at 2**32 it would wrap to 0), and L fits an int32."""
    return min(2**30, 2**31 // (1 << max(sites - 1, 0).bit_length()))


def secure_histogram(msg: Message, context: Context, open_call: Callable[[ConfigRecord], Any],
                     score: Callable[..., ScoreHistogram | None]) -> Message:
    """The site's score histogram inside SecAgg+: its counts (and samples, NaN outputs) as one vector on the
    exact grid of :func:`histogram_levels`; nothing in the clear."""
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    cfg = fitins.config
    call = open_call(records.config({k: cfg[k] for k in ("run_key", "version", "counted")}))
    names = str(cfg["names"]).split(",")
    vectors: dict[str, np.ndarray | None] = dict.fromkeys(vector_names())
    vectors.update(zip(names, parameters_to_ndarrays(fitins.parameters), strict=True))
    state = GlobalState.from_vectors(vectors, round=int(cfg["round"]), iteration=int(cfg["iteration"]))
    header = json.loads(str(cfg["binning"]))
    binning = Binning(int(header["bins"])) if "bins_lo" not in header else \
        Binning(int(header["bins"]), tuple(map(float, header["bins_lo"])), tuple(map(float, header["bins_hi"])))
    tasks, levels = int(cfg["tasks"]), int(cfg["levels"])
    found = score(call, state, str(cfg["split"]), binning)
    counts = np.zeros((tasks, 2, binning.bins), np.int64) if found is None else np.asarray(found.counts, np.int64)
    if counts.shape != (tasks, 2, binning.bins):
        raise ValueError(f"site {call.site}: its histogram has shape {counts.shape}, the server asked for "
                         f"{(tasks, 2, binning.bins)}")
    extra = [0, 0, 0] if found is None else [found.samples, found.nan_outputs, 1]
    values = np.concatenate([counts.ravel(), np.asarray(extra, np.int64)])
    if values.min() < 0 or values.max() > levels:
        raise ValueError(f"site {call.site}: a count of its score histogram is {int(values.max())}, above the "
                         f"{levels} the secure sum holds exactly")
    body = values.astype(np.float64) * (2 * HISTOGRAM_CLIP / levels) - HISTOGRAM_CLIP  # exact: powers of two
    res = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters([body]), 1, {})
    return Message(compat.fitres_to_recorddict(res, keep_input=True), reply_to=msg)


# -- server side ----------------------------------------------------------------------------------
class _OneRound(Strategy):
    """The legacy strategy SecAggPlusWorkflow drives: it asks the round's sites and keeps the unmasked mean."""

    def __init__(self, instructions: list[tuple[GridClientProxy, FitIns]]) -> None:
        self.instructions = instructions
        self.mean: np.ndarray | None = None
        self.sites_done: list[int] = []
        self.metrics: list[dict] = []

    def initialize_parameters(self, client_manager):
        return None

    def configure_fit(self, server_round, parameters, client_manager):
        return self.instructions

    def aggregate_fit(self, server_round, results, failures):
        if results:
            self.mean = parameters_to_ndarrays(results[0][1].parameters)[0]
            self.sites_done = [proxy.node_id for proxy, _ in results]
            self.metrics = [dict(res.metrics) for _, res in results]
        return None, {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def enable(executor: FlowerExecutor, context: Context, drift: DriftCorrection) -> None:
    """Run every round of ``executor`` under SecAgg+ (the ServerApp's ``context`` hosts the workflow's state;
    ``drift``: the run's drift correction, whose rule moves c from the sites' summed changes)."""
    flower = executor.flower

    def secure(ex: FlowerExecutor, state: GlobalState, plan: RoundPlan, sites: list[int], *,
               sampled: bool) -> PartialSum | None:
        return run_secure_round(ex, context, flower, state, plan, sites, sampled=sampled, drift=drift)

    def histogram(ex: FlowerExecutor, state: GlobalState, split: str, bins: Binning,
                  sites: list[int]) -> ScoreHistogram | None:
        return run_secure_histogram(ex, context, flower, state, split, bins, sites)

    executor.secure = secure
    executor.secure_histogram = histogram


def _weight(ex: FlowerExecutor, k: int) -> float:
    return 1.0 if ex.weights is None else float(ex.weights[k])


def run_secure_round(ex: FlowerExecutor, context: Context, flower: FlowerSection, state: GlobalState,
                     plan: RoundPlan, sites: list[int], *, sampled: bool, drift: DriftCorrection) -> PartialSum | None:
    """One round through SecAggPlusWorkflow; the partial sum of the sites that completed it (None: none did)."""
    if len(sites) < 2:
        raise RuntimeError(f"round {plan.round}: secure aggregation needs at least 2 sites, {len(sites)} are ready")
    names = [n for n, x in state.vectors().items() if x is not None]
    params = ndarrays_to_parameters([x for x in state.vectors().values() if x is not None])
    planned = sum(_weight(ex, k) for k in sites)
    run_id = ex.grid.run.run_id
    instructions = []
    for k in sites:
        cfg = {**ex.header(k), "round": state.round, "iteration": state.iteration, "names": ",".join(names),
               "scale": 1.0 / planned, "clip": flower.secagg_clipping_range,
               **{f"plan_{f}": getattr(plan, f) for f in ("round", "stage", "steps", "lr", "iteration")}}
        instructions.append((GridClientProxy(ex.node_of[k], ex.grid, run_id), FitIns(params, cfg)))
    strategy = _workflow(ex, context, flower, instructions, plan.round, flower.secagg_clipping_range,
                         flower.secagg_quantization_range)
    if strategy.mean is None:
        return None
    done = sorted(ex.site_of[n] for n in strategy.sites_done)
    for k in done:
        ex.counted[k] = plan.round
    return _partial_sum(ex, state, plan, strategy, done, planned, sampled=sampled, drift=drift)


def _workflow(ex: FlowerExecutor, context: Context, flower: FlowerSection,
              instructions: list[tuple[GridClientProxy, FitIns]], round_: int, clip: float, levels: int) -> _OneRound:
    """Run one SecAggPlusWorkflow over ``instructions`` with the given quantisation; its strategy (the mean)."""
    strategy = _OneRound(instructions)
    legacy = LegacyContext(Context(run_id=context.run_id, node_id=context.node_id, node_config=context.node_config,
                                   state=RecordDict(), run_config=context.run_config), strategy=strategy)
    legacy.state.config_records[MAIN_CONFIGS_RECORD] = records.config({Key.CURRENT_ROUND: round_})
    legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(Parameters([], ""), True)
    workflow = SecAggPlusWorkflow(_share(flower.secagg_num_shares), _share(flower.secagg_reconstruction_threshold),
                                  max_weight=1.0, clipping_range=clip, quantization_range=levels,
                                  timeout=flower.round_timeout_s)
    workflow(ex.grid, legacy)
    return strategy


def run_secure_histogram(ex: FlowerExecutor, context: Context, flower: FlowerSection, state: GlobalState,
                         split: str, bins: Binning, sites: list[int]) -> ScoreHistogram | None:
    """The sum of the sites' score histograms of ``split`` through SecAgg+, exact (the module docstring): one
    :class:`ScoreHistogram` with client_id ``SUMMED`` and no AUC of any site; None if no site has such a part."""
    if len(sites) < 2:
        raise RuntimeError(f"evaluation: secure aggregation needs at least 2 sites, {len(sites)} are ready")
    if ex.shapes is None:
        raise RuntimeError("evaluation before the sites connected")
    tasks, levels = ex.shapes.num_tasks, histogram_levels(len(sites))
    names = [n for n, x in state.vectors().items() if x is not None]
    params = ndarrays_to_parameters([x for x in state.vectors().values() if x is not None])
    binning = json.dumps(records.binning_header(bins))
    run_id = ex.grid.run.run_id
    common: dict[str, Any] = {"round": state.round, "iteration": state.iteration, "names": ",".join(names),
                              "binning": binning, "split": split, "tasks": tasks, "levels": levels}
    instructions = [(GridClientProxy(ex.node_of[k], ex.grid, run_id),
                     FitIns(params, {**cast(dict, ex.header(k)), **common})) for k in sites]
    strategy = _workflow(ex, context, flower, instructions, state.round, HISTOGRAM_CLIP, levels)
    if strategy.mean is None:
        raise RuntimeError("evaluation: secure aggregation of the score histograms returned no sum")
    n = len(strategy.sites_done)
    total = np.rint((strategy.mean * n + n * HISTOGRAM_CLIP) * (levels / (2 * HISTOGRAM_CLIP))).astype(np.int64)
    counts, (samples, nan_outputs, contributed) = total[:-_HIST_STATS], total[-_HIST_STATS:]
    if contributed == 0:
        return None
    return ScoreHistogram(SUMMED, counts.reshape(tasks, 2, bins.bins), np.zeros(0), int(samples), int(nan_outputs))


def _share(value: float) -> int | float:
    """A count stays a count; a fraction stays a fraction (SecAggPlusWorkflow reads the type)."""
    return int(value) if float(value) > 1 and float(value).is_integer() else float(value)


def _partial_sum(ex: FlowerExecutor, state: GlobalState, plan: RoundPlan, strategy: _OneRound, done: list[int],
                 planned: float, *, sampled: bool, drift: DriftCorrection) -> PartialSum:
    """The sites' weighted sums, rebuilt from the unmasked mean of their scaled differences."""
    n = len(done)
    if strategy.mean is None:
        raise RuntimeError(f"round {plan.round}: secure aggregation returned no sum")
    total: np.ndarray = strategy.mean * n  # sum over the sites of s_k * difference (+ the stats)
    body, stats = total[:-_STATS], total[-_STATS:]
    if stats[3] > 0.5:
        raise ValueError(f"round {plan.round}: an update held values outside flower.secagg_clipping_range="
                         f"{ex.flower.secagg_clipping_range:g}; raise it (the sites' logs name the value)")
    weight = sum(_weight(ex, k) for k in done)
    total_all = drift.total_weight(ex.num_sites, ex.weights)
    out: dict[str, np.ndarray | None] = {}
    offset = 0
    for name in _SUMMED:
        ref = getattr(state, name)
        if ref is None:
            out[name] = None
            continue
        change = body[offset: offset + ref.size] * planned  # sum_k w_k (x^k - x)
        offset += ref.size
        if name in _DIFFERENCES and ex.private:  # dp: client: the sum of the clipped changes, as the reducer takes it
            out[name] = change.astype(np.float32)
        elif name in _DIFFERENCES:
            out[name] = (change + weight * ref.astype(np.float64)).astype(np.float32)
        elif sampled:  # the reducer adds c and divides by the total weight itself
            out[name] = change.astype(np.float32)
        else:  # a full round's reducer divides by the weight that came: give it weight * (c + change / all)
            out[name] = (weight * drift.moved_c(ref, [(1.0, change)], total_all)).astype(np.float32)
    counters = [json.loads(str(m["counters"])) for m in strategy.metrics]
    out["counters"] = np.max(np.asarray(counters, dtype=np.int64), axis=0) if counters and counters[0] else \
        state.counters.copy()
    loss = float(stats[0]) / n
    stat = StepStats(-1, loss, plan.steps, round(float(stats[1]) / SAMPLES_SCALE), 0.0, finite=stats[2] < 0.5)
    return PartialSum.from_vectors(out, weight=weight, count=n, bytes_up=n * int(total.size) * 4, stats=[stat])
