"""Differential privacy (docs/algorithms.md s.9): the config section, the Gaussian mechanism, the accountant.

``section`` holds the ``dp`` fields and their rules; ``mechanisms`` clips and
noises vectors in NumPy; ``accountant`` counts epsilon with dp_accounting's
Renyi-DP accountant. Importing this package, and every config, works without
dp_accounting (the ``privacy`` extra): only building an
:class:`~fdam_ray.privacy.accountant.Accountant` needs it.
"""

from __future__ import annotations

from fdam_ray.privacy.accountant import Accountant, AccountingUnavailable, shares_noise_multiplier, solve_sigma
from fdam_ray.privacy.mechanisms import clip_to_norm, gaussian_noise, noise_generator, noise_share_std, noise_std
from fdam_ray.privacy.section import PrivacySection, check_resume

__all__ = ["Accountant", "AccountingUnavailable", "PrivacySection", "check_resume", "clip_to_norm",
           "gaussian_noise", "noise_generator", "noise_share_std", "noise_std", "shares_noise_multiplier",
           "solve_sigma"]
