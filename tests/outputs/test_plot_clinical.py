"""``fdam plot`` of a run with ``clinical: on``: the test AUC curve carries its 95 % interval as a band (the logit
interval of every record), and site_auc.png shows the pooled and each site's final AUC with its interval; a run
without the read-out draws neither (fdam_ray.plots)."""

from __future__ import annotations

import numpy as np
import pytest

from fdam_ray import plots
from fdam_ray.assembly.recipe import run
from fdam_ray.config import build_config

pytest.importorskip("matplotlib")

BASE = dict(dataset="synthetic", model="mlp", model_width=8, num_clients=3, samples_per_client=150, batch_size=16,
            algorithm="codasca", local_steps=3, iterations=18, stage_length=9, eval_every=6, executor="inline",
            tensorboard=False)


@pytest.fixture
def figures(monkeypatch):
    """Every figure drawn, by file name (kept open until the test ends)."""
    drawn: dict = {}

    def keep(fig, path, plt):
        drawn[path.name] = fig
        fig.savefig(path)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    yield drawn
    for fig in drawn.values():
        plots._pyplot().close(fig)


def test_the_curve_has_its_interval_band_and_the_sites_their_error_bars(tmp_path, figures):
    clinical = run(build_config(dict(BASE, clinical="on", out_dir=str(tmp_path), run_name="clinical")))
    plain = run(build_config(dict(BASE, out_dir=str(tmp_path), run_name="plain")))
    written = plots.plot_runs([clinical.run_dir, plain.run_dir], tmp_path / "fig")
    assert (tmp_path / "fig" / "site_auc.png") in written and all(p.stat().st_size > 0 for p in written)

    ax = figures["auc_vs_iterations.png"].axes[0]
    bands = [c for c in ax.collections if len(c.get_paths())]
    assert len(bands) == 1  # the clinical run's; the plain run has none
    vertices = bands[0].get_paths()[0].vertices
    low = [h["test_auc_ci_logit_low"] for h in clinical.history]
    high = [h["test_auc_ci_logit_high"] for h in clinical.history]
    iterations = [h["iteration"] for h in clinical.history]
    for x, lo, hi in zip(iterations, low, high, strict=True):  # the band's outline passes through both ends
        at = vertices[np.isclose(vertices[:, 0], x)]
        assert np.isclose(at[:, 1], lo).any() and np.isclose(at[:, 1], hi).any()
    assert "95% CI" in ax.get_ylabel()
    bottom, top = ax.get_ylim()  # the zoom holds the band past the untrained start
    assert bottom <= min(low[1:]) and top >= max(high[1:])

    ax = figures["site_auc.png"].axes[0]
    last = clinical.history[-1]
    sites = list(last["client_auc_ci_logit_low"])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["pooled", *sites]
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == pytest.approx([last["test_auc"], *(last["client_auc"][s] for s in sites)])
    (bars,) = [c for c in ax.collections if c.get_segments()]  # the error bars: one vertical segment per bar
    spans = sorted((min(seg[:, 1]), max(seg[:, 1])) for seg in bars.get_segments())
    want = sorted([(last["test_auc_ci_logit_low"], last["test_auc_ci_logit_high"]),
                   *((last["client_auc_ci_logit_low"][s], last["client_auc_ci_logit_high"][s]) for s in sites)])
    assert np.allclose(spans, want)


def test_without_the_read_out_no_band_and_no_site_figure(tmp_path, figures):
    plain = run(build_config(dict(BASE, out_dir=str(tmp_path), run_name="plain")))
    written = plots.plot_runs([plain.run_dir], tmp_path / "fig")
    assert {p.name for p in written} == {"auc_vs_iterations.png", "auc_vs_bytes.png", "auc_vs_local_steps.png"}
    ax = figures["auc_vs_iterations.png"].axes[0]
    assert not [c for c in ax.collections if len(c.get_paths())] and "CI" not in ax.get_ylabel()
