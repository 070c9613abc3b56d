"""The config fields of differential privacy (``dp``, docs/algorithms.md s.9) and the rules across them.

Two modes, one noise multiplier sigma relative to one L2 bound C:

- ``client``: client-level DP. Each participating client's change of a round
  is clipped to C as one vector; the server's sum of the clipped changes gets
  N(0, sigma^2 C^2 I), added once by the server (``dp_noise_at: server``, a
  trusted aggregator) or as shares N(0, sigma^2 C^2 / m) by each of the m
  reporting sites (``clients``). One record is one client's whole data.
- ``sample``: DP-SGD inside each site's local steps: per-sample gradients
  clipped to C, the batch sum noised. One record is one sample (a patient
  record) of one site; epsilon is per site.

sigma is given (``dp_noise_multiplier``) or solved from a target epsilon
(``dp_epsilon``) for the planned run, never both. The guarantee (epsilon,
delta) does not depend on C: C sets only how much of each change survives,
so a poorly chosen C costs accuracy, never privacy. That is why ``dp_clip``
has a default (1.0, the usual default of DP-SGD libraries) while sigma and the
target have none: they decide the privacy and must be the user's choice.

Every rule refuses (never warns) when the combination would make the reported
epsilon describe a run other than the one that runs: a dp field set while
``dp: off`` (a run believed private that is not), a release the accountant
does not count (a pre-training stage without noise, CODA's closed-form alpha
from clients' un-noised score sums, weights n_k that scale a clipped change),
or a mechanism the accountant's event does not describe (Poisson clients with
noise shares). :func:`check_resume` holds a resumed run to the privacy it
started with; only ``dp_max_epsilon`` may be raised.

``dp_sampling`` null (the default) is :attr:`PrivacySection.sampling`:
``poisson`` under ``dp: client`` with clients_per_round < num_clients and the
noise at the server (each client joins a round with probability S / K, drawn
from the secret: the Poisson-subsampled Gaussian, add-or-remove neighbours,
which the exact PLD accountant counts) and under ``dp: sample`` with batches
(each step takes every sample with probability B / n_k), ``fixed`` otherwise
(a full batch, full participation, noise shares). Poisson is refused with ``dp_noise_at: clients``
and S < K: each drawn site adds a share N(0, sigma^2 C^2 / S), so a round's
noise would scale with the realised draw, the site's own presence included (a
round that drew one site would carry that site's change under a 1/S share of
the noise), which no Poisson-subsampled Gaussian describes.

Under ``sample`` each local step draws its own batch as ``dp_sampling`` says
(:mod:`fdam_ray.privacy.batches`: Poisson with q = B / n_k, or B distinct
uniformly, keyed by the noise's secret, never shuffled epochs), so the
per-site accountant describes the batches the run takes. Refused with it, at
config time: balanced batches (positives drawn more often than B / n_k), fp16
(no per-sample loss scaling), a built-in network with BatchNorm (cnn,
resnet20, densenet121, densenet161: use cnn_gn; an own factory is checked when
its replica is built), and Poisson with the full batch (q = 1: no amplification;
the full batch is accounted with ``fixed``). The train_loss each site reports
(StepStats.loss, the round's mean of its steps' un-noised losses) is computed
from its private data without noise: it is a release outside the guarantee,
kept because NaN would trip the divergence checks; do not publish it.

``test_scores: histogram`` keeps every per-sample score and label of a
client's test split (and validation part) at the client: it sends per-class
counts of its scores in ``test_score_bins`` fixed intervals and its own AUC
per task (:mod:`fdam_ray.scores.histogram`); the driver sums the counts into
the pooled AUC. No noise: the counts are exact (see the histogram module for
what they still reveal). Both fields may change on resume: they change how
evaluations are computed and what they send, never the model's trajectory.

``dp_eval: on`` (:mod:`fdam_ray.privacy.evaluation`) noises the pooled counts
of every evaluation for the test and validation records' own guarantee
(sigma_e given as ``dp_eval_noise`` or solved for ``dp_eval_epsilon``, one of
the two). It needs ``test_scores: histogram``, may be on with ``dp: off``
(then ``dp_delta`` and ``dp_noise_seed`` act for it), and cannot change on
resume.
"""

