"""Config from typed sections: each field declared once, Config seen whole by a type checker, the table and the
CLI generated from the sections, each section's own rules, and a client that receives only what it reads."""

from __future__ import annotations

import dataclasses
import pickle
import types
import typing

import numpy as np
import pytest
import yaml

from fdam_ray.algorithms import AlgorithmSection, build_algorithm
from fdam_ray.clients.client import Client, ClientSection, resolve_device
from fdam_ray.config import (
    FIELD_BY_NAME,
    FIELDS,
    RESUME_MAY_CHANGE,
    SECTION_CLASSES,
    SECTIONS,
    Config,
    ConfigError,
    build_config,
    load_yaml,
)
from fdam_ray.core.state import RoundPlan
from fdam_ray.data import DataSection
from fdam_ray.data.digits import DigitsSource
from fdam_ray.executors.base import ExecutorSection
from fdam_ray.executors.ray_section import RayExecutorSection, RaySection
from fdam_ray.settings.coercion import COERCERS
from fdam_ray.settings.sections import SETTING, Section, owned_fields, setting, shared, shared_names

# What only the driver's server step reads: never on a client.
SERVER_ONLY = {"global_lr", "reference_point", "reset_control_variates", "clients_per_round", "positive_ratio",
               "num_clients"}


def own(cls: type) -> set[str]:
    return {f.name for f in owned_fields(cls)}


def test_the_section_an_actor_receives_has_no_server_executor_or_ray_field():
    names = {f.name for f in dataclasses.fields(ClientSection)}
    assert not names & SERVER_ONLY
    assert not names & own(RaySection) and not names & own(ExecutorSection)
    assert not names & (own(SECTION_CLASSES[1]) | {"out_dir", "trackers", "eval_every", "dataset"})  # schedule, ...
    section = ClientSection.of(build_config(address="auto", global_lr=2.0, transport="compiled"))
    blob = pickle.dumps(section)  # what travels to a Ray actor
    for name in ("global_lr", "address", "transport", "cpus_per_actor", "reference_point", "out_dir"):
        assert name.encode() not in blob, name
    assert b"batch_size" in blob


def test_algorithm_client_and_executor_sections_do_not_inherit_from_each_other():
    for cls in (AlgorithmSection, ClientSection, ExecutorSection, RaySection):
        assert cls.__mro__ == (cls, Section, object), cls
    assert issubclass(RayExecutorSection, ExecutorSection) and issubclass(RayExecutorSection, RaySection)


def test_a_client_built_from_its_section_alone_runs_the_round_a_full_config_runs():
    cfg = build_config(model="mlp", model_width=8, batch_size=16, num_clients=2, algorithm="codasca",
                       global_lr=1.7, prox_weight=0.01, grad_clip=0.5, executor="inline")
    source = DigitsSource(DataSection.of(cfg))
    cpu = resolve_device("cpu")

    def one_round(config):
        client = Client(config, source, 1, device=cpu)
        state = client.flat.initial_state()
        state.c_v, state.c_alpha = np.zeros_like(state.v), np.zeros_like(state.alpha)
        client.configure(np.array([0.1]))
        client.begin_stage(state.v.copy(), True)
        return client.local_round(state, RoundPlan(1, 1, 3, 0.05, 0))

    narrow, full = one_round(ClientSection.of(cfg)), one_round(cfg)
    for name in ("v", "alpha", "buffers", "counters", "c_v", "c_alpha"):
        np.testing.assert_array_equal(getattr(narrow, name), getattr(full, name), err_msg=name)
    narrow_algorithm, full_algorithm = build_algorithm(ClientSection.of(cfg)), build_algorithm(
        AlgorithmSection.of(cfg))
    for name in ("preset", "objective_name", "margin", "prox_weight", "weight_decay", "grad_clip", "client_weighting"):
        assert getattr(narrow_algorithm, name) == getattr(full_algorithm, name), name  # all a client's solver reads
    assert (narrow_algorithm.prox_weight, narrow_algorithm.grad_clip, narrow_algorithm.control_variates) == (
        0.01, 0.5, True)


def test_each_field_is_declared_once_and_sections_group_fdam_fields():
    declared = [f.name for cls in SECTION_CLASSES for f in owned_fields(cls)]
    assert declared == [f.name for f in FIELDS] and len(set(declared)) == len(declared) == 129
    assert {f.name for f in dataclasses.fields(Config)} == set(declared)
    for cls in SECTION_CLASSES:
        assert SECTIONS[cls.name] == tuple(f.name for f in owned_fields(cls))
        for name in shared_names(cls):  # a shared field is owned elsewhere, with the same type
            owner = next(c for c in SECTION_CLASSES if name in own(c))
            assert typing.get_type_hints(cls)[name] == typing.get_type_hints(owner)[name], (cls, name)
    assert {f.kind for f in FIELDS} <= set(COERCERS)
    hints = typing.get_type_hints(Config)
    assert all(f.name in hints for f in FIELDS)  # a type checker sees every field
    assert "lr" in RESUME_MAY_CHANGE or "iterations" in RESUME_MAY_CHANGE
    assert "lr" not in RESUME_MAY_CHANGE and "seed" not in RESUME_MAY_CHANGE and "reduce" in RESUME_MAY_CHANGE


