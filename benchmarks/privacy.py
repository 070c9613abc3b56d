"""What differential privacy costs in test AUC, and whether the reported epsilon is the one the mechanism spent.

Three settings, with the same run seeds at every epsilon (paired), each run accounted as a user's is (the default
``dp_accountant: pld``, and ``dp_sampling`` Poisson):

- ``dp: sample`` (DP-SGD inside each site) on examples/hospitals.py's three-hospital study (its data, model and
  training budget; dp_clip 0.1 and lr 0.3, :data:`SAMPLE_LR`), at epsilon 1, 4, 8 and without DP, sigma solved by
  the package from ``dp_epsilon`` for the smallest site, each step drawing every sample with probability B / n_k;
- ``dp: client`` (clip each site's round change, noise the sum) on digits-IH at epsilon 1, 4, 8 and without DP:
  the 4 class-disjoint IH sites, each dealt at random over ``--clients-per-site`` clients (digits has 5 positive
  classes, so the IH partition itself stops at K = 5), each client joining a round with probability S / K, the
  clip adaptive (the median of the change norms), clients hosted ``clients-per-site`` to an actor;
- ``dp: client`` against K (``--curve-k``): synthetic clients, S = 64 a round, epsilon 8 against dp off; the
  smallest K whose drop is <= 0.02 is ``client_k_drop002``.

Two checks ride on these runs: ``hist_auc_abs_err``, the pooled test AUC of a hospitals run with ``test_scores:
histogram`` against the same run with ``test_scores: exact`` (every evaluation, evaluation 0 included), and the
reported epsilons against independent recomputations: the PLD number (per site and the run's) against a second
implementation (the PRV accountant for Poisson sampling, benchmarks/accountant_check.py; ``pld_rel_err_vs_prv``),
and the summary's Renyi-DP number (``dp_epsilon_rdp``) against this file (NumPy/mpmath, no dp_accounting; its
``epsilon_rel_err``): Renyi DP of the Gaussian (alpha / 2 sigma^2), of the Poisson-subsampled Gaussian (Mironov,
Talwar, Zhang 2019: binomial sum at integer orders, the defining integral by quadrature at fractional ones), of
sampling without replacement under replace-one (Wang, Balle, Kasiviswanathan 2019, Thm. 27, with its Cor. 10
interpolation at fractional orders), then the conversion of Balle et al. 2020 / Canonne et al. 2020 over the same
orders.

    python benchmarks/privacy.py --quick      # committed results: about 4 min on 2 CPU cores, inline
    python benchmarks/privacy.py              # K = 256 on 4 Ray actors, 5 seeds: about 14 min on 2 cores

Last line: ``RESULT auc_drop_sample_eps8=... auc_drop_client_eps8=... auc_drop_sample_eps4=... auc_drop_sample_eps1=...
client_k_drop002=... epsilon_rel_err=... pld_rel_err_vs_prv=... hist_auc_abs_err=... ...``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common as C
import _stats
import mpmath
import numpy as np

EPSILONS = (1.0, 4.0, 8.0, math.inf)  # inf: dp off
DELTA = 1e-5
LEVEL = 0.9  # of the t-intervals over seeds
QUICK = {"seeds": [0, 1, 2], "client_iterations": 800, "clients_per_site": 16, "clients_per_round": 16,
         "client_executor": "inline", "curve_k": [128, 1024], "curve_seeds": [0, 1]}
FULL = {"seeds": [0, 1, 2, 3, 4], "client_iterations": 1600, "clients_per_site": 64, "clients_per_round": 32,
        "client_executor": "ray", "curve_k": [128, 256, 1024, 4096], "curve_seeds": [0, 1]}
# examples/hospitals.py's run (its full length), with a public positive ratio (malignant share of the
# whole Wisconsin set, 212 / 569): p from the sites' exact counts would be a release outside the accountant.
HOSPITALS = {"algorithm": "codasca", "model": "mlp", "model_width": 16, "lr": 0.1, "local_steps": 8,
             "batch_size": 16, "iterations": 800, "stage_length": 400, "eval_every": 200, "positive_ratio": 0.37}
# dp: sample's clip and step: dp_clip 0.1 and lr 0.3 (the run's lr 0.1 with dp_clip 1 before), the best of five
# (dp_clip, lr) pairs tried at epsilon 1 and 4 on seeds 0 and 1, picked by final test AUC: the sample-level drops are
# those of a setting tuned on the reported metric (a small sweep; benchmarks/results/privacy.md says so). dp off
# runs take the same lr (paired).
SAMPLE_LR, SAMPLE_CLIP = 0.3, 0.1
# dp: client against the number of clients: synthetic clients (fdam_ray/data/synthetic.py, 40 training samples
# each, 20 features), S = 64 a round whatever K (a server's round size is its capacity), Poisson with q = S / K,
# epsilon 8 against dp off, 50 rounds of I = 8.
CURVE = {"dataset": "synthetic", "samples_per_client": 40, "num_features": 20, "heterogeneity": 1.0,
         "model": "mlp", "model_width": 16, "algorithm": "coda_plus", "lr": 0.1, "local_steps": 8, "batch_size": 16,
         "iterations": 400, "eval_every": 200, "imratio": 0.1, "positive_ratio": 0.1, "executor": "inline"}
CURVE_S, CURVE_EPSILON, CURVE_TARGET = 64, 8.0, 0.02
# dp: client's clip: adaptive (Andrew et al. 2021), following the median of the round's change norms from dp_clip
# 0.1; the clipped count's noise sigma_b is set per run to 2 sigma (:func:`client_dp`), so the update's noise is
# sigma_z = sigma (1 - 1/16)^(-1/2) = 1.033 sigma and the count's fraction has noise 2 sigma / S.
CLIENT_DP: dict[str, Any] = {"dp_clip_quantile": 0.5, "dp_clip": 0.1}
DIGITS = {"algorithm": "coda_plus", "model": "mlp", "model_width": 32, "lr": 0.1, "local_steps": 8, "batch_size": 32,
          "positive_ratio": 0.1}
RUN = {"tensorboard": False, "checkpoint_every": 0}

# -- independent accounting (no dp_accounting) ------------------------------------------------------
# Orders: 1.1 .. 10.9 by 0.1, 11 .. 63, 128, 256, 512, 1024 (dp_accounting 0.6.0's default list, as the package).
ORDERS: tuple[float, ...] = tuple([round(1 + i / 10, 10) for i in range(1, 100)] + [float(a) for a in range(11, 64)]
                                  + [128.0, 256.0, 512.0, 1024.0])
# A subsampled release is accounted at the integer orders only (the package's rule: there the divergence has a
# closed form, recomputed here exactly; at fractional orders dp_accounting's series overstates it).
INTEGER_ORDERS: tuple[float, ...] = (*tuple(float(a) for a in range(2, 64)), 128.0, 256.0, 512.0, 1024.0)
_SUM_DPS, _QUAD_DPS = 30, 20
_WOR_EXACT_UP_TO = 256  # above this order only the 2 exp((j - 1) eps(j)) term of Thm. 27 (as dp_accounting)


def rdp_gaussian(sigma: float, orders: Sequence[float]) -> np.ndarray:
    """Renyi DP of one Gaussian release, sensitivity 1, noise multiplier sigma: alpha / (2 sigma^2)."""
    return np.asarray(orders, dtype=np.float64) / (2.0 * sigma**2)


def _log_a_poisson(q: float, sigma: float, alpha: float) -> float:
    """log A_alpha, A_alpha = E_{z ~ N(0, s^2)} [(1 - q + q exp((2z - 1) / 2s^2))^alpha] (Mironov et al. 2019):
    the binomial sum sum_i C(a, i) q^i (1 - q)^(a - i) exp((i^2 - i) / 2s^2) at integer orders, the integral
    itself by quadrature at fractional ones."""
    if float(alpha).is_integer():
        with mpmath.workdps(_SUM_DPS):
            a, qq, s2 = int(alpha), mpmath.mpf(q), mpmath.mpf(sigma) ** 2
            total = mpmath.fsum(mpmath.binomial(a, i) * qq**i * (1 - qq) ** (a - i) * mpmath.exp((i * i - i) / (2 * s2))
                                for i in range(a + 1))
            return float(mpmath.log(total))
    with mpmath.workdps(_QUAD_DPS):
        qq, s, a = mpmath.mpf(q), mpmath.mpf(sigma), mpmath.mpf(alpha)

        def density(z: Any) -> Any:
            return mpmath.npdf(z, 0, s) * (1 - qq + qq * mpmath.exp((2 * z - 1) / (2 * s * s))) ** a

        total = mpmath.quad(density, [-mpmath.inf, 0, 0.5, max(1.0, float(alpha)), mpmath.inf])
        return float(mpmath.log(total))


def rdp_poisson(q: float, sigma: float, orders: Sequence[float]) -> np.ndarray:
    """Renyi DP of one Poisson-subsampled Gaussian release (rate q, add-or-remove-one)."""
    return np.array([_log_a_poisson(q, sigma, a) / (a - 1) for a in orders])


def forward_differences(sigma: float, n: int) -> list:
    """|Delta^k f(0)| for k = 0..n, f(m) = exp((m - 1) eps(m)) = exp(m (m - 1) / 2 sigma^2) (Thm. 27 of Wang et
    al. 2019), in mpmath with enough digits for the cancellation (two precisions agree to 1e-20)."""
    def table(dps: int) -> list:
        with mpmath.workdps(dps):
            f = [mpmath.exp(mpmath.mpf(m * (m - 1)) / (2 * mpmath.mpf(sigma) ** 2)) for m in range(n + 1)]
            return [abs(mpmath.fsum((-1) ** (k - i) * mpmath.binomial(k, i) * f[i] for i in range(k + 1)))
                    for k in range(n + 1)]

    dps = 30 + int(n * 0.31) + int(n * max(0.0, math.log10(sigma)))
    while True:
        coarse, fine = table(dps), table(dps + 30)
        with mpmath.workdps(dps):
            if all(x == y or abs(x - y) <= mpmath.mpf(10) ** -20 * abs(y) for x, y in zip(coarse, fine, strict=True)):
                return fine
        dps *= 2


def _log_a_wor(q: float, sigma: float, alpha: int, diffs: list) -> float:
    """log of Thm. 27's bound on exp((alpha - 1) rdp(alpha)) for sampling without replacement (rate q, replace-one)
    of the Gaussian with noise multiplier sigma: 1 + q^2 C(a, 2) min(4 (e^eps(2) - 1), 2 e^eps(2)) + sum_{j >= 3}
    q^j C(a, j) min(4 sqrt(|D^{2 floor(j/2)}| |D^{2 ceil(j/2)}|), 2 e^{(j - 1) eps(j)}), eps(m) = m / 2 sigma^2."""
    if alpha == 1:
        return 0.0
    with mpmath.workdps(_SUM_DPS):
        qq, s2 = mpmath.mpf(q), mpmath.mpf(sigma) ** 2
        second = min(4 * mpmath.expm1(1 / s2), 2 * mpmath.exp(1 / s2))  # eps(2) = 1 / sigma^2
        terms = [mpmath.mpf(1), qq**2 * mpmath.binomial(alpha, 2) * second]
        for j in range(3, alpha + 1):
            bound = 2 * mpmath.exp(mpmath.mpf(j - 1) * j / (2 * s2))
            if alpha <= _WOR_EXACT_UP_TO:
                bound = min(4 * mpmath.sqrt(diffs[2 * (j // 2)] * diffs[2 * ((j + 1) // 2)]), bound)
            terms.append(qq**j * mpmath.binomial(alpha, j) * bound)
        return float(mpmath.log(mpmath.fsum(terms)))


def rdp_wor(q: float, sigma: float, orders: Sequence[float]) -> np.ndarray:
    """Renyi DP bound of one release of a size-qn sample without replacement (Thm. 27); a fractional order
    interpolates (alpha - 1) rdp linearly between its integer neighbours (Cor. 10)."""
    top = max((math.ceil(a) for a in orders if a <= _WOR_EXACT_UP_TO), default=2)
    diffs = forward_differences(sigma, top + 1)
    out = []
    for a in orders:
        lo, hi = math.floor(a), math.ceil(a)
        t = a - lo
        log_a = _log_a_wor(q, sigma, lo, diffs) if t == 0 else \
            (1 - t) * _log_a_wor(q, sigma, lo, diffs) + t * _log_a_wor(q, sigma, hi, diffs)
        out.append(log_a / (a - 1))
    return np.array(out)


def epsilon_from_rdp(orders: Sequence[float], rdp: Sequence[float], delta: float) -> float:
    """min over orders a > 1.01 of rdp + log(1 - 1/a) - log(delta a) / (a - 1) (Balle et al. 2020 Prop. 12;
    Canonne et al. 2020 eq. 20); 0 where delta^2 + expm1(-rdp) > 0 (the KL bound); infinite orders left out."""
    best = math.inf
    for a, r in zip(orders, rdp, strict=True):
        if not math.isfinite(r):
            continue
        if r < 0 or delta**2 + math.expm1(-r) > 0:
            best = min(best, 0.0)
        elif a > 1.01:
            best = min(best, r + math.log1p(-1 / a) - math.log(delta * a) / (a - 1))
    return max(0.0, best)


_UNIT_CACHE: dict[tuple, np.ndarray] = {}


def independent_epsilon(*, sigma: float, population: int, sample_size: int, sampling: str, compositions: int,
                        delta: float, orders: Sequence[float] | None = None) -> float:
    """epsilon after ``compositions`` releases of a clipped sum of ``sample_size`` of ``population`` with noise
    multiplier sigma: full participation = the Gaussian; ``poisson`` = Poisson-subsampled; ``fixed`` = without
    replacement, replace-one, whose sensitivity 2C makes the base Gaussian's multiplier sigma / 2."""
    if orders is None:
        orders = ORDERS if sample_size >= population else INTEGER_ORDERS
    key = (sigma, population, sample_size, sampling, tuple(orders))
    if key not in _UNIT_CACHE:
        if sample_size >= population:
            _UNIT_CACHE[key] = rdp_gaussian(sigma, orders)
        elif sampling == "poisson":
            _UNIT_CACHE[key] = rdp_poisson(sample_size / population, sigma, orders)
        else:
            _UNIT_CACHE[key] = rdp_wor(sample_size / population, sigma / 2, orders)
    return epsilon_from_rdp(orders, compositions * _UNIT_CACHE[key], delta)


