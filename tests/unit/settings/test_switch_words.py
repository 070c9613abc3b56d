"""A bare off/on in a YAML file or a key=value (YAML 1.1 reads them as false/true) names the choice it spells."""

import pytest

from fdam_ray.config import build_config
from fdam_ray.settings.yamlio import load_yaml


def test_off_and_on_read_as_the_choices_they_spell():
    values = load_yaml("dp: off\ndp_eval: on\ntest_scores: histogram\ndp_eval_noise: 2.0\n")
    assert values["dp"] is False and values["dp_eval"] is True  # what the YAML reader gives
    config = build_config(values)
    assert (config.dp, config.dp_eval) == ("off", "on")


def test_a_true_or_false_where_no_choice_is_on_or_off_is_still_refused():
    with pytest.raises(ValueError, match=r"'dp'.*one of off, client, sample"):
        build_config(load_yaml("dp: on"))  # dp has no 'on': True stays an error naming the field
    with pytest.raises(ValueError, match="'algorithm'"):
        build_config({"algorithm": False})
