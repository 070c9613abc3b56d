"""``flower.site_keys`` names sites of the study, each bound to a key of its own (fdam_ray.executors.flower_section,
checked by build_config and by the Flower server)."""

from __future__ import annotations

import pytest

from fdam_ray.config import ConfigError, build_config
from fdam_ray.executors.flower_section import split_config

A, B = "SHA256:" + "A" * 43, "SHA256:" + "B" * 43


def test_one_fingerprint_for_two_sites_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"^config field 'flower\.site_keys': .* is not allowed \(.*one key per "
                                          r"site.*sites 1 and 3.*\)$"):
        split_config({"flower": {"site_keys": {"1": A, "3": " " + A}}})
    assert split_config({"flower": {"site_keys": {"1": A, "3": B}}})[1].site_keys == {1: A, 3: B}


@pytest.mark.parametrize("site", [4, 99])
def test_a_site_outside_the_study_is_refused_naming_it_and_k(site):
    values = {"num_clients": 4, "flower": {"site_keys": {str(site): A}}}
    with pytest.raises(ConfigError, match=rf"^config field 'flower\.site_keys': .*{site}.* is not allowed "
                                          r"\(.*0 \.\. 3.*num_clients = 4.*\)$"):
        build_config(values)
    fields, section = split_config(values)
    with pytest.raises(ConfigError, match="num_clients = 4"):
        section.check_sites(build_config(fields).num_clients)


def test_sites_of_the_study_are_fine():
    build_config({"num_clients": 4, "flower": {"site_keys": {"0": A, "3": B}}})
    split_config({"flower": {"site_keys": {"3": A}}})[1].check_sites(4)