def relative_error(reported: float, recomputed: float) -> float:
    return 0.0 if reported == recomputed else abs(reported - recomputed) / abs(recomputed)


# -- runs -------------------------------------------------------------------------------------------
def _dp_fields(epsilon: float, mode: str, sampling: str, seed: int, **extra: Any) -> dict:
    """The dp fields of a run at ``epsilon`` (inf: none), with ``extra`` dp fields (dp_clip, adaptive clipping).
    The noise seed is fixed (1000 + the run seed) so that a benchmark run can be repeated; a private run leaves it
    null (fresh entropy). The runs are accounted as a user's are, with the default ``dp_accountant: pld``; the
    epsilon check recomputes that number with a second implementation (:func:`pld_reference`) and the summary's
    ``dp_epsilon_rdp`` with this file's Renyi-DP formulas (:func:`independent_epsilon`)."""
    if math.isinf(epsilon):
        return {}
    return {"dp": mode, "dp_epsilon": epsilon, "dp_sampling": sampling, "dp_noise_seed": 1000 + seed, **extra}


def hospitals_data() -> tuple[list, list]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from hospitals import hospitals

    sites = hospitals()
    return [train for _, train, _ in sites], [test for _, _, test in sites]


def digits_data(clients_per_site: int) -> tuple[list, tuple]:
    """The digits-IH sites (K = 4, seed 0) each dealt over ``clients_per_site`` clients (positives and negatives
    dealt round-robin after a shuffle, so each client gets the site's ratio to within one sample), and the global
    test split."""
    from fdam_ray.config import build_config
    from fdam_ray.data import make_source

    source = make_source(build_config({"dataset": "digits", "num_clients": 4, "partition": "ih", "seed": 0}))
    rng = np.random.default_rng(0)
    clients = []
    for k in range(4):
        train = source.client_shard(k).train
        x, y = train.x.numpy(), train.y.numpy()[:, 0]
        order = np.concatenate([rng.permutation(np.flatnonzero(y == 1)), rng.permutation(np.flatnonzero(y != 1))])
        for j in range(clients_per_site):
            rows = np.sort(order[j::clients_per_site])
            clients.append((x[rows], y[rows]))
    test = source.test_set()
    return clients, (test.x.numpy(), test.y.numpy()[:, 0])


