"""A positive_share a balanced batch cannot hold is refused; one that natural batches ignore is said once."""

from __future__ import annotations

import logging

import pytest

from fdam_ray.config import ConfigError, build_config


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr("fdam_ray.settings.sections._WARNED", set(), raising=False)


@pytest.mark.parametrize("fields, match", [
    (dict(positive_share=0.001), r"'positive_share': 0\.001 is not allowed \(above 0\.0156 and below 0\.984 with "
                                 r"batch_size = 32: .* = 0 positives, which the sampler would make 1"),
    (dict(positive_share=0.999), r"'positive_share': 0\.999 .* = 32 positives, which the sampler would make 31 "
                                 r"\(1 negative\)"),
    (dict(positive_share=0.05, batch_size=8), r"'positive_share': 0\.05 .*with batch_size = 8"),
    (dict(positive_share=0.05, batch_size=64, pretrain_iterations=10, pretrain_batch_size=8),
     r"'positive_share': 0\.05 .*with pretrain_batch_size = 8"),
])
def test_a_share_a_balanced_batch_cannot_hold_is_refused(fields, match):
    with pytest.raises(ConfigError, match=match) as info:
        build_config(dict(positive_sampling="balanced", **fields))
    assert "\n" not in str(info.value)


def test_shares_a_batch_holds_are_kept():
    assert build_config(positive_sampling="balanced", positive_share=0.02).positive_share == 0.02  # 1 of 32
    assert build_config(positive_sampling="balanced", positive_share=0.5, batch_size=2).batch_size == 2


def test_a_share_with_natural_batches_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="fdam_ray"):
        build_config(positive_share=0.3)
        build_config(positive_share=0.3)
        build_config(positive_share=0.5)  # the default: nothing to say
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "'positive_share' = 0.3 has no effect: positive_sampling = natural" in lines[0]
