"""The reported epsilon against two implementations outside the package: every event the accountant counts.

- Full participation (the Gaussian mechanism composed T times): the package's ``pld`` accounting against this
  script's own analytic Gaussian (Balle and Wang 2018, Thm. 8): delta(eps) = Phi(mu/2 - eps/mu) - e^eps
  Phi(-mu/2 - eps/mu) with mu = sqrt(T) / sigma, solved for eps by bisection in 60-digit arithmetic (mpmath; no
  code shared with fdam_ray/privacy/pld.py, which solves in logs). Target: relative error <= 1e-6.
- The Poisson-subsampled Gaussian (``dp: sample`` batches, and ``dp: client`` with ``dp_sampling: poisson``): the
  package's PLD (dp_accounting) against the PRV accountant of Gopi, Lee and Wutschitz (2021), the package
  ``prv-accountant`` (the accountant Opacus's ``prv`` wraps), asked for an error of 1e-3 in epsilon (1e-2 where
  its discretisation refuses the finer grid; the table says which). Target: within 1% of PRV's estimate and
  inside its [lower, upper] band widened by 1%, wherever PRV computes one (prv-accountant 0.2.0 refuses some
  large-epsilon events at every error asked, "Discrete mean differs from continuous mean": counted in
  ``prv_refused`` and shown in the table).

The grid holds the settings the benchmarks and the privacy guide use (the hospitals study's DP-SGD steps, the
K = 256 .. 4,096 client curves at q = S / K) and the extremes around them.

    pip install prv-accountant==0.2.0          # the second implementation (the `bench` extra has it)
    python benchmarks/accountant_check.py

Last line: ``RESULT gaussian_rel_err=... poisson_prv_rel_err=... poisson_outside_band=N prv_refused=N cases=N``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _common as C

from fdam_ray.privacy.accountant import Accountant

DELTA = 1e-5
# (sigma, T): full participation
GAUSSIAN = [(0.5, 1), (1.0, 1), (1.0, 40), (2.0, 100), (2.49, 400), (5.0, 1000), (0.8, 2000), (20.0, 10)]
# (q, sigma, T): Poisson subsampling; q = B / n_k (the hospitals study's steps) or S / K (client curves)
POISSON = [(0.1, 1.5, 200), (0.01, 1.0, 1000), (0.02, 1.1, 4000), (0.05, 0.9, 800), (32 / 256, 1.41, 100),
           (32 / 1024, 1.0, 200), (32 / 4096, 0.8, 400), (16 / 120, 1.2, 800), (0.25, 3.0, 50)]


def analytic_gaussian_epsilon(sigma: float, compositions: int, delta: float) -> float:
    """epsilon of T Gaussian mechanisms of noise multiplier sigma (sensitivity 1): the root of delta(eps) = delta,
    bisected in 60-digit arithmetic (mpmath), so nothing cancels or overflows; the script's own, independent of the
    package's log-space solve."""
    import mpmath

    mpmath.mp.dps = 60
    mu = mpmath.sqrt(compositions) / mpmath.mpf(sigma)
    target = mpmath.mpf(delta)

    def delta_of(eps):
        return mpmath.ncdf(mu / 2 - eps / mu) - mpmath.exp(eps) * mpmath.ncdf(-mu / 2 - eps / mu)

    if delta_of(mpmath.mpf(0)) <= target:
        return 0.0
    lo, hi = mpmath.mpf(0), mpmath.mpf(1)
    while delta_of(hi) > target:
        lo, hi = hi, hi * 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if delta_of(mid) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= mpmath.mpf(10) ** -30 * hi:
            break
    return float((lo + hi) / 2)


def prv_epsilon(q: float, sigma: float, compositions: int, delta: float) -> tuple[float, float, float, float]:
    """(lower, estimate, upper, eps_error) of the PRV accountant for T Poisson-subsampled Gaussians: asked for an
    error of 1e-3 in epsilon, and 1e-2 where its discretisation refuses the finer grid (it checks its own mean)."""
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    prv = PoissonSubsampledGaussianMechanism(noise_multiplier=sigma, sampling_probability=q)
    for eps_error in (1e-3, 1e-2):
        try:
            accountant = PRVAccountant(prvs=[prv], max_self_compositions=[compositions], eps_error=eps_error,
                                       delta_error=1e-10)
        except RuntimeError:  # "Discrete mean differs from continuous mean significantly."
            continue
        low, est, up = accountant.compute_epsilon(delta=delta, num_self_compositions=[compositions])
        return float(low), float(est), float(up), eps_error
    raise RuntimeError(f"the PRV accountant refuses q {q:g}, sigma {sigma:g}, T {compositions}")