def test_a_new_field_is_one_line_in_one_section():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extra(Section):
        name = "extra"
        warmup: int = setting(0, "Warm-up rounds.", check=(lambda v: v >= 0, ">= 0"), resume=True)
        lr: float = shared()

    (field,) = owned_fields(Extra)
    meta = field.metadata[SETTING]
    assert (field.name, field.default, meta.doc, meta.allowed, meta.resume) == ("warmup", 0, "Warm-up rounds.",
                                                                                ">= 0", True)
    assert meta.check(0) and not meta.check(-1)
    assert shared_names(Extra) == ["lr"]
    assert Extra.of(types.SimpleNamespace(warmup=3, lr=0.2, seed=1)) == Extra(warmup=3, lr=0.2)


def test_config_round_trips_through_dict_yaml_pickle_and_replace():
    cfg = build_config(algorithm="coda_plus", lr=0.05, chestxray_sources="nih,chexpert", trackers=(),
                       client_resources=[{"a": 1}] * 4, positive_classes=[1, 2])
    data = cfg.to_dict()
    assert list(data) == [f.name for f in FIELDS]
    assert build_config(data) == cfg
    assert build_config(load_yaml(yaml.safe_dump(data, sort_keys=True))) == cfg
    assert build_config(dict(reversed(list(data.items())))) == cfg  # saved configs of any field order load
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    changed = cfg.replace(lr=0.2)
    assert isinstance(changed, Config) and changed.lr == 0.2 and changed.replace(lr=0.05) == cfg
    with pytest.raises(ConfigError, match=r"config field 'lr': -1\.0 is not allowed"):
        cfg.replace(lr=-1.0)


@pytest.mark.parametrize("values, message", [
    (dict(algorithm="fedavg", objective="auc_square"), "config field 'objective': 'auc_square' is not allowed "
                                                       r"\(algorithm 'fedavg' takes one of bce\)"),
    (dict(num_clients=2, clients_per_round=3), r"at most num_clients = 2"),
    (dict(num_clients=2, client_resources=[{"a": 1}]), r"one entry per client: 2 \(num_clients\), not 1"),
    (dict(num_clients=2, clients_per_actor=2, client_resources=[{"a": 1}, {"b": 1}]),
     "the same resources for the clients of one actor"),
    (dict(num_clients=2, client_data_roots=["a"]), r"one entry per client: 2 \(num_clients\), not 1"),
    (dict(dataset="chestxray", num_clients=2, client_data_roots=["a", "b"]), "per-source roots"),
    (dict(lr=1.0, lr_decay=1000.0, stage_length=1, iterations=100), "decays lr to"),
])
def test_each_section_checks_its_own_cross_field_rules(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(values)


def test_the_coercers_keep_their_messages():
    cases = {
        "lr": ("x", "config field 'lr': 'x' is not allowed (a number > 0)"),
        "local_steps": (1.5, "config field 'local_steps': 1.5 is not allowed (an integer >= 1)"),
        "data_workers": ("many", "config field 'data_workers': 'many' is not allowed (>= 0 or 'auto')"),
        "channels_last": (3, "config field 'channels_last': 3 is not allowed (true, false or 'auto')"),
        "schedule": ("geometrik", "one of stagewise, geometric; did you mean 'geometric'?"),
        "batch_size": (-1, "config field 'batch_size': -1 is not allowed (>= 0 or 'full')"),
        "trackers": (["mlflow", "mlflow"], "(each tracker once)"),
        "client_resources": ([{"CPU": 1}] * 4, "custom resources only; entry 0 names CPU/GPU/memory"),
        "dataset": ("digitz", "or your own factory as an import path module:attr; did you mean 'digits'?"),
    }
    for name, (value, message) in cases.items():
        with pytest.raises(ConfigError) as err:
            build_config({name: value})
        assert message in str(err.value), (name, str(err.value))
    assert build_config(batch_size="full").batch_size == 0
    assert build_config(data_workers="auto").data_workers == "auto"
    assert FIELD_BY_NAME["data_workers"].kind == "int_auto" and FIELD_BY_NAME["model"].kind == "factory"