from __future__ import annotations

import dataclasses
import logging

from fdam_ray.privacy.adaptive import default_count_noise
from fdam_ray.scores.histogram import DEFAULT_BINS, MAX_BINS
from fdam_ray.settings.sections import (
    FRACTION,
    NONNEGATIVE,
    POSITIVE,
    ConfigError,
    Section,
    fail,
    setting,
    shared,
    warn_once,
)

log = logging.getLogger(__name__)
# The presets whose drift correction is control variates (a test holds this to the presets' declarations; the
# section cannot import the algorithms, which import the privacy package).
CONTROL_VARIATE_PRESETS = ("codasca", "scaffold")


def _even_bins(bins: object) -> bool:
    return isinstance(bins, int) and not isinstance(bins, bool) and 2 <= bins <= MAX_BINS and bins % 2 == 0

DP_MODES = ("off", "client", "sample")
TEST_SCORES = ("exact", "histogram")
NOISE_AT = ("server", "clients")
SAMPLINGS = ("fixed", "poisson")
ACCOUNTANTS = ("pld", "rdp")
EVAL_MODES = ("off", "on")

# Fields that must keep their defaults while dp is off, and the field whose default is the mode itself.
_DP_FIELDS = ("dp_clip", "dp_noise_multiplier", "dp_epsilon", "dp_delta", "dp_max_epsilon", "dp_noise_at",
              "dp_sampling", "dp_noise_seed", "dp_accountant", "dp_clip_quantile", "dp_clip_lr",
              "dp_clip_count_noise")
# dp_sampling's default before null (what a run's config.yaml of then records, dp: off included): still read.
_OLD_DEFAULT = ("dp_sampling", "fixed")
# The one field a resumed run may change (raise only), see check_resume.
_RESUME_FIXED = ("dp", "dp_clip", "dp_noise_multiplier", "dp_epsilon", "dp_delta", "dp_noise_at", "dp_sampling",
                 "dp_accountant", "dp_eval", "dp_eval_noise", "dp_eval_epsilon", "dp_clip_quantile", "dp_clip_lr",
                 "dp_clip_count_noise")