def package_epsilon(sigma: float, compositions: int, *, population: int, sample_size: int) -> float:
    """The package's epsilon (``dp_accountant: pld``) of ``compositions`` releases, as a run counts them."""
    sampling = "poisson" if sample_size < population else "fixed"
    accountant = Accountant(noise_multiplier=sigma, delta=DELTA, population=population, sample_size=sample_size,
                            sampling=sampling, accounting="pld")
    accountant.step(1, compositions=compositions)
    return accountant.epsilon()


def _population(q: float) -> tuple[int, int]:
    """(n, s) with s / n = q exactly where q is a ratio of small integers (the grid's are)."""
    from fractions import Fraction

    f = Fraction(q).limit_denominator(100_000)
    return f.denominator, f.numerator


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/accountant_check.md",
                        help="where the table is written (none: --out '')")
    args = parser.parse_args(argv)
    try:
        import prv_accountant  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/accountant_check.py needs the second implementation: pip install "
                 "prv-accountant==0.2.0 (or pip install -e '.[bench]')")
    rows = ["| event | q | sigma | T | fdam-ray (pld) | independent | rel. error | reference |",
            "|---|---|---|---|---|---|---|---|"]
    gauss_err = 0.0
    for sigma, t in GAUSSIAN:
        ours = package_epsilon(sigma, t, population=1, sample_size=1)
        ref = analytic_gaussian_epsilon(sigma, t, DELTA)
        err = abs(ours - ref) / ref
        gauss_err = max(gauss_err, err)
        print(f"gaussian sigma {sigma:g} T {t}: pld {ours:.9g} analytic {ref:.9g} rel {err:.1e}")
        rows.append(f"| Gaussian | 1 | {sigma:g} | {t} | {ours:.7g} | {ref:.7g} | {err:.1e} | analytic Gaussian |")
    prv_err, outside, refusals = 0.0, 0, 0
    for q, sigma, t in POISSON:
        n, s = _population(q)
        ours = package_epsilon(sigma, t, population=n, sample_size=s)
        try:
            low, est, up, asked = prv_epsilon(s / n, sigma, t, DELTA)
        except RuntimeError as refused:
            refusals += 1
            print(f"poisson q {s}/{n} sigma {sigma:g} T {t}: pld {ours:.6g}; {refused}")
            rows.append(f"| Poisson | {s}/{n} | {sigma:g} | {t} | {ours:.6g} | (PRV refuses it) | - | PRV |")
            continue
        err = abs(ours - est) / est
        prv_err = max(prv_err, err)
        inside = low * 0.99 <= ours <= up * 1.01
        outside += not inside
        print(f"poisson q {s}/{n} sigma {sigma:g} T {t}: pld {ours:.6g} prv {est:.6g} [{low:.6g}, {up:.6g}] "
              f"rel {err:.2e}{'' if inside else ' OUTSIDE'}")
        rows.append(f"| Poisson | {s}/{n} | {sigma:g} | {t} | {ours:.6g} | {est:.6g} [{low:.5g}, {up:.5g}] | "
                    f"{err:.2e} | PRV (error {asked:g}) |")
    line = C.result_line(gaussian_rel_err=f"{gauss_err:.2e}", poisson_prv_rel_err=f"{prv_err:.2e}",
                         poisson_outside_band=outside, prv_refused=refusals, cases=len(GAUSSIAN) + len(POISSON))
    if args.out:
        command = C.command_line("accountant_check.py", argv if argv is not None else sys.argv[1:])
        C.write_results(Path(args.out), "The reported epsilon against independent accountants", command,
                        f"delta = {DELTA:g}; add-or-remove-one neighbours.\n\n" + "\n".join(rows) + f"\n\n{line}")
    print(line)
    return line


if __name__ == "__main__":
    main()
