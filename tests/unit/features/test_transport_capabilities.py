"""What a transport supports is declared once (:mod:`fdam_ray.features.capabilities`): the transport classes point at
it, and the config's choices and refusals, the registry's refusals and the README's table are derived from it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from fdam_ray.config import build_config
from fdam_ray.executors.ray_section import RaySection
from fdam_ray.features.capabilities import (
    CAPABILITIES,
    REDUCES,
    markdown_table,
    no_16bit,
    no_deadline,
    refused_pairs,
    transports,
)
from fdam_ray.settings.sections import SETTING, ConfigError

README = Path(__file__).resolve().parents[3] / "docs/explanation/transports.md"


def test_every_transport_class_declares_the_registry_entry_of_its_name():
    from fdam_ray.executors.ray.transports import REFUSED, REGISTRY, transport_for

    assert list(REGISTRY) == list(CAPABILITIES)  # one vocabulary: the config's (transport, reduce) pair
    for pair, cls in REGISTRY.items():
        assert cls.capabilities is CAPABILITIES[pair]
        assert cls.serves == pair == (cls.capabilities.transport, cls.capabilities.reduce)
        assert transport_for(*pair) is cls
        assert cls.capabilities.label == f"transport={pair[0]} reduce={pair[1]}"
    assert REFUSED == refused_pairs()


def test_every_pair_of_the_configs_choices_is_run_by_one_transport_or_refused_with_a_reason():
    fields = {f.name: f.metadata[SETTING] for f in dataclasses.fields(RaySection) if SETTING in f.metadata}
    assert fields["transport"].choices == tuple(transports()) and fields["reduce"].choices == REDUCES
    served = [c.serves for c in CAPABILITIES.values()]
    assert len(served) == len(set(served))
    refused = refused_pairs()
    for t in transports():
        for r in REDUCES:
            assert ((t, r) in served) != ((t, r) in refused)
            assert (t, r) in served or refused[t, r].startswith(f"transport={t} ")


def test_one_config_transport_supports_or_refuses_deadlines_and_16_bit_transfers_whatever_its_reduce():
    # DeadlineSection and TransferSection read the config's transport alone
    for t in transports():
        running = [c for c in CAPABILITIES.values() if c.transport == t]
        assert len({bool(c.no_deadline) for c in running}) == 1 and len({bool(c.no_16bit) for c in running}) == 1


@pytest.mark.parametrize("transport", transports())
def test_the_configs_refusals_follow_the_declarations(transport):
    reduce = "star"
    deadline = dict(transport=transport, reduce=reduce, round_deadline=5)
    if no_deadline(transport):
        with pytest.raises(ConfigError, match=r"^config field 'round_deadline'") as refused:
            build_config(deadline)
        assert str(refused.value).endswith(f"(null with transport={transport} ({no_deadline(transport)}))")
        assert "use transport=classic" in str(refused.value)
    else:
        assert build_config(deadline).round_deadline == 5.0
    rounded = dict(transport=transport, reduce=reduce, transfer_precision="bf16")
    if no_16bit(transport):
        with pytest.raises(ConfigError, match=r"^config field 'transfer_precision'") as refused:
            build_config(rounded)
        assert str(refused.value).endswith(f"(fp32 with transport={transport}; bf16/fp16 run with "
                                           "transport=classic or collective)")
    else:
        assert build_config(rounded).transfer_precision == "bf16"
    assert build_config(dict(rounded, executor="inline")).transfer_precision == "bf16"  # inline reads neither


def test_the_config_reads_the_declarations_without_importing_ray():
    code = ("import sys, fdam_ray.config, fdam_ray.features.capabilities, fdam_ray.executors.deadlines, "
            "fdam_ray.executors.transfer; "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_table_has_a_row_per_pair_and_says_why_for_each_refusal():
    table = markdown_table().splitlines()
    assert len(table) == 2 + len(transports()) * len(REDUCES)
    for c in CAPABILITIES.values():
        row = next(line for line in table if line.startswith(f"| {c.transport} | {c.reduce} |"))
        for why in (c.no_deadline, c.no_16bit):
            assert (f"no: {why}" in row) if why else ("| yes |" in row)
    for (t, r), why in refused_pairs().items():
        assert any(line.startswith(f"| {t} | {r} | refused: {why} |") for line in table)


def test_the_readmes_transport_table_is_the_declarations():
    assert markdown_table() in README.read_text(), ("docs/explanation/transports.md's transport table is not "
                                                     "fdam_ray.features.capabilities.markdown_table()")