# dp fields that private evaluation also reads (dp_eval: on with dp: off): delta and the noise's secret.
_EVAL_READS = ("dp_delta", "dp_noise_seed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrivacySection(Section):
    """Differential privacy (this module's docstring): the mode, C, sigma or a target epsilon, delta, the budget."""

    name = "privacy"

    dp: str = setting("off", "Differential privacy: off; client (each participating client's round change clipped "
                      "to dp_clip as one vector, Gaussian noise on the sum: protects a client's whole data); sample "
                      "(DP-SGD in each site's local steps, per-sample clipping: protects one record, epsilon per "
                      "site). The train_loss a site reports is computed without noise: it is outside the "
                      "guarantee.", choices=DP_MODES)
    dp_clip: float = setting(1.0, "C, L2 bound of a client's change (dp: client) or of a per-sample gradient (dp: "
                             "sample); epsilon does not depend on it, accuracy does.", check=POSITIVE)
    dp_noise_multiplier: float | None = setting(
        None, "sigma, noise std over C. dp: client: the round's sum of clipped changes gets N(0, sigma^2 C^2) "
        "(shares N(0, sigma^2 C^2 / m) with dp_noise_at: clients; with dp_clip_quantile the update's part is "
        "raised to pay for the count). dp: sample: each step's sum of clipped per-sample gradients gets "
        "N(0, sigma^2 C^2). Give it or dp_epsilon, not both.",
        check=NONNEGATIVE)
    dp_epsilon: float | None = setting(
        None, "Target epsilon of the planned run, by dp_accountant: sigma is solved for it (at dp_delta). dp: "
        "client: for one client's whole data over the planned rounds (Poisson or S of K a round); dp: sample: for "
        "one record at the smallest site over the planned steps (each site has its own epsilon; the run reports "
        "the largest). Give it or dp_noise_multiplier, not both.", check=POSITIVE)
    dp_delta: float = setting(1e-5, "delta of the (epsilon, delta) guarantee, below 1 / (number of protected "
                              "units): dp: client, 1 / num_clients; dp: sample, 1 / n_k of the largest site; "
                              "dp_eval, 1 / (test records) (it reads this delta too).", check=FRACTION)
    dp_max_epsilon: float | None = setting(
        None, "Privacy budget: the run stops before the round that would take epsilon past it (dp: sample: the "
        "largest site's; not dp_eval's epsilon); null = no stop. A resumed run may raise it, never lower it.",
        check=POSITIVE, resume=True)
    dp_noise_at: str = setting(
        "server", "dp: client: who adds the noise: server (once, a trusted aggregator) or clients (each of the m "
        "reporting sites adds a share N(0, sigma^2 C^2 / m)).", choices=NOISE_AT)
    dp_sampling: str | None = setting(
        None, "How the sampled unit is drawn and accounted (clients of a round for dp: client, a step's batch for "
        "dp: sample), from the noise's secret randomness: fixed (exactly S of K, or B of n_k, without replacement; "
        "replace-one neighbours) or poisson (each with probability S / K, or B / n_k; add-or-remove neighbours; a "
        "round may draw no client and then applies the noise alone). null: poisson for dp: client with "
        "clients_per_round < num_clients and dp_noise_at: server (fixed-size can cost more epsilon than full "
        "participation) and for dp: sample with batch_size > 0, fixed otherwise.", choices=SAMPLINGS)
    dp_accountant: str = setting(
        "pld", "How epsilon is counted (the reported epsilon, the sigma solved for dp_epsilon, the dp_max_epsilon "
        "stop): pld (exact: the privacy loss distribution; the analytic Gaussian for full participation; the "
        "fixed-size sampler, which has none, falls back to rdp and the summary says so) or rdp (Renyi DP, looser: "
        "5-15% higher epsilon; kept to compare, and reported beside pld in summary.json as dp_epsilon_rdp).",
        choices=ACCOUNTANTS)
    dp_noise_seed: int | None = setting(
        None, "Secret of the privacy randomness (the noise, the client draw, dp: sample's batches, dp_eval's "
        "noise): null = fresh entropy each run, kept in the checkpoint for a resume (the private choice); an int "
        "replays it bit for bit (tests, audits), and whoever reads it can remove the noise. Never sent to "
        "trackers.", check=NONNEGATIVE)
    # adaptive clipping (dp: client; fdam_ray/privacy/adaptive.py)
    dp_clip_quantile: float | None = setting(
        None, "dp: client: gamma, the target quantile of the clients' change norms that the clip tracks (adaptive "
        "clipping, Andrew et al. 2021: C_{r+1} = C_r exp(-dp_clip_lr (b_r - gamma)), b_r the noised fraction of "
        "clients within C_r; dp_clip is C_1); null = the fixed clip dp_clip.", check=FRACTION)
    dp_clip_lr: float = setting(0.2, "eta_C, the step of adaptive clipping's geometric update (with "
                                "dp_clip_quantile).", check=POSITIVE)
    dp_clip_count_noise: float | None = setting(
        None, "sigma_b, the std of the noise on adaptive clipping's count of clients within the clip (with "
        "dp_clip_quantile); null = S / 20 (S the clients a round asks). Must be > sigma / 2: the update's noise "
        "multiplier becomes (sigma^-2 - (2 sigma_b)^-2)^(-1/2), so the round stays one Gaussian of sigma.",
        check=POSITIVE)
    test_scores: str = setting(
        "exact", "What a client sends of its test split (and validation part) for the pooled AUC: exact (its scores "
        "and labels; the exact pooled AUC) or histogram (per-class counts of its scores in test_score_bins fixed "
        "intervals and its own AUC per task, no per-sample value; the pooled AUC then within the binning bound, "
        "docs/algorithms.md s.9). The driver's own global test set is scored exactly either way.",
        choices=TEST_SCORES, resume=True)
    test_score_bins: int = setting(
        DEFAULT_BINS, "test_scores: histogram: B, score intervals per task and class (fixed by B alone, the same at "
        "every site); more bins: a tighter AUC, a finer view of a site's score distribution, 16 B bytes per task "
        "sent.", check=(_even_bins, f"an even integer in [2, {MAX_BINS}]"), resume=True)
    # -- private evaluation (fdam_ray/privacy/evaluation.py) --
    dp_eval: str = setting(
        "off", "Private evaluation: on = the pooled per-class score counts of each evaluation (test and validation) "
        "get N(0, dp_eval_noise^2) per count on the driver before the AUC, per-site AUCs are not recorded and the "
        "refinement passes are off; the test records' epsilon (dp_eval_epsilon) is reported beside the training "
        "one. Needs test_scores: histogram; allowed with any dp mode, also dp: off.", choices=EVAL_MODES)
    dp_eval_noise: float | None = setting(
        None, "dp_eval: on: sigma_e, the std of each count's noise; give it or dp_eval_epsilon, not both.",
        check=POSITIVE)
    dp_eval_epsilon: float | None = setting(
        None, "dp_eval: on: target epsilon of the test records over the planned evaluations (at dp_delta): sigma_e "
        "is solved for it; give it or dp_eval_noise, not both.", check=POSITIVE)
    num_clients: int = shared()
    clients_per_round: int | None = shared()
    client_weighting: str = shared()
    algorithm: str = shared()
    positive_ratio: float | None = shared()
    pretrain_iterations: int = shared()
    batch_size: int = shared()
    positive_sampling: str = shared()
    precision: str = shared()
    model: str = shared()

    @property
    def enabled(self) -> bool:
        return self.dp != "off"

    @property
    def histogram_bins(self) -> int | None:
        """B when clients send score histograms (``test_scores: histogram``), None when they send scores."""
        return self.test_score_bins if self.test_scores == "histogram" else None

    @property
    def sampled_clients(self) -> int:
        """S, the clients a round asks (K when every client takes part)."""
        if self.clients_per_round is None:
            return self.num_clients
        return min(self.clients_per_round, self.num_clients)

    @property
    def sampling(self) -> str:
        """``dp_sampling`` in force: the given one, else (null) poisson for dp: client with S < K and the noise at
        the server and for dp: sample with batches (batch_size > 0), fixed otherwise (this module's docstring)."""
        if self.dp_sampling is not None:
            return self.dp_sampling
        if self.dp == "sample" and self.batch_size > 0:
            return "poisson"
        return "poisson" if self.poisson_clients else "fixed"

    @property
    def poisson_clients(self) -> bool:
        """Whether each round's clients are a Poisson draw (:func:`client_draw_is_poisson`)."""
        return client_draw_is_poisson(self.dp, self.dp_sampling, self.num_clients, self.clients_per_round,
                                      self.dp_noise_at)

    def only_noise(self, sigma: float) -> str | None:
        """A warning line when the noise's std, sigma C, exceeds the largest sum it is added to (S clipped changes,
        or B clipped gradients, each at most C): each step is then mostly noise (a dp_epsilon too small)."""
        if self.dp == "client":
            unit, what, fix = self.sampled_clients, "clients a round", "clients_per_round"
        elif self.dp == "sample" and self.batch_size > 0:
            unit, what, fix = self.batch_size, "samples a batch", "batch_size"
        else:
            return None
        if sigma <= unit:
            return None
        return (f"dp: {self.dp}: sigma {sigma:.4g} is above the {unit} {what}: the noise (std sigma x dp_clip) is "
                "larger than the largest sum it is added to, so each step is mostly noise and the model will barely "
                f"learn; raise dp_epsilon or {fix}")

    def check(self) -> None:
        """The rules of this module's docstring, each one line naming the field."""
        if self.test_scores == "exact" and self.test_score_bins != DEFAULT_BINS:
            raise fail("test_score_bins", self.test_score_bins, f"{DEFAULT_BINS} while test_scores = exact (the "
                       "clients send their scores; set test_scores: histogram for the bins to act)")
        self._check_eval()
        if not self.enabled:
            self._check_off()
            return
        self._check_noise()
        self._check_releases()
        if self.dp == "client":
            self._check_client_level()
        else:
            self._check_sample_level()
        self._check_adaptive_clip()
        if self.positive_ratio is None:  # a scalar per site, released once; refusing would block bce runs too
            warn_once(log, "dp: positive_ratio is null, so p is computed from each site's exact positive counts, a "
                      "release the privacy accountant does not count; set positive_ratio to a public value to "
                      "close it")

    def _check_off(self) -> None:
        # refused, not warned: a run believed private that is not cannot be taken back once its model is shared
        defaults = {f.name: f.default for f in dataclasses.fields(PrivacySection) if f.name in _DP_FIELDS}
        for name in _DP_FIELDS:
            if self.dp_eval == "on" and name in _EVAL_READS:
                continue
            if getattr(self, name) != defaults[name] and (name, getattr(self, name)) != _OLD_DEFAULT:
                default = "null" if defaults[name] is None else defaults[name]
                raise fail(name, getattr(self, name), f"{default} while dp = off (set dp: client or dp: sample for "
                           f"it to act, or remove {name})")

    def _check_eval(self) -> None:
        """dp_eval: one of sigma_e and its target, and histograms (exact scores leave the sites)."""
        if self.dp_eval == "off":
            for name in ("dp_eval_noise", "dp_eval_epsilon"):
                if getattr(self, name) is not None:
                    raise fail(name, getattr(self, name), "null while dp_eval = off (set dp_eval: on for it to act)")
            return
        if self.test_scores != "histogram":
            raise fail("test_scores", self.test_scores, "histogram with dp_eval: on (exact sends per-sample scores "
                       "and labels off the sites, which no noise on the counts protects)")
        if (self.dp_eval_noise is None) == (self.dp_eval_epsilon is None):
            raise fail("dp_eval_noise", self.dp_eval_noise, "a value > 0, or null with a target dp_eval_epsilon "
                       "(one of the two) with dp_eval: on")
        if self.test_score_bins > 64:  # each bin's noise adds up, and clipping empty bins at 0 pulls AUC to 1/2
            warn_once(log, f"dp_eval with test_score_bins = {self.test_score_bins}: every bin gets its own noise "
                      "and the empty ones, clipped at 0, pull the AUC toward 1/2 (mean error 0.35 at 4096 bins, 0.14 "
                      "at 32, epsilon 1 over 21 evaluations of 1700 records: benchmarks/results/private_eval.md); "
                      "take test_score_bins 16 to 32")

    def _check_noise(self) -> None:
        sigma, target = self.dp_noise_multiplier, self.dp_epsilon
        if sigma is not None and target is not None:
            raise fail("dp_epsilon", target, f"null when dp_noise_multiplier = {sigma} is given (sigma is either "
                       "given or solved from the target, not both)")
        if sigma is None and target is None:
            raise fail("dp_noise_multiplier", None, f"a value >= 0, or a target dp_epsilon, with dp = {self.dp}")
        if self.dp_clip > MAX_CLIP:  # the noise's std is sigma x dp_clip: no model trains under 1e30
            raise fail("dp_clip", self.dp_clip, f"at most {MAX_CLIP:g} (the noise's std is sigma x dp_clip, which a "
                       "clip this large makes swamp any model; take a clip near the norm of a change (dp: client) or "
                       "of a per-sample gradient (dp: sample), or dp_clip_quantile)")
        if sigma == 0:
            warn_once(log, f"dp: {self.dp} with dp_noise_multiplier 0: no noise is added, epsilon is infinite and "
                      "this run gives no privacy (a setting for tests)")
        if self.dp_max_epsilon is not None:
            if target is not None and self.dp_max_epsilon < target:
                raise fail("dp_max_epsilon", self.dp_max_epsilon, f">= dp_epsilon = {target} (the planned run "
                           "would stop before its end)")
            if sigma == 0:
                raise fail("dp_max_epsilon", self.dp_max_epsilon, "null with dp_noise_multiplier = 0 (without "
                           "noise epsilon is infinite: no round would run)")
            if sigma is not None and sigma > 0 and self.dp == "client":  # dp: sample's n_k: the plug's check
                from fdam_ray.privacy.accountant import Accountant  # numpy only

                first = Accountant.for_clients(noise_multiplier=float(sigma), delta=self.dp_delta,
                                               num_clients=self.num_clients, clients_per_round=self.clients_per_round,
                                               sampling=self.sampling, accounting=self.dp_accountant).epsilon_after(1)
                if self.dp_max_epsilon < first:
                    raise fail("dp_max_epsilon", self.dp_max_epsilon, f">= {first:.4g}, the epsilon of the first "
                               f"round alone at dp_noise_multiplier {sigma:g} ({self.sampled_clients} of "
                               f"{self.num_clients} clients, {self.sampling}): no round would run; raise it or "
                               "the noise")

    def _check_releases(self) -> None:
        """Releases of private data that the accountant would not count."""
        if self.pretrain_iterations > 0:
            raise fail("pretrain_iterations", self.pretrain_iterations, f"0 with dp = {self.dp} (the pre-training "
                       "stage trains without privacy noise and its model is the AUC stage's start)")
        if self.algorithm == "coda":
            raise fail("algorithm", self.algorithm, f"another preset with dp = {self.dp} (coda's stage-end alpha is "
                       "computed in closed form from the clients' un-noised score sums)")
        if self.dp == "client" and self.algorithm in CONTROL_VARIATE_PRESETS:
            raise fail("algorithm", self.algorithm, "a preset without control variates with dp = client, e.g. "
                       "coda_plus (the server's c is rebuilt from the noised sum, so each round's noise comes back in "
                       "every client's next change, which the clip keeps: test AUC 0.47-0.56 against 0.78-0.84 "
                       "without c, docs/algorithms.md s.9 P3); dp: sample keeps control variates")

    def _check_sample_level(self) -> None:
        """dp: sample: what the per-sample step cannot take, and batches the accountant would not describe."""
        if self.dp_noise_at != "server":
            raise fail("dp_noise_at", self.dp_noise_at, "server with dp: sample (each site noises its own "
                       "batches; shares are for dp: client)")
        if self.positive_sampling != "natural":
            raise fail("positive_sampling", self.positive_sampling, "natural with dp: sample (balanced batches "
                       "draw positives more often; the accountant's rate B / n_k holds only for uniform draws)")
        if self.precision == "fp16":
            raise fail("precision", self.precision, "fp32 or bf16 with dp: sample (per-sample gradients are formed "
                       "without loss scaling, and fp16 ones underflow)")
        if isinstance(self.model, str) and self.model in _BATCHNORM_MODELS:
            raise fail("model", self.model, "cnn_gn (the cnn with GroupNorm), mlp, linear, or your own factory "
                       f"without BatchNorm with dp: sample ({self.model} has BatchNorm, which mixes the samples "
                       "of a batch)")
        if self.batch_size <= 0 and self.sampling == "poisson":
            raise fail("dp_sampling", self.dp_sampling, "fixed with batch_size 'full' (q = 1: every step takes "
                       "every sample, no amplification by sampling; it is accounted as the full batch, with "
                       "dp_sampling: fixed)")

    def _check_client_level(self) -> None:
        if self.num_clients < 2:
            raise fail("num_clients", self.num_clients, ">= 2 with dp: client (with one client the noised sum is "
                       "that client's change alone)")
        if isinstance(self.model, str) and self.model in _BATCHNORM_MODELS:
            raise fail("model", self.model, "cnn_gn (the cnn with GroupNorm), mlp, linear, or your own factory "
                       f"without BatchNorm with dp: client ({self.model}'s running statistics would leave the sites "
                       "without clip or noise)")
        if self.client_weighting != "uniform":
            raise fail("client_weighting", self.client_weighting, "uniform with dp: client (weights n_k would "
                       "scale a client's clipped change past C and reveal its size)")
        if self.sampling == "poisson" and self.sampled_clients < self.num_clients and self.dp_noise_at != "server":
            raise fail("dp_sampling", self.dp_sampling, f"fixed (or null) with dp_noise_at: {self.dp_noise_at} and "
                       "clients_per_round < num_clients (each drawn site adds a 1/S share of the noise, so a Poisson "
                       "round's noise would shrink with its realised draw, the site's own presence included, which "
                       "the Poisson-subsampled Gaussian does not describe); or dp_noise_at: server")

    def _check_adaptive_clip(self) -> None:
        if self.dp_clip_quantile is None:
            for name, default in (("dp_clip_lr", 0.2), ("dp_clip_count_noise", None)):
                if getattr(self, name) != default:
                    raise fail(name, getattr(self, name), f"{'null' if default is None else default} while "
                               "dp_clip_quantile is null (set dp_clip_quantile for adaptive clipping to act)")
            return
        if self.dp != "client":
            raise fail("dp_clip_quantile", self.dp_clip_quantile, f"null with dp: {self.dp} (adaptive clipping "
                       "is client level: it tracks a quantile of the clients' change norms)")
        if self.dp_noise_at != "server":
            raise fail("dp_noise_at", self.dp_noise_at, "server with dp_clip_quantile (adaptive clipping's count "
                       "is noised once by the server; shares of it are not supported)")
        sigma = self.dp_noise_multiplier
        if sigma is not None and sigma > 0:
            count = self.dp_clip_count_noise
            sigma_b = default_count_noise(self.sampled_clients) if count is None else count
            if sigma_b <= sigma / 2:
                raise fail("dp_clip_count_noise", count, f"> dp_noise_multiplier / 2 = {sigma / 2:g} "
                           f"(now {sigma_b:g}; the count's noise takes part of sigma's budget: sigma^-2 - "
                           "(2 sigma_b)^-2 must be > 0)")


def client_draw_is_poisson(dp: str, dp_sampling: str | None, num_clients: int, clients_per_round: int | None,
                           dp_noise_at: str) -> bool:
    """Whether a run draws each round's clients by Poisson (each with probability S / K): dp: client with S < K and
    ``dp_sampling`` poisson, or null with the noise at the server (this module's docstring)."""
    if dp != "client" or clients_per_round is None or clients_per_round >= num_clients:
        return False
    return dp_sampling == "poisson" or (dp_sampling is None and dp_noise_at == "server")


# The largest dp_clip taken: the noise's std is sigma x dp_clip (changes and gradients have norms far below it).
MAX_CLIP = 1e6
# The built-in networks with BatchNorm (fdam_ray/models.py): refused by dp: client and dp: sample before any start.
_BATCHNORM_MODELS = ("cnn", "resnet20", "densenet121", "densenet161")


def check_resume(old: PrivacySection, new: PrivacySection) -> None:
    """A resumed run keeps the privacy it started with: the same mode, C, sigma or target, delta, noise placement
    and sampling; ``dp_max_epsilon`` may be raised (or set where there was none), never lowered or removed.
    Raises :class:`ConfigError` in one line naming the field."""
    for name in _RESUME_FIXED:
        before, after = getattr(old, name), getattr(new, name)
        if before != after:
            raise ConfigError(f"config field '{name}' cannot change on resume ({before} -> {after}): the run's "
                              "privacy accounting started under the old value; start a new run instead")
    before, after = old.dp_max_epsilon, new.dp_max_epsilon
    if before is not None and (after is None or after < before):
        raise ConfigError(f"config field 'dp_max_epsilon' may only be raised on resume ({before} -> {after}): a "
                          "budget once set cannot be lowered or removed by resuming")
