"""Names in messages are the names the user wrote: a YAML alias, anchor or merge key on a field names that field
once (never a name glued from a field and a key, such as ``model_width_width``), and a name rule says in words
exactly what it checks (``client_names``: ASCII letters, one line each; ``run_name``: no control characters)."""

from __future__ import annotations

import re

import pytest

from fdam_ray.config import ConfigError, build_config, load_config_file, parse_overrides
from fdam_ray.features.sites import NAME_ALLOWED, is_site_name
from fdam_ray.settings.yamlio import load_yaml


def _error_of(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        build_config(load_config_file(str(path)))
    message = str(caught.value)
    assert "\n" not in message
    return message


# -- aliases, anchors and merge keys --------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "model_width: &w {width: 16}\n",                                  # an anchored mapping on the field itself
    "model: &m {name: mlp, width: 16}\nmodel_width: *m\n",            # an alias of a section on a field
    "model: mlp\nmodel_width: {name: 16, width: 16}\n",              # the section form, on a field
])
def test_a_mapping_given_to_a_field_names_that_field_once(tmp_path, text):
    message = _error_of(tmp_path, text)
    assert message.startswith("config field 'model_width': ") and "an integer >= 1" in message, message
    assert message.count("model_width") == 1 and "model_width_" not in message, message


def test_the_section_forms_that_worked_still_work():
    config = build_config(load_yaml("model: {name: cnn, width: 16}\ndataset: {name: synthetic}\nlr: {decay: 2}\n"))
    assert (config.model, config.model_width, config.dataset, config.lr_decay) == ("cnn", 16, "synthetic", 2)
    config = build_config(parse_overrides(["model_width.name=9", "model.name=mlp"]))
    assert (config.model, config.model_width) == ("mlp", 9)
    assert build_config(parse_overrides(["model.width=8"])).model_width == 8
    with pytest.raises(ConfigError, match=r"^config field 'model_width' is given twice on the command line "
                                          r"\(model\.width=8, model_width\.name=9\): give it once$"):
        parse_overrides(["model.width=8", "model_width.name=9"])  # two spellings of one field: not the last wins


@pytest.mark.parametrize("key", ["model_width.width", "lr_decay.x", "seed.name.x"])
def test_a_dotted_key_under_a_field_names_the_field_and_the_key_once(key):
    with pytest.raises(ConfigError) as caught:
        build_config(parse_overrides([f"{key}=3"]))
    message = str(caught.value)
    field = key.partition(".")[0]
    assert f"'{key}'" in message and f"'{field}' is a field, not a section" in message, message
    assert f"{field}_" not in message and "\n" not in message, message


def test_a_merge_key_is_read_as_yaml_defines_it():
    data = load_yaml("model:\n  <<: {name: mlp, width: 8}\n  width: 12\nlr: 0.05\n<<: {lr: 0.2, seed: 3}\n")
    assert data == {"model": {"name": "mlp", "width": 12}, "lr": 0.05, "seed": 3}  # own keys win over merged
    config = build_config(data)
    assert (config.model, config.model_width, config.lr, config.seed) == ("mlp", 12, 0.05, 3)


@pytest.mark.parametrize("text, start", [
    ("<<: {model_width: abc}\n", "config field 'model_width': 'abc' is not allowed"),
    ("model: {<<: {width: abc}, name: mlp}\n", "config field 'model_width': 'abc' is not allowed"),
    ("model: &m {name: mlp, width: 8}\nmodel_weights: *m\n", "config field 'model_weights': {"),
    ("x: &x {width: abc}\nmodel: {<<: *x, name: mlp}\n", "unknown config field 'x_width' (key 'width' under 'x',"),
])
def test_a_merge_key_or_alias_error_names_the_real_field_once(tmp_path, text, start):
    message = _error_of(tmp_path, text)
    assert "merge" not in message and "constructor" not in message, message  # not PyYAML's words
    assert message.startswith(start), message
    field = start.split("'")[1]
    assert message.count(field) == 1 and f"{field}_" not in message, message


def test_a_key_given_twice_beside_a_merge_key_is_still_an_error(tmp_path):
    message = _error_of(tmp_path, "<<: {lr: 0.2}\nlr: 0.1\nlr: 0.3\n")
    assert "key 'lr' is given twice (again on line 3)" in message, message


def test_a_key_of_a_section_that_is_a_field_of_its_own_says_where_it_belongs(tmp_path):
    message = _error_of(tmp_path, "model: {name: mlp, model_width: 16}\n")
    assert "'model_width' under 'model'" in message and "model_model" not in message, message
    message = _error_of(tmp_path, "model: {name: mlp, widht: 16}\n")
    assert "'widht' under 'model'" in message and "did you mean 'model_width'" in message, message


# -- client_names: the rule and its words ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["Zürich", "Ελλάδα", "site\u00a0a", "٣", "ｓｉｔｅ", "site\n", "a" * 64 + "\n",
                                  "\nsite"])
def test_a_client_name_outside_the_rule_is_refused_by_the_words_that_state_it(name):
    assert not is_site_name(name)
    with pytest.raises(ConfigError, match=r"^config field 'client_names': ") as caught:
        build_config(num_clients=2, client_names=[name, "b"])
    message = str(caught.value)
    assert "ASCII letters" in message and "\n" not in message, message


def test_the_client_name_rule_says_ascii_and_takes_what_it_says():
    assert "ASCII letters" in NAME_ALLOWED and "A-Z" in NAME_ALLOWED
    for name in ("siteA", "north-1", "h.2_b", "0", "Z" * 64):
        assert is_site_name(name), name
    for name in ("", "_a", "-a", ".a", "a b", "a/b", "Z" * 65):
        assert not is_site_name(name), name


def test_the_refused_client_name_is_the_one_named():
    names = [f"site{k}" for k in range(40)] + ["Zürich"]
    with pytest.raises(ConfigError) as caught:
        build_config(num_clients=41, client_names=names)
    assert "'Zürich'" in str(caught.value), str(caught.value)


# -- run_name: "no control characters" means every one -------------------------------------------------------------

@pytest.mark.parametrize("name", ["run\x85x", "run\x9b", "a\u2028b", "a\u2029b"])
def test_a_run_name_with_any_control_character_or_line_break_is_refused(name):
    with pytest.raises(ConfigError, match=re.escape("config field 'run_name'")) as caught:
        build_config(run_name=name)
    assert "control characters" in str(caught.value)
    assert len(str(caught.value).splitlines()) == 1