def _train(config: dict, clients: list, test: Any, client_tests: list | None) -> dict:
    import fdam_ray

    result = fdam_ray.train_arrays({**RUN, **config}, clients, test, client_tests=client_tests)
    return {"config": config, "history": result.history, "summary": result.summary,
            "final_auc": result.history[-1]["test_auc"]}


def sample_runs(args) -> list[dict]:
    clients, tests = hospitals_data()
    out = []
    for eps in EPSILONS:
        for seed in args.seeds:
            cfg = {**HOSPITALS, "lr": SAMPLE_LR, "executor": "inline", "seed": seed,
                   **_dp_fields(eps, "sample", "poisson", seed, dp_clip=SAMPLE_CLIP)}
            out.append({"epsilon": eps, "seed": seed, **_train(cfg, clients, None, tests)})
            print(f"  [sample eps {eps:g} seed {seed}] AUC {out[-1]['final_auc']:.4f}", file=sys.stderr, flush=True)
    out[0]["n_train"] = [len(y) for _, y in clients]
    return out


def client_runs(args) -> list[dict]:
    clients, test = digits_data(args.clients_per_site)
    base = {**DIGITS, "iterations": args.client_iterations, "eval_every": args.client_iterations // 4,
            "clients_per_round": args.clients_per_round, "executor": args.client_executor,
            "clients_per_actor": args.clients_per_site}
    out = []
    for eps in EPSILONS:
        for seed in args.seeds:
            cfg = {**base, "seed": seed, **client_dp(eps, seed, num_clients=4 * args.clients_per_site,
                                                     sampled=args.clients_per_round,
                                                     rounds=args.client_iterations // DIGITS["local_steps"])}
            out.append({"epsilon": eps, "seed": seed, **_train(cfg, clients, test, None)})
            print(f"  [client eps {eps:g} seed {seed}] AUC {out[-1]['final_auc']:.4f}", file=sys.stderr, flush=True)
    return out


def client_dp(epsilon: float, seed: int, *, num_clients: int, sampled: int, rounds: int) -> dict:
    """The dp fields of a dp: client run (:data:`CLIENT_DP`), with ``dp_clip_count_noise`` = 2 sigma for the sigma
    the package will solve for ``epsilon`` (Poisson, q = S / K, ``rounds`` compositions)."""
    from fdam_ray.privacy.accountant import solve_sigma

    fields = _dp_fields(epsilon, "client", "poisson", seed, **CLIENT_DP)
    if fields and "dp_clip_quantile" in CLIENT_DP:
        sigma = solve_sigma(epsilon, DELTA, population=num_clients, sample_size=sampled, sampling="poisson",
                            compositions=rounds)
        fields["dp_clip_count_noise"] = 2 * sigma
    return fields


def curve_runs(args) -> list[dict]:
    """dp: client at :data:`CURVE_EPSILON` and dp off against K (``args.curve_k``), S = :data:`CURVE_S`, paired
    seeds ``args.curve_seeds``."""
    import fdam_ray

    out = []
    for k in args.curve_k:
        for eps in (CURVE_EPSILON, math.inf):
            for seed in args.curve_seeds:
                cfg = {**RUN, **CURVE, "num_clients": k, "clients_per_round": min(CURVE_S, k), "seed": seed,
                       **client_dp(eps, seed, num_clients=k, sampled=min(CURVE_S, k),
                                   rounds=CURVE["iterations"] // CURVE["local_steps"])}
                started = time.perf_counter()
                result = fdam_ray.train(cfg, save=False, progress=False)
                out.append({"k": k, "epsilon": eps, "seed": seed, "config": cfg, "summary": result.summary,
                            "history": result.history, "final_auc": result.history[-1]["test_auc"],
                            "s": time.perf_counter() - started})
                print(f"  [curve K {k} eps {eps:g} seed {seed}] AUC {out[-1]['final_auc']:.4f} "
                      f"({out[-1]['s']:.0f} s)", file=sys.stderr, flush=True)
    return out


def curve_drops(runs: list[dict]) -> dict[int, list[float]]:
    """The per-seed drop at :data:`CURVE_EPSILON` from dp off, by K."""
    drops: dict[int, list[float]] = {}
    for k in sorted({r["k"] for r in runs}):
        off = {r["seed"]: r["final_auc"] for r in runs if r["k"] == k and math.isinf(r["epsilon"])}
        on = {r["seed"]: r["final_auc"] for r in runs if r["k"] == k and r["epsilon"] == CURVE_EPSILON}
        drops[k] = [off[s] - on[s] for s in sorted(on)]
    return drops


def k_at_target(drops: dict[int, list[float]]) -> float:
    """The smallest K measured whose mean drop is <= :data:`CURVE_TARGET` (inf: none)."""
    return next((float(k) for k in sorted(drops) if np.mean(drops[k]) <= CURVE_TARGET), math.inf)


def histogram_pairs(args, sample: list[dict]) -> list[dict]:
    """Hospitals runs at seed ``args.seeds[0]``, dp off and epsilon 8, again with ``test_scores: histogram``."""
    clients, tests = hospitals_data()
    pairs = []
    for r in sample:
        if r["seed"] == args.seeds[0] and r["epsilon"] in (8.0, math.inf):
            hist = _train({**r["config"], "test_scores": "histogram"}, clients, None, tests)
            both = list(zip(r["history"], hist["history"], strict=True))
            diffs = [abs(a["test_auc"] - b["test_auc"]) for a, b in both]
            same_state = [repr(a["train_loss"]) == repr(b["train_loss"]) for a, b in both]  # NaN == NaN
            pairs.append({"epsilon": r["epsilon"], "eval0": diffs[0], "later": max(diffs[1:]),
                          "evaluations": len(diffs), "same_train_loss": all(same_state)})
    return pairs


# -- the epsilon check ------------------------------------------------------------------------------
_PLD_CACHE: dict[tuple, tuple[float, str]] = {}


def pld_reference(*, sigma: float, population: int, sample_size: int, compositions: int) -> tuple[float, str]:
    """The exact epsilon from a second implementation, and its name: full participation, the analytic Gaussian
    in 60-digit arithmetic (benchmarks/accountant_check.py); Poisson, the PRV accountant (NaN where it refuses)."""
    import accountant_check as A

    key = (sigma, population, sample_size, compositions)
    if key not in _PLD_CACHE:
        if sample_size >= population:
            _PLD_CACHE[key] = (A.analytic_gaussian_epsilon(sigma, compositions, DELTA), "analytic Gaussian")
        else:
            try:
                _PLD_CACHE[key] = (A.prv_epsilon(sample_size / population, sigma, compositions, DELTA)[1], "PRV")
            except RuntimeError:
                _PLD_CACHE[key] = (math.nan, "PRV (refused)")
    return _PLD_CACHE[key]


def _rows(setting: str, r: dict, who: str, *, sigma: float, population: int, sample_size: int, compositions: int,
          pld: float | None, rdp: float | None) -> list[dict]:
    """The check rows of one accountant: its PLD epsilon (``pld``) against :func:`pld_reference` and its RDP one
    (``rdp``) against :func:`independent_epsilon`."""
    common = {"setting": setting, "target": r["epsilon"], "seed": r["seed"], "who": who, "sigma": sigma,
              "q": sample_size / population, "T": compositions}
    out = []
    if pld is not None:
        ref, name = pld_reference(sigma=sigma, population=population, sample_size=sample_size,
                                  compositions=compositions)
        out.append({**common, "accounting": "pld", "reference": name, "reported": pld, "recomputed": ref})
    if rdp is not None:
        mine = independent_epsilon(sigma=sigma, population=population, sample_size=sample_size, sampling="poisson",
                                   compositions=compositions, delta=DELTA)
        out.append({**common, "accounting": "rdp", "reference": "this file", "reported": rdp, "recomputed": mine})
    return out


def epsilon_checks(sample: list[dict], client: list[dict], args) -> list[dict]:
    """Each dp run's reported epsilons against independent recomputations from the run's sigma, q, compositions
    (steps or rounds it made) and delta: the PLD ones (the last record's per site, the run's) against
    :func:`pld_reference`, the summary's ``dp_epsilon_rdp`` against :func:`independent_epsilon`."""
    rows = []
    n_train = sample[0]["n_train"]
    batch = HOSPITALS["batch_size"]
    for r in sample:
        if math.isinf(r["epsilon"]):
            continue
        last, summary = r["history"][-1], r["summary"]
        sigma, steps = summary["dp_noise_multiplier"], last["iteration"]  # every site runs every step here
        for k, n in enumerate(n_train):
            rows += _rows("sample", r, f"site {k}", sigma=sigma, population=n, sample_size=batch,
                          compositions=steps, pld=last[f"dp_epsilon.{k}"], rdp=None)
        smallest = min(n_train)  # the largest epsilon is the smallest site's (the largest q)
        rows += _rows("sample", r, "run (max site)", sigma=sigma, population=smallest, sample_size=batch,
                      compositions=steps, pld=summary["dp_epsilon"], rdp=summary["dp_epsilon_rdp"])
    for r in client:
        if math.isinf(r["epsilon"]):
            continue
        last, summary = r["history"][-1], r["summary"]
        rows += _rows("client", r, "run", sigma=summary["dp_noise_multiplier"], population=4 * args.clients_per_site,
                      sample_size=args.clients_per_round, compositions=last["round"], pld=summary["dp_epsilon"],
                      rdp=summary["dp_epsilon_rdp"])
    return [{**row, "rel_err": relative_error(row["reported"], row["recomputed"])} for row in rows]


def library_rdp_gap(sigma: float, population: int, sample_size: int) -> dict[str, float]:
    """Where a Poisson epsilon differs: the max relative difference of one release's Renyi DP, the package's
    accountant (dp_accounting) against :func:`rdp_poisson`, at the integer and at the fractional orders."""
    from fdam_ray.privacy.accountant import Accountant

    acc = Accountant(noise_multiplier=sigma, delta=DELTA, population=population, sample_size=sample_size,
                     sampling="poisson", orders=ORDERS)  # the library at every order (runs use the integer ones)
    acc.step(1)
    theirs, gap = acc.rdp(), {"integer": 0.0, "fractional": 0.0}
    for a, x, y in zip(ORDERS, theirs, rdp_poisson(sample_size / population, sigma, ORDERS), strict=True):
        if math.isfinite(x):
            kind = "integer" if float(a).is_integer() else "fractional"
            gap[kind] = max(gap[kind], relative_error(float(x), float(y)))
    gap["excluded"] = float(sum(not math.isfinite(x) for x in theirs))
    return gap


# -- measuring and reporting ------------------------------------------------------------------------
def parse_args(argv: list[str] | None):
    p = C.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--client-iterations", type=int, default=None, help="iterations of a dp: client run")
    p.add_argument("--clients-per-site", type=int, default=None, help="clients each digits-IH site is dealt over")
    p.add_argument("--clients-per-round", type=int, default=None, help="S of dp: client")
    p.add_argument("--client-executor", default=None, choices=("inline", "ray"),
                   help="executor of the dp: client runs (default: ray, --quick: inline)")
    p.add_argument("--curve-k", type=int, nargs="+", default=None,
                   help="K of the dp: client curve (default 128 256 1024 4096, --quick: 128 1024)")
    p.add_argument("--curve-seeds", type=int, nargs="+", default=None, help="paired seeds of the curve (0 1)")
    args = p.parse_args(argv)
    mode = QUICK if args.quick else FULL
    args.seeds = mode["seeds"] if args.seeds is None else args.seeds
    C.check_args(args)
    for name in ("client_iterations", "clients_per_site", "clients_per_round", "client_executor", "curve_k",
                 "curve_seeds"):
        setattr(args, name, mode[name] if getattr(args, name) is None else getattr(args, name))
    if len(args.seeds) < 2:
        p.error("--seeds: at least 2 (the interval over paired seeds)")
    return args


def measure(args) -> dict:
    started = time.perf_counter()
    sample = sample_runs(args)
    client = client_runs(args)
    pairs = histogram_pairs(args, sample)
    curve = curve_runs(args)
    run_s = time.perf_counter() - started
    checks = epsilon_checks(sample, client, args)
    at8 = next(r for r in sample if r["epsilon"] == 8.0)
    gap = library_rdp_gap(at8["summary"]["dp_noise_multiplier"], min(sample[0]["n_train"]), HOSPITALS["batch_size"])
    return {"sample": sample, "client": client, "pairs": pairs, "curve": curve, "checks": checks, "gap": gap,
            "run_s": run_s,
            "check_s": time.perf_counter() - started - run_s}


def _by_seed(runs: list[dict], eps: float) -> dict[int, float]:  # final AUC by seed
    return {r["seed"]: r["final_auc"] for r in runs if r["epsilon"] == eps}


def _interval(values: Sequence[float]) -> str:
    mean, lo, hi = _stats.t_interval(values, LEVEL)
    return f"{mean:.4f} [{lo:.4f}, {hi:.4f}]"


def auc_table(runs: list[dict]) -> tuple[str, dict[float, list[float]]]:
    """Rows per epsilon: sigma, reported epsilon, final AUC and its drop from dp off, each as the mean over the paired
    seeds with its t-interval; and the per-seed drops."""
    off = _by_seed(runs, math.inf)
    rows, drops = [], {}
    for eps in EPSILONS:
        these = [r for r in runs if r["epsilon"] == eps]
        aucs = _by_seed(runs, eps)
        drops[eps] = [off[s] - aucs[s] for s in sorted(aucs)]
        sigma = these[0]["summary"].get("dp_noise_multiplier")
        reported = max(r["summary"].get("dp_epsilon") or 0.0 for r in these) if not math.isinf(eps) else math.inf
        rows.append(["off" if math.isinf(eps) else f"{eps:g}", "-" if sigma is None else f"{sigma:.4g}",
                     "-" if math.isinf(eps) else f"{reported:.4f}", _interval(list(aucs.values())),
                     "-" if math.isinf(eps) else _interval(drops[eps]),
                     " ".join(f"{aucs[s]:.4f}" for s in sorted(aucs))])
    headers = ["epsilon", "sigma", "reported epsilon (max)", "final test AUC", "drop from dp off", "per seed"]
    return C.table(headers, rows), drops


def _client_dp_words() -> str:
    """How the dp: client runs clip, in words."""
    if "dp_clip_quantile" in CLIENT_DP:
        return (f"adaptive clipping (dp_clip_quantile {CLIENT_DP['dp_clip_quantile']}, from dp_clip "
                f"{CLIENT_DP.get('dp_clip', 1)})")
    return f"dp_clip {CLIENT_DP.get('dp_clip', 1)}"


def plot(path: Path, m: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    xs = [1, 4, 8, 32]
    client = f"dp: client, digits-IH (K {4 * args.clients_per_site}, S {args.clients_per_round})"
    for name, runs in (("dp: sample, hospitals (3 sites)", m["sample"]), (client, m["client"])):
        means, errs = [], []
        for eps in EPSILONS:
            mean, lo, hi = _stats.t_interval(list(_by_seed(runs, eps).values()), LEVEL)
            means.append(mean)
            errs.append([mean - lo, hi - mean])
        ax.errorbar(xs, means, yerr=np.array(errs).T, marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, ["1", "4", "8", "off"])
    ax.set_xlabel("epsilon (delta 1e-5)")
    ax.set_ylabel(f"final test AUC (mean, {LEVEL:.0%} t-interval)")
    ax.set_title("Test AUC against the privacy budget (paired seeds)", fontsize=10)
    C.save_figure(fig, ax, path)


def report(args, m: dict, out: Path, command: str) -> str:
    sample_table, sample_drops = auc_table(m["sample"])
    client_table, client_drops = auc_table(m["client"])
    checks, pairs, gap = m["checks"], m["pairs"], m["gap"]
    def worst(setting: str, accounting: str) -> float:
        errs = [c["rel_err"] for c in checks if c["setting"] == setting and c["accounting"] == accounting
                and not math.isnan(c["rel_err"])]
        return max(errs, default=math.nan)

    err = {s: worst(s, "rdp") for s in ("sample", "client")}
    pld_err = {s: worst(s, "pld") for s in ("sample", "client")}
    refused = sum(math.isnan(c["recomputed"]) for c in checks)
    check_rows = [[c["setting"], f"{c['target']:g}", c["seed"], c["who"], c["accounting"], f"{c['sigma']:.6g}",
                   f"{c['q']:.4g}", c["T"], f"{c['reported']:.10g}", f"{c['recomputed']:.10g}", c["reference"],
                   f"{c['rel_err']:.2e}"] for c in checks if c["seed"] == args.seeds[0]]
    curve = m["curve"]
    curve_drop = curve_drops(curve)
    curve_rows = []
    for k, drops in curve_drop.items():
        these = [r for r in curve if r["k"] == k]
        on = [r for r in these if r["epsilon"] == CURVE_EPSILON]
        off = [r for r in these if math.isinf(r["epsilon"])]
        curve_rows.append([k, min(CURVE_S, k), f"{min(CURVE_S, k) / k:.4g}",
                           f"{on[0]['summary']['dp_noise_multiplier']:.4g}",
                           f"{max(r['summary']['dp_epsilon'] for r in on):.4f}",
                           f"{np.mean([r['final_auc'] for r in off]):.4f}",
                           f"{np.mean([r['final_auc'] for r in on]):.4f}", f"{np.mean(drops):.4f}",
                           " ".join(f"{d:.4f}" for d in drops), f"{np.mean([r['s'] for r in these]):.0f}"])
    k_target = k_at_target(curve_drop)
    pair_rows = [["off" if math.isinf(p["epsilon"]) else f"{p['epsilon']:g}", p["evaluations"], f"{p['eval0']:.2e}",
                  f"{p['later']:.2e}", "yes" if p["same_train_loss"] else "NO"] for p in pairs]
    plot(out.with_suffix(".png"), m, args)
    n_train = m["sample"][0]["n_train"]
    n_test = sum(len(y) for _, y in hospitals_data()[1])
    k = 4 * args.clients_per_site
    body = f"""
Paired seeds {' '.join(map(str, args.seeds))} (the same run seeds at every epsilon); intervals are {LEVEL:.0%} \
t-intervals over the seeds (of the mean AUC, and of the per-seed drop from dp off). delta {DELTA:g}. The dp \
noise seed is fixed to 1000 + the run seed so that the table can be reproduced (a private run leaves it null).

## dp: sample, examples/hospitals.py (3 sites)

Training sizes n_k {n_train}, batch {HOSPITALS['batch_size']}, {HOSPITALS['iterations']} iterations of I = \
{HOSPITALS['local_steps']} (every site steps every iteration), model mlp width {HOSPITALS['model_width']}, \
CODASCA, lr {SAMPLE_LR} (/ 3 at {HOSPITALS['stage_length']}), positive_ratio \
{HOSPITALS['positive_ratio']} (public) in every run, dp_sampling poisson, dp_clip {SAMPLE_CLIP}, dp_accountant \
pld. sigma solved by the package from dp_epsilon for the smallest site (the run's epsilon is the largest \
site's). Pooled test AUC of the three sites' test splits ({n_test} patients), executor inline. dp_clip \
{SAMPLE_CLIP} and lr {SAMPLE_LR} are the best of five (dp_clip, lr) pairs tried at epsilon 1 and 4 on seeds 0 \
and 1 (dp_clip 1 / lr 0.1, 0.3 / 0.3, 0.1 / 0.3, 0.1 / 1, and 0.3 / 0.3 at 400 iterations), picked by this \
test AUC: a setting tuned on the reported metric.

{sample_table}

## dp: client, digits-IH: K = {k} clients (4 IH sites x {args.clients_per_site}), S = {args.clients_per_round}

{args.client_iterations} iterations, I = {DIGITS['local_steps']}, batch {DIGITS['batch_size']}, model mlp \
width {DIGITS['model_width']}, CODA+ (no control variates: dp: client refuses them) lr {DIGITS['lr']}, \
positive_ratio {DIGITS['positive_ratio']}, dp_sampling poisson (each client joins a round with probability \
q = S / K, drawn from the privacy secret; the mean divides by S), {_client_dp_words()}, noise at the server, \
dp_accountant pld. Clients hosted {args.clients_per_site} to a host, executor \
{args.client_executor}. Test AUC on digits' global test split (540).

{client_table}

![AUC against epsilon]({out.with_suffix('.png').name})

## dp: client against the number of clients K (synthetic clients)

Synthetic clients (`dataset: synthetic`, {CURVE['samples_per_client']} training samples and at least 100 test \
samples each, {CURVE['num_features']} features, heterogeneity {CURVE['heterogeneity']}), S = {CURVE_S} a round \
whatever K, dp_sampling poisson (q = S / K), {_client_dp_words()}, epsilon {CURVE_EPSILON:g} against dp off, \
{CURVE['iterations']} iterations of I = {CURVE['local_steps']} ({CURVE['iterations'] // CURVE['local_steps']} \
rounds), model mlp width {CURVE['model_width']}, CODA+, lr {CURVE['lr']}, paired seeds \
{' '.join(map(str, args.curve_seeds))}, executor inline. Pooled test AUC of every client's test split. The \
smallest K with a mean drop <= {CURVE_TARGET}: {k_target:g}.

{C.table(['K', 'S', 'q', 'sigma', 'reported epsilon (max)', 'AUC dp off', f'AUC epsilon {CURVE_EPSILON:g}',
          'drop', 'drop per seed', 's a run'], curve_rows)}

## epsilon_rel_err: the reported epsilon against independent recomputations

Every run reports the exact (PLD) epsilon; its summary keeps the Renyi-DP one (`dp_epsilon_rdp`). The PLD \
numbers against a second implementation (the PRV accountant of Gopi, Lee and Wutschitz 2021 for Poisson \
sampling, prv-accountant 0.2.0; {refused} rows it refused): max relative error dp: sample \
{pld_err['sample']:.2e}, dp: client {pld_err['client']:.2e}. The RDP numbers against this file's formulas: max \
relative error over every dp run and seed: dp: sample {err['sample']:.2e}, dp: client {err['client']:.2e}. \
benchmarks/accountant_check.py checks the same accountant over a wider grid. One release's Renyi DP, the \
package's accountant (dp_accounting) against this file, at the epsilon-8 sigma and the smallest site: max \
relative difference {gap['integer']:.1e} at the integer orders, {gap['fractional']:.1e} at the fractional ones \
({gap['excluded']:.0f} orders the library could not compute and left out of its minimum). Rows of seed {args.seeds[0]}:

{C.table(['setting', 'target', 'seed', 'epsilon of', 'accounting', 'sigma', 'q', 'compositions', 'reported',
          'recomputed', 'by', 'rel. error'], check_rows)}

## hist_auc_abs_err: test_scores histogram against exact

Hospitals runs of seed {args.seeds[0]}, again with `test_scores: histogram` (default 4096 bins); max |test \
AUC difference| at evaluation 0 and over the evaluations after it; "same train loss": the two runs trained \
identically.

{C.table(['epsilon', 'evaluations', 'evaluation 0', 'after evaluation 0', 'same train loss'], pair_rows)}

{len(m['sample']) + len(m['client']) + len(pairs) + len(curve)} runs, {m['run_s'] / 60:.1f} min; the independent \
recomputation {m['check_s']:.0f} s.
"""
    C.write_results(out, "What differential privacy costs in test AUC", command, body)
    print(body)
    def mean(xs: Sequence[float]) -> float:
        return float(np.mean(xs))

    def sigma8(runs: list[dict]) -> float:
        return next(r for r in runs if r["epsilon"] == 8.0)["summary"]["dp_noise_multiplier"]

    return C.result_line(
        auc_drop_sample_eps8=mean(sample_drops[8.0]), auc_drop_client_eps8=mean(client_drops[8.0]),
        auc_drop_sample_eps4=mean(sample_drops[4.0]), auc_drop_sample_eps1=mean(sample_drops[1.0]),
        client_k_drop002=k_target, epsilon_rel_err=max(err.values()), pld_rel_err_vs_prv=max(pld_err.values()),
        hist_auc_abs_err=max(max(p["later"], p["eval0"]) for p in pairs),
        hist_auc_abs_err_eval0=max(p["eval0"] for p in pairs), epsilon_rel_err_sample=err["sample"],
        epsilon_rel_err_client=err["client"],
        auc_sample_off=mean(list(_by_seed(m["sample"], math.inf).values())),
        auc_sample_eps8=mean(list(_by_seed(m["sample"], 8.0).values())),
        auc_client_off=mean(list(_by_seed(m["client"], math.inf).values())),
        auc_client_eps8=mean(list(_by_seed(m["client"], 8.0).values())),
        auc_drop_client_eps1=mean(client_drops[1.0]),
        **{f"auc_drop_client_eps8_k{k}": mean(d) for k, d in curve_drop.items()},
        sigma_sample_eps8=sigma8(m["sample"]), sigma_client_eps8=sigma8(m["client"]),
        rdp_rel_err_int_orders=gap["integer"], rdp_rel_err_frac_orders=gap["fractional"])


def main(argv: list[str] | None = None) -> str:
    return C.run_script("privacy.py", argv, parse_args, measure, report)


if __name__ == "__main__":
    main(sys.argv[1:])
