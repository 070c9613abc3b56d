"""The dp config fields: defaults, each refusal in one line naming its field, the resume rule, no dp_accounting."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from fdam_ray.config import FIELD_BY_NAME, RESUME_MAY_CHANGE, SECTIONS, build_config, describe_fields
from fdam_ray.privacy.section import PrivacySection, check_resume
from fdam_ray.settings import sections
from fdam_ray.settings.sections import ConfigError

CLIENT = {"dp": "client", "dp_noise_multiplier": 1.0, "positive_ratio": 0.2, "algorithm": "coda_plus",
          "model": "mlp"}
SAMPLE = {**CLIENT, "dp": "sample", "model": "cnn_gn"}


def test_dp_is_off_by_default_and_a_private_config_builds():
    assert build_config().dp == "off"
    config = build_config(CLIENT)
    section = PrivacySection.of(config)
    assert (section.dp, section.dp_clip, section.dp_delta, section.dp_noise_at, section.dp_sampling) == (
        "client", 1.0, 1e-5, "server", None)
    assert section.sampling == "fixed"  # every client takes part: nothing is sampled
    sample = build_config({"dp": "sample", "dp_epsilon": 4.0, "dp_max_epsilon": 6.0, "positive_ratio": 0.2,
                           "model": "cnn_gn"})
    assert (sample.dp_epsilon, sample.dp_noise_multiplier) == (4.0, None)
    assert build_config({**CLIENT, "clients_per_round": 2, "dp_noise_at": "clients"}).sampled_clients == 2


def test_the_section_is_listed_and_only_the_budget_may_change_on_resume():
    assert SECTIONS["privacy"] == ("dp", "dp_clip", "dp_noise_multiplier", "dp_epsilon", "dp_delta", "dp_max_epsilon",
                                   "dp_noise_at", "dp_sampling", "dp_accountant", "dp_noise_seed", "dp_clip_quantile",
                                   "dp_clip_lr", "dp_clip_count_noise", "test_scores", "test_score_bins", "dp_eval",
                                   "dp_eval_noise", "dp_eval_epsilon")
    assert "dp_noise_multiplier" in describe_fields(["privacy"])
    assert {n for n in SECTIONS["privacy"] if n in RESUME_MAY_CHANGE} == {"dp_max_epsilon", "test_scores",
                                                                          "test_score_bins"}
    assert FIELD_BY_NAME["dp"].choices == ("off", "client", "sample")
    assert FIELD_BY_NAME["dp_accountant"].choices == ("pld", "rdp") and build_config(CLIENT).dp_accountant == "pld"


@pytest.mark.parametrize(("values", "field", "words"), [
    ({"dp_epsilon": 3.0}, "dp_epsilon", "while dp = off"),
    ({"dp_clip": 2.0}, "dp_clip", "while dp = off"),
    ({"dp_noise_at": "clients"}, "dp_noise_at", "while dp = off"),
    ({"dp_noise_seed": 3}, "dp_noise_seed", "while dp = off"),
    ({"dp_accountant": "rdp"}, "dp_accountant", "while dp = off"),
    ({"dp": "client", "positive_ratio": 0.2}, "dp_noise_multiplier", "a target dp_epsilon"),
    ({**CLIENT, "dp_epsilon": 3.0}, "dp_epsilon", "not both"),
    ({"dp": "client", "dp_epsilon": 3.0, "dp_max_epsilon": 2.0}, "dp_max_epsilon", ">= dp_epsilon = 3.0"),
    ({**CLIENT, "dp_noise_multiplier": 0.0, "dp_max_epsilon": 2.0}, "dp_max_epsilon", "infinite"),
    ({**CLIENT, "num_clients": 1}, "num_clients", ">= 2 with dp: client"),
    ({**CLIENT, "client_weighting": "samples"}, "client_weighting", "uniform with dp: client"),
    ({**CLIENT, "clients_per_round": 2, "dp_sampling": "poisson", "dp_noise_at": "clients"}, "dp_sampling",
     "dp_noise_at: clients and clients_per_round < num_clients"),
    ({"dp_sampling": "poisson"}, "dp_sampling", "while dp = off"),
    ({**SAMPLE, "dp_noise_at": "clients"}, "dp_noise_at", "server with dp: sample"),
    ({**SAMPLE, "positive_sampling": "balanced"}, "positive_sampling", "natural with dp: sample"),
    ({**SAMPLE, "precision": "fp16"}, "precision", "fp32 or bf16 with dp: sample"),
    ({**SAMPLE, "model": "cnn"}, "model", "cnn_gn (the cnn with GroupNorm)"),
    ({**CLIENT, "model": "cnn"}, "model", "cnn_gn (the cnn with GroupNorm), mlp, linear"),
    ({**CLIENT, "model": "resnet20"}, "model", "with dp: client"),
    ({**CLIENT, "dp_clip": 1e30}, "dp_clip", "at most 1e+06"),
    ({**SAMPLE, "dp_clip": 2e6}, "dp_clip", "sigma x dp_clip"),
    ({**SAMPLE, "model": "resnet20"}, "model", "resnet20 has BatchNorm"),
    ({**SAMPLE, "model": "densenet121"}, "model", "densenet121 has BatchNorm"),
    ({**SAMPLE, "model": "densenet161"}, "model", "densenet161 has BatchNorm"),
    ({**SAMPLE, "batch_size": "full", "dp_sampling": "poisson"}, "dp_sampling", "no amplification"),
    ({**SAMPLE, "batch_size": 0, "dp_sampling": "poisson"}, "dp_sampling", "accounted as the full batch"),
    ({**CLIENT, "algorithm": "coda"}, "algorithm", "un-noised score sums"),
    ({**CLIENT, "pretrain_iterations": 50}, "pretrain_iterations", "without privacy noise"),
    ({**CLIENT, "dp_clip": 0.0}, "dp_clip", "> 0"),
    ({**CLIENT, "dp_delta": 1.0}, "dp_delta", "in (0, 1)"),
    ({**CLIENT, "dp_noise_multiplier": -1.0}, "dp_noise_multiplier", ">= 0"),
    ({"dp": "everything"}, "dp", "off, client, sample"),
])
def test_each_refusal_is_one_line_naming_its_field(values, field, words):
    with pytest.raises(ConfigError) as caught:
        build_config(values)
    message = str(caught.value)
    assert "\n" not in message and f"'{field}'" in message and words in message


def test_a_budget_below_the_first_rounds_epsilon_is_refused_with_that_epsilon():
    # every client takes part: one round is the Gaussian mechanism of sigma (sensitivity 1), whose exact epsilon is
    # the analytic Gaussian's (Balle and Wang 2018), recomputed here with scipy
    from scipy.optimize import brentq
    from scipy.stats import norm

    def delta(eps: float, s: float = 1.0) -> float:
        return norm.cdf(1 / (2 * s) - eps * s) - np.exp(eps) * norm.cdf(-1 / (2 * s) - eps * s) - 1e-5

    first = brentq(delta, 1e-9, 200, xtol=1e-14, rtol=1e-14)
    assert build_config({**CLIENT, "dp_max_epsilon": first * 1.001}).dp_max_epsilon == first * 1.001
    with pytest.raises(ConfigError) as caught:
        build_config({**CLIENT, "dp_max_epsilon": first * 0.999})
    message = str(caught.value)
    assert "\n" not in message and "'dp_max_epsilon'" in message and f">= {first:.4g}, the epsilon of the first round" \
        in message
    # 2 of 4 clients drawn by Poisson (the null default with the noise at the server) spend less in a round
    assert build_config({**CLIENT, "clients_per_round": 2, "dp_max_epsilon": first * 0.999}).sampling == "poisson"


def test_poisson_accounting_is_allowed_when_every_client_takes_part():
    assert build_config({**CLIENT, "dp_sampling": "poisson"}).dp_sampling == "poisson"
    assert build_config({**SAMPLE, "dp_sampling": "poisson", "clients_per_round": 2}).dp == "sample"


def test_dp_sample_takes_what_its_step_and_accountant_describe():
    """No refusal: networks without BatchNorm (a user's factory is checked at client start), bf16, the full batch
    with fixed sampling (q = 1, accounted as the full batch), and every refused value with dp: client or off."""
    for model in ("cnn_gn", "mlp", "linear", "own_fixtures:same_as_linear"):
        assert build_config({**SAMPLE, "model": model}).model == model
    assert build_config({**SAMPLE, "precision": "bf16"}).precision == "bf16"
    assert build_config({**SAMPLE, "batch_size": "full"}).batch_size == 0
    assert build_config({**SAMPLE, "batch_size": "full", "dp_sampling": "fixed"}).dp_sampling == "fixed"
    for values in ({"precision": "fp16"}, {"positive_sampling": "balanced"}):
        assert build_config({**CLIENT, "model": "mlp", **values})
        assert build_config(values)
    assert build_config({"model": "cnn"})  # dp off: BatchNorm is the default job's


def test_no_noise_is_said_on_the_console_and_noise_above_the_sum_is_named(caplog, monkeypatch):
    monkeypatch.setattr(sections, "_WARNED", set())
    with caplog.at_level("WARNING", logger="fdam_ray.privacy.section"):
        build_config({**CLIENT, "dp_noise_multiplier": 0.0})
    assert any("no privacy" in r.getMessage() and "dp_noise_multiplier 0" in r.getMessage() for r in caplog.records)
    client = PrivacySection.of(build_config({**CLIENT, "num_clients": 8, "clients_per_round": 4}))
    assert client.only_noise(4.0) is None  # sigma C at most the largest sum S C
    line = client.only_noise(414815.0)
    assert "above the 4 clients a round" in line and "raise dp_epsilon or clients_per_round" in line
    sample = PrivacySection.of(build_config({**SAMPLE, "batch_size": 16}))
    assert sample.only_noise(16.0) is None and "16 samples a batch" in sample.only_noise(16.5)
    assert PrivacySection.of(build_config({**SAMPLE, "batch_size": "full"})).only_noise(1e6) is None


def test_a_null_positive_ratio_is_named_once_as_an_uncounted_release(caplog, monkeypatch):
    monkeypatch.setattr(sections, "_WARNED", set())  # named once per process: forget earlier tests' configs
    with caplog.at_level("WARNING", logger="fdam_ray.privacy.section"):
        build_config({"dp": "client", "model": "mlp", "dp_noise_multiplier": 1.0, "algorithm": "coda_plus"})
    assert [r.getMessage() for r in caplog.records if "positive_ratio" in r.getMessage()]


def _section(**changes) -> PrivacySection:
    return PrivacySection.of(build_config({**CLIENT, "dp_max_epsilon": 15.0, **changes}))  # a round: 4.4 to 10.1


@pytest.mark.parametrize(("change", "field"), [
    ({"dp": "sample", "model": "cnn_gn"}, "dp"),
    ({"dp_clip": 0.5}, "dp_clip"),
    ({"dp_noise_multiplier": 1.5}, "dp_noise_multiplier"),
    ({"dp_delta": 1e-6}, "dp_delta"),
    ({"clients_per_round": 2, "dp_noise_at": "clients"}, "dp_noise_at"),
    ({"dp_accountant": "rdp"}, "dp_accountant"),
    ({"dp_max_epsilon": 14.0}, "dp_max_epsilon"),
    ({"dp_max_epsilon": None}, "dp_max_epsilon"),
])
def test_a_resume_keeps_the_privacy_it_started_with(change, field):
    with pytest.raises(ConfigError) as caught:
        check_resume(_section(), _section(**change))
    assert "\n" not in str(caught.value) and f"'{field}'" in str(caught.value)


def test_a_resume_may_raise_or_set_the_budget():
    check_resume(_section(), _section(dp_max_epsilon=18.0))
    check_resume(_section(), _section())
    unset = dataclasses.replace(_section(), dp_max_epsilon=None)
    check_resume(unset, _section())
    off = PrivacySection.of(build_config())
    check_resume(off, off)
    with pytest.raises(ConfigError, match="'dp'"):
        check_resume(off, _section())


def test_the_package_and_its_config_work_without_dp_accounting():
    code = ("import sys; sys.modules['dp_accounting'] = None\n"
            "import fdam_ray.privacy as p\n"
            "from fdam_ray.privacy.section import PrivacySection\n"
            "PrivacySection(dp='client', dp_noise_multiplier=1.0, num_clients=4, clients_per_round=None,\n"
            "               client_weighting='uniform', algorithm='coda_plus', positive_ratio=0.2,\n"
            "               pretrain_iterations=0, batch_size=32, positive_sampling='natural',\n"
            "               precision='fp32', model='mlp').check()\n"
            "try:\n"
            "    p.Accountant(noise_multiplier=1.0, delta=1e-5, population=4, sample_size=4)\n"
            "except p.AccountingUnavailable as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.count("\n") == 1 and "fdam-ray's 'privacy' extra" in out.stdout


def test_client_level_dp_refuses_every_preset_with_control_variates_and_only_those():
    from fdam_ray.algorithms.presets import PRESETS
    from fdam_ray.privacy.section import CONTROL_VARIATE_PRESETS

    assert set(CONTROL_VARIATE_PRESETS) == {n for n, p in PRESETS.items() if p.drift == "control_variates"}
    for name in CONTROL_VARIATE_PRESETS:
        with pytest.raises(ConfigError, match=rf"^config field 'algorithm': '{name}' is not allowed \(a preset "
                                              "without control variates with dp = client, e.g. coda_plus"):
            build_config({**CLIENT, "algorithm": name})
        assert build_config({"dp": "sample", "dp_noise_multiplier": 1.0, "algorithm": name,
                             "model": "cnn_gn"}).algorithm == name
    assert build_config({**CLIENT, "algorithm": "coda_plus"}).algorithm == "coda_plus"
