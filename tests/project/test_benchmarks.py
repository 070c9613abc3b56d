"""The benchmark scripts: derived figures on hand-made inputs, and each script's core on a tiny grid."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _common as C  # noqa: E402
import _objective as O  # noqa: E402

RESULT = re.compile(r"^RESULT( [A-Za-z_][A-Za-z0-9_]*=(-?[0-9.e+-]+|nan|inf))+$")


def parse_result(line: str) -> dict[str, float]:
    assert RESULT.match(line), line
    return {k: float(v) for k, v in (item.split("=") for item in line.split()[1:])}


# -- derived figures on hand-made inputs -------------------------------------------------------------
def test_imax_is_the_largest_window_within_tolerance_of_i1():
    means = {1: 0.900, 4: 0.899, 16: 0.8951, 64: 0.880, 256: 0.870}
    assert C.imax(means, 0.005) == 16
    assert C.imax(means, 0.0005) == 1
    assert C.imax(means, 0.05) == 256


def test_imax_counts_only_drops_and_fails_nan():
    assert C.imax({1: 0.90, 4: 0.95, 16: 0.80}, 0.005) == 4  # better than I = 1 passes
    assert C.imax({1: 0.90, 4: 0.899, 16: math.nan}, 0.005) == 4  # all seeds diverged fails
    assert C.imax({1: 0.90, 4: 0.80, 16: 0.898}, 0.005) == 16  # the largest passing I, as defined
    with pytest.raises(ValueError, match="I = 1"):
        C.imax({4: 0.9, 16: 0.9}, 0.005)


def test_loglog_slope_recovers_power_laws():
    ks = [2, 4, 8, 16]
    assert C.loglog_slope(ks, [3 * k for k in ks]) == pytest.approx(1.0)
    assert C.loglog_slope(ks, [7.0] * 4) == pytest.approx(0.0, abs=1e-12)
    assert C.loglog_slope(ks, [k**0.5 for k in ks]) == pytest.approx(0.5)
    assert C.loglog_slope(ks, [2.0, math.nan, 8.0, 16.0]) == pytest.approx(1.0)  # NaN points left out
    assert math.isnan(C.loglog_slope(ks, [1.0, math.nan, math.nan, None]))


def test_rounds_to_target_on_auc_and_on_objective():
    curve = [(0, 0, 0.5, None, 0.0), (10, 1, 0.8, 1.0, -0.02), (20, 2, 0.91, 1.0, -0.05), (30, 3, 0.95, 1.0, -0.06)]
    assert C.rounds_to_target(curve, 0.9) == 2
    assert C.rounds_to_target(curve, 0.99) is None
    assert C.rounds_to_target(curve, -0.05, objective=True) == 2
    assert C.rounds_to_target(curve, -0.1, objective=True) is None


def test_stats_and_group_pool_seeds():
    results = [{"spec": {"algorithm": a, "seed": s}, "final_auc": v}
               for a, s, v in [("x", 0, 0.8), ("x", 1, 0.9), ("y", 0, math.nan), ("y", 1, 0.7)]]
    g = C.group(results, ["algorithm"])
    assert g[("x",)].mean == pytest.approx(0.85)
    assert g[("x",)].std == pytest.approx(np.std([0.8, 0.9], ddof=1))
    assert g[("y",)].n == 1 and g[("y",)].failed == 1
    assert "1 diverged" in g[("y",)].fmt()


def test_result_line_format():
    line = C.result_line(imax_codasca=256, imax_coda_plus=16, ratio=16.0, slope=math.nan, gain=-0.012345)
    assert line == "RESULT imax_codasca=256 imax_coda_plus=16 ratio=16 slope=nan gain=-0.01235"
    parse_result(line)
    with pytest.raises(ValueError):
        C.result_line(**{"bad name": 1})


def test_write_results_replaces_only_the_generated_block(tmp_path):
    path = tmp_path / "r.md"
    C.write_results(path, "T", "python x", "| a |\n|---|\n| 1 |")
    first = path.read_text()
    assert first.startswith(C.BEGIN + "\n# T\n") and first.rstrip().endswith(C.END)
    path.write_text("a note above\n\n" + first + "\n## Reading\nmy reading, 0.97\n")
    C.write_results(path, "T", "python x --again", "| a |\n|---|\n| 2 |")
    text = path.read_text()
    assert "| 2 |" in text and "| 1 |" not in text and "`python x --again`" in text
    assert text.startswith("a note above\n\n" + C.BEGIN) and text.endswith(C.END + "\n\n## Reading\nmy reading, 0.97\n")
    C.write_results(path, "T", "python x --again", "| a |\n|---|\n| 2 |")
    assert path.read_text() == text  # a rerun that measures the same writes the same file


def test_write_results_refuses_a_file_without_its_markers(tmp_path):
    path = tmp_path / "r.md"
    path.write_text("# T\n\nhand-written only\n")
    with pytest.raises(ValueError, match="no single"):
        C.write_results(path, "T", "python x", "| a |")
    assert path.read_text() == "# T\n\nhand-written only\n"


def test_committed_results_files_have_one_generated_block():
    for path in sorted((BENCH / "results").glob("*.md")):
        text = path.read_text()
        assert text.count(C.BEGIN) == 1 and text.count(C.END) == 1, path.name
        block = text[text.index(C.BEGIN):text.index(C.END)]
        assert "\nCommand: `python benchmarks/" in block, path.name  # every generated table names its command


# -- the primal objective ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["auc_square", "auc_margin"])
def test_primal_objective_is_the_saddle_value_of_the_library_objective(name):
    from fdam_ray.objectives import Objective

    rng = np.random.default_rng(0)
    y = (rng.random(200) < 0.3).astype(np.float32)
    h = np.clip(0.5 + 0.2 * (2 * y - 1) + 0.15 * rng.standard_normal(200), 0.01, 0.99)
    p = y.mean()
    obj = Objective(name, num_tasks=1, margin=0.7)
    obj.set_positive_ratio(p)
    logits = torch.tensor(np.log(h / (1 - h)), dtype=torch.float64).reshape(-1, 1)
    labels = torch.tensor(y).reshape(-1, 1)
    a, b = h[y == 1].mean(), h[y == 0].mean()
    alpha = b - a if name == "auc_square" else max(0.0, 0.7 + b - a)

    def f(a_, b_, al_):
        t = lambda v: torch.tensor([v], dtype=torch.float64)
        return float(obj(logits, labels, t(a_), t(b_), t(al_)))

    phi = O.primal_objective(h, y, name, margin=0.7)
    assert phi == pytest.approx(f(a, b, alpha), rel=1e-6, abs=1e-9)
    for d in (0.05, -0.05):  # a minimum in a, b and a maximum in alpha
        assert f(a + d, b, alpha) > phi and f(a, b + d, alpha) > phi
        if name == "auc_square" or alpha + d >= 0:
            assert f(a, b, alpha + d) < phi


def test_probe_objective_at_the_start_matches_the_central_reference():
    from fdam_ray.config import build_config
    from fdam_ray.data import make_source

    spec = {"dataset": "synthetic", "num_clients": 3, "samples_per_client": 60, "num_features": 5,
            "model": "linear", "objective": "auc_square", "algorithm": "codasca", "iterations": 8,
            "local_steps": 4, "lr": 0.5, "batch_size": 16, "eval_every": 4, "seed": 3}
    r = C.run_one({**spec, "_objective": True})
    phis = [c[4] for c in r["curve"]]
    assert len(phis) == 3 and all(math.isfinite(x) for x in phis)
    cfg = build_config({**C.RUN_DEFAULTS, **spec})
    start, best = O.reference_objective(cfg, make_source(cfg))
    assert phis[0] == pytest.approx(start, abs=1e-6)
    assert best < min(phis)  # the central full-batch fit beats 8 federated steps
    stopped = C.run_one({**spec, "_stop_objective_at": phis[1]})
    assert stopped["reached"] and stopped["rounds"] == 1


# -- each script on a tiny grid -----------------------------------------------------------------------
def test_comm_window_script(tmp_path):
    import comm_window

    out = tmp_path / "cw.md"
    line = comm_window.main(["--dataset", "digits", "--clients", "2", "--iterations", "8", "--grid", "1", "2", "4",
                             "--seeds", "0", "1", "2", "--lrs", "0.1", "0.5", "--prox-weights", "0",
                             "--out", str(out)])
    values = parse_result(line)
    assert set(values) == {"imax_codasca", "imax_coda_plus", "ratio", "imax_shown_codasca", "imax_shown_coda_plus",
                           "tolerance_codasca", "tolerance_coda_plus", "seeds"}
    assert values["imax_codasca"] in (1, 2, 4) and values["imax_coda_plus"] in (1, 2, 4)
    assert values["ratio"] == pytest.approx(values["imax_codasca"] / values["imax_coda_plus"])
    assert values["imax_shown_codasca"] <= values["imax_codasca"]
    assert values["imax_shown_coda_plus"] <= values["imax_coda_plus"]
    assert values["seeds"] == 3
    assert min(values["tolerance_codasca"], values["tolerance_coda_plus"]) >= comm_window.TOLERANCE_FLOOR
    text = out.read_text()
    assert "Command: `python benchmarks/comm_window.py --dataset digits" in text
    assert "the 3 seeds give 3 data, 3 init, 3 batches digests" in text  # the pairing was checked in the run
    assert f"= CODA+ **{values['tolerance_coda_plus']:.4f}**, CODASCA **{values['tolerance_codasca']:.4f}**" in text
    assert out.with_suffix(".png").stat().st_size > 1000


def test_comm_window_rejects_a_grid_without_one(tmp_path):
    import comm_window

    with pytest.raises(SystemExit):
        comm_window.parse_args(["--grid", "4", "16", "--out", str(tmp_path / "x.md")])


def test_comm_window_defaults_to_five_seeds_and_a_measured_tolerance(tmp_path):
    import comm_window

    args = comm_window.parse_args(["--quick", "--out", str(tmp_path / "x.md")])
    assert args.seeds == [0, 1, 2, 3, 4] and args.tolerance is None and args.tune_seed not in args.seeds
    with pytest.raises(SystemExit):
        comm_window.parse_args(["--tolerance", "-0.01"])
    with pytest.raises(SystemExit):
        comm_window.parse_args(["--seeds", "0", "100"])  # the tuning seed may not be reported


def test_comm_window_seed_fixes_data_init_and_batches_at_every_window():
    import comm_window

    spec = {"dataset": "digits", "num_clients": 2, "partition": "ih", "imratio": 0.1, "model": "mlp",
            "model_width": 8, "batch_size": 16, "iterations": 16, "eval_every": 16, "algorithm": "codasca",
            "lr": 0.5, "prox_weight": 0.0, "global_lr": 1.0}
    at = {(alg, i, seed): comm_window.pairing_fingerprint({**spec, "algorithm": alg, "local_steps": i,
                                                           "lr": 0.1 * i, "seed": seed})
          for alg, i, seed in [("codasca", 1, 0), ("codasca", 16, 0), ("coda_plus", 4, 0), ("codasca", 1, 1)]}
    assert at[("codasca", 1, 0)] == at[("codasca", 16, 0)] == at[("coda_plus", 4, 0)]
    assert all(at[("codasca", 1, 0)][k] != at[("codasca", 1, 1)][k] for k in comm_window.PAIRED)
    specs = [{**spec, "local_steps": i, "seed": s} for i in (1, 4) for s in (0, 1)]
    assert comm_window.check_pairing(specs) == {"seeds": 2, "runs": 4,
                                                 "distinct": {"data": 2, "init": 2, "batches": 2}}


def test_committed_comm_window_results_are_paired_over_five_seeds():
    text = (BENCH / "results" / "comm_window.md").read_text()
    assert "over 5 seeds (0 1 2 3 4)" in text
    assert "the 5 seeds give 5 data, 5 init, 5 batches digests" in text  # the run checked its pairing


def test_comm_window_verdict_reads_the_interval_of_the_paired_drop():
    import comm_window

    v = lambda d, tol=0.005, diverged=0: comm_window.verdict(d, diverged, tol, "t")
    assert v([0.0] * 5)["mark"] == "yes"  # I = 1 against itself: a point at 0
    assert v([-0.002, -0.003, -0.001, -0.002, -0.002])["mark"] == "yes"  # all of the interval within 0.005
    assert v([-0.02, -0.021, -0.019, -0.02, -0.02])["mark"] == "no"  # all of it beyond: a shown drop
    one_noisy = [0.0, 0.001, -0.001, 0.0, -0.03]  # mean -0.006 < -0.005, but one seed makes it
    assert v(one_noisy)["kept"] and v(one_noisy)["mark"] == "yes*"
    assert not v([-0.001] * 4, diverged=1)["kept"]  # a diverged run loses the window
    assert v([-0.004])["kept"] and not v([-0.006])["kept"]  # one seed: the difference alone
    diffs = [0.01, -0.004, 0.002, 0.015, -0.008]
    half = 2.131847 * np.std(diffs, ddof=1) / math.sqrt(5)  # t_0.95,4 s / sqrt(5)
    assert (v(diffs)["lo"], v(diffs)["hi"]) == pytest.approx((np.mean(diffs) - half, np.mean(diffs) + half))
    boot = comm_window.verdict(diffs, 0, 0.005, "bootstrap")
    assert boot["lo"] < np.mean(diffs) < boot["hi"] and boot == comm_window.verdict(diffs, 0, 0.005, "bootstrap")


def test_comm_window_tolerance_is_the_i1_half_width_with_a_floor():
    import _stats
    import comm_window

    quiet = [0.9, 0.9001, 0.8999]
    assert comm_window.noise_tolerance(quiet, "t")[0] == comm_window.TOLERANCE_FLOOR
    noisy = [0.96, 0.97, 0.975, 0.958, 0.972]
    tol, half = comm_window.noise_tolerance(noisy, "t")
    _, lo, hi = _stats.t_interval(noisy, 0.9)
    assert tol == half == pytest.approx((hi - lo) / 2)
    assert tol == pytest.approx(2.131847 * np.std(noisy, ddof=1) / math.sqrt(5), rel=1e-6)  # t_0.95,4 s / sqrt(5)
    tol1, half1 = comm_window.noise_tolerance([0.97], "t")
    assert tol1 == comm_window.TOLERANCE_FLOOR and math.isnan(half1)  # one seed: no spread, the floor


def test_rounds_vs_clients_script(tmp_path):
    import rounds_vs_clients

    out = tmp_path / "rv.md"
    line = rounds_vs_clients.main(["--clients", "2", "4", "--local-steps", "4", "--lrs", "1.0", "--iterations", "32",
                                   "--samples", "60", "--features", "5", "--seeds", "0", "--target-fraction", "0.5",
                                   "--sqrt-k", "--bootstrap", "200", "--out", str(out)])
    values = parse_result(line)
    slopes = {"slope_coda_plus", "slope_codasca", "slope_codasca_sqrtk"}
    assert set(values) == slopes | {s + "_quarter" for s in slopes} | {"codasca_interval_has_0",
                                                                       "coda_plus_above_codasca"}
    text = out.read_text()
    assert "| 2 |" in text and out.with_suffix(".png").exists()
    assert "| S = K/4 clients per round | CODASCA |" in text and "CODASCA's interval contains 0" in text


def test_bootstrap_slope_interval_brackets_the_slope_and_narrows_with_agreeing_seeds():
    import rounds_vs_clients as rv

    ks = [2, 4, 8, 16]
    exact = {k: [3.0 * k] * 5 for k in ks}  # every seed on the line rounds = 3K: no spread, slope 1
    assert rv.bootstrap_slope(ks, exact, resamples=50) == pytest.approx((1.0, 1.0))
    rng = np.random.default_rng(0)
    noisy = {k: list(5.0 * np.exp(rng.normal(0, 0.4, 5))) for k in ks}  # flat in K, seed noise
    lo, hi = rv.bootstrap_slope(ks, noisy, resamples=500)
    mean_slope = C.loglog_slope(ks, [np.mean(noisy[k]) for k in ks])
    assert lo < mean_slope < hi and hi - lo > 0.05
    assert math.isnan(rv.bootstrap_slope(ks, {k: [math.nan] * 3 for k in ks}, resamples=20)[0])


@pytest.mark.slow  # 10-17 s
def test_clients_scale_script(tmp_path):
    import clients_scale

    out = tmp_path / "cs.md"
    line = clients_scale.main(["--clients", "1", "3", "--pool", "1", "--max-actors", "1", "--rounds", "4",
                               "--local-steps", "2", "--samples", "40", "--width", "8", "--out", str(out)])
    values = parse_result(line)
    assert set(values) == {"mem_per_client_mb", "round_ratio_k256_k16", "actor_mem_mb"}
    assert values["actor_mem_mb"] > 50  # an actor process holds torch: far more than its one client
    assert abs(values["mem_per_client_mb"]) < 20  # two more clients on the same actor: no second replica
    text = out.read_text()
    assert "| 1 | 1 | pool | 1 | 1 |" in text and "| 3 | 3 | pool | 1 | 3 |" in text


def test_vs_fedavg_script(tmp_path):
    import vs_fedavg

    out = tmp_path / "vf.md"
    line = vs_fedavg.main(["--dataset", "digits", "--clients", "2", "--iterations", "8", "--local-steps", "4",
                           "--seeds", "0", "--lrs", "0.3", "--prox-weights", "0", "--out", str(out)])
    values = parse_result(line)
    assert {"codasca", "fedavg", "scaffold", "coda_plus", "gain_vs_fedavg", "gain_vs_scaffold"} == set(values)
    assert values["gain_vs_fedavg"] == pytest.approx(values["codasca"] - values["fedavg"], abs=1e-3)
    assert "| FedAvg | bce |" in out.read_text()


def test_multi_source_miniature_is_readable_and_carries_the_labels(tmp_path):
    import multi_source
    from PIL import Image

    from fdam_ray.data.chestxray_readers import READERS

    roots = multi_source.generate(tmp_path, 40, seed=0)
    assert list(roots) == list(multi_source.SOURCES)
    pattern = multi_source._pattern(4) > 0.5  # Pleural Effusion's blobs
    for name, root in roots.items():
        table = READERS[name](root, official_test=True)
        assert len(table) >= 40
        pixels = np.array([np.asarray(Image.open(p), dtype=np.float64)[pattern].mean() for p in table.paths])
        pos, neg = table.codes[:, 4] == 1, table.codes[:, 4] == 0
        if pos.sum() >= 2:  # the task's pattern is brighter where its label is positive
            assert pixels[pos].mean() > pixels[neg].mean(), name
    chexpert = READERS["chexpert"](roots["chexpert"], official_test=True)
    assert chexpert.official_test.sum() == 20  # the generated valid.csv: the target validation set


def test_multi_source_script(tmp_path):
    import multi_source

    out = tmp_path / "ms.md"
    line = multi_source.main(["--quick", "--images", "40", "--sources", "2", "--iterations", "4",
                              "--pretrain-iterations", "2", "--local-steps", "2", "--stage-length", "4",
                              "--batch-size", "8", "--seeds", "0", "--shifts", "1", "--out", str(out)])
    values = parse_result(line)
    assert set(values) == {"auc_k1", "auc_k2", "gain"}
    assert 0 <= values["auc_k1"] <= 1 and values["gain"] == pytest.approx(values["auc_k2"] - values["auc_k1"],
                                                                           abs=1e-3)
    assert "| 2 | chexpert, nih |" in out.read_text()


def test_multi_source_needs_every_real_root_it_uses(tmp_path):
    import multi_source

    with pytest.raises(SystemExit):
        multi_source.parse_args(["--chexpert-root", str(tmp_path), "--sources", "2"])


@pytest.mark.slow
def test_gpu_check_script_on_the_cpu(tmp_path):
    import gpu_check

    out = tmp_path / "gpu.md"
    line = gpu_check.main(["--allow-cpu", "--iterations", "16", "--speed-iterations", "2", "--out", str(out)])
    values = parse_result(line)
    # on the CPU stand-in both "devices" are the CPU: the comparisons must come out exact
    assert values["cpu_gpu_auc_diff"] == 0 and values["ray_vs_inline_max_diff"] == 0
    assert values["deterministic_repeat"] == values["resume_identical"] == values["ray_actors_placed"] == 1
    assert "| Ray, 4 actors x 0.25 GPU | devices ['cpu']" in out.read_text()


def test_gpu_check_sharing_looks_at_the_ids_and_the_memory_fraction():
    import gpu_check

    def actors(ids=((0,),) * 4, fraction=0.25, device="cuda:0"):
        return {k: {"device": device, "gpu_ids": list(i), "cuda_memory_fraction": fraction}
                for k, i in enumerate(ids)}

    assert gpu_check.sharing_ok(actors(), "cuda", 0.25)
    assert not gpu_check.sharing_ok(actors(fraction=None), "cuda", 0.25)  # memory not capped
    assert not gpu_check.sharing_ok(actors(fraction=1.0), "cuda", 0.25)  # capped to the wrong share
    assert not gpu_check.sharing_ok(actors(ids=((0,), (1,), (0,), (0,))), "cuda", 0.25)  # not one shared GPU
    assert not gpu_check.sharing_ok(actors(ids=((0, 1),) * 4), "cuda", 0.25)  # more than one id each
    assert not gpu_check.sharing_ok(actors(ids=((),) * 4), "cuda", 0.25)  # no GPU id
    assert not gpu_check.sharing_ok(dict(list(actors().items())[:3]), "cuda", 0.25)  # an actor missing
    assert not gpu_check.sharing_ok(actors(device="cpu"), "cuda", 0.25)
    cpu = actors(ids=((),) * 4, fraction=None, device="cpu")
    assert gpu_check.sharing_ok(cpu, "cpu", 0.0)
    assert not gpu_check.sharing_ok(actors(ids=((0,),) * 4, fraction=None, device="cpu"), "cpu", 0.0)


def run_script_process(*args: str) -> tuple[str, dict[str, float]]:
    """Run a benchmark script as its command line does; returns its stdout and its RESULT line's values."""
    import subprocess

    out = subprocess.run([sys.executable, *args], cwd=BENCH.parent, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    return out.stdout, parse_result(last)


def test_step_overhead_script(tmp_path):
    out = tmp_path / "so.md"
    _, values = run_script_process("benchmarks/step_overhead.py", "--models", "cnn", "--batch", "4", "--steps", "2",
                                   "--repeats", "2", "--out", str(out))
    assert set(values) == {"step_ratio", "step_ratio_lo", "step_ratio_hi", "client_ms", "bare_ms", "target_met"}
    assert values["step_ratio_lo"] <= values["step_ratio_hi"] and values["client_ms"] > 0 and values["bare_ms"] > 0
    assert values["step_ratio"] == pytest.approx(values["client_ms"] / values["bare_ms"], rel=2e-3)
    if abs(values["step_ratio"] - 1.1) > 1e-3:  # the line prints 4 significant digits: 1.1 may be 1.1004
        assert values["target_met"] == float(values["step_ratio"] <= 1.1)
    text = out.read_text()
    assert text.startswith(C.BEGIN) and "Command: `python benchmarks/step_overhead.py --models cnn" in text
    assert "| cnn | 56,545 |" in text


@pytest.mark.slow
def test_round_overhead_script(tmp_path):
    out = tmp_path / "ro.md"
    out.write_text(f"{C.BEGIN}\nold\n{C.END}\n\n## Reading\nkept\n")
    _, values = run_script_process("benchmarks/round_overhead.py", "--sizes", "2000", "4000", "--clients", "2",
                                   "--also-clients", "1", "--rounds", "2", "--repeats", "1", "--mem-clients", "1", "2",
                                   "--out", str(out))
    assert set(values) == {"state_floats", "compiled_ms", "classic_ms", "gloo_ms", "compiled_spin_ms",
                           "collective_ms", "ratio_collective_gloo", "ratio_collective_gloo_small",
                           "collective_round_ms", "ratio_collective_round_gloo", "ratio_collective_round_gloo_small",
                           "ratio_compiled_gloo", "ratio_compiled_gloo_small", "ratio_compiled_classic_small",
                           "plain_ray_ms", "ratio_classic_plain", "floor_ms", "driver_mem_ratio_k2_k1",
                           "driver_rss_ratio_k2_k1", "ratio_collective_gloo_k1"}
    assert values["state_floats"] == 4000 and min(values["plain_ray_ms"], values["gloo_ms"]) > 0
    assert values["ratio_compiled_gloo"] == pytest.approx(values["compiled_ms"] / values["gloo_ms"], rel=2e-3)
    assert values["ratio_collective_gloo"] == pytest.approx(values["collective_ms"] / values["gloo_ms"], rel=2e-3)
    assert values["ratio_collective_round_gloo"] == pytest.approx(values["collective_round_ms"] / values["gloo_ms"],
                                                                  rel=2e-3)
    assert values["ratio_classic_plain"] == pytest.approx(values["classic_ms"] / values["plain_ray_ms"], rel=2e-3)
    text = out.read_text()
    assert "\nold\n" not in text and text.endswith(f"{C.END}\n\n## Reading\nkept\n")
    assert "| 2,000 | 2 |" in text and "| 4,000 | 2 |" in text and "| 4,000 | 1 |" in text
    assert "Command: `python benchmarks/round_overhead.py --sizes 2000" in text


@pytest.mark.slow  # a multi-node cluster of its own: about a minute
def test_node_reduce_script(tmp_path):
    out = tmp_path / "nr.md"
    out.write_text(f"{C.BEGIN}\nold\n{C.END}\n")
    _, values = run_script_process("benchmarks/node_reduce.py", "--nodes", "2", "--clients-per-node", "2",
                                   "--state-floats", "20000", "--rounds", "2", "--repeats", "1", "--warmup", "2",
                                   "--out", str(out))
    assert values["nodes"] == 2 and values["clients"] == 4
    assert values["ingress_ratio_node_star"] == pytest.approx(0.5)  # one sum per node instead of one per client
    assert values["round_ratio_node_star"] > 0 and values["round_ratio_node_star_compiled"] > 0
    text = out.read_text()
    assert "| 2 | 4 | 2, 2 |" in text and "Command: `python benchmarks/node_reduce.py --nodes 2" in text
    assert "compiled node ms" in text
    assert "2 timed rounds (after 2 warm-up rounds)" in text


def test_node_reduce_sizes_every_store_for_the_driver_node_of_a_star_round_and_says_what_went_to_disk():
    import argparse

    import node_reduce

    state = 7_000_000 * 4
    size = node_reduce.store_bytes_for(4, 4, 7_000_000)
    # the driver's node holds the 16 sums of a classic star round and the compiled star graph's 16 channels
    assert size >= 2 * 16 * state and size >= 3 * 4 * state
    assert node_reduce.store_bytes_for(2, 8, 7_000_000) > node_reduce.store_bytes_for(2, 2, 7_000_000)
    assert node_reduce.store_bytes_for(1, 1, 1000) == 300 * 2**20  # small states: Ray's own floor here
    args = argparse.Namespace(nodes=[2, 4], clients_per_node=4, state_floats=7_000_000)
    node_reduce.STORE_PRESSURE.clear()
    assert node_reduce.store_line(args) == f"Object store: {size / 2**20:,.0f} MiB per node."
    node_reduce.STORE_PRESSURE.update(spilled_mib=28.0, fallback_mib=56.0)
    try:
        line = node_reduce.store_line(args)
    finally:
        node_reduce.STORE_PRESSURE.clear()
    assert "28 MiB were spilled to disk" in line and "at most 56 MiB sat in fallback files" in line
    assert node_reduce.store_pressure() is None  # no Ray running in this process: left out, not an error


def test_node_reduce_refuses_a_netlab_folder_without_netcluster_in_one_line(tmp_path):
    import node_reduce

    with pytest.raises(SystemExit, match=r"--netlab: .* has no netcluster\.py"):
        node_reduce.main(["--netlab", str(tmp_path)])


def test_node_reduce_refuses_no_warm_up_round_in_one_line(capsys):
    import node_reduce

    with pytest.raises(SystemExit):
        node_reduce.main(["--warmup", "0"])
    assert "--warmup: 0; at least 1 (the first round of a block builds its compiled graph)" in capsys.readouterr().err


def test_input_pipeline_writes_files_of_the_real_sizes(tmp_path):
    import input_pipeline
    from PIL import Image

    for fmt, size in (("jpeg", (320, 390)), ("png", (1024, 1024))):
        paths = input_pipeline.write_files(tmp_path, fmt, 2)
        with Image.open(paths[0]) as image:
            assert image.size == size and image.mode == "L"
            assert image.format == fmt.upper()
    assert input_pipeline.workers_needed(1000, 300) == 4 and input_pipeline.workers_needed(900, 300) == 3


def test_input_pipeline_script(tmp_path):
    out = tmp_path / "ip.md"
    _, values = run_script_process("benchmarks/input_pipeline.py", "--images", "12", "--workers", "0", "1",
                                   "--image-size", "64", "--batch", "4", "--train-rates", "50", "--rate-for-result",
                                   "50", "--out", str(out))
    assert set(values) == {"jpeg_per_worker", "png_per_worker", "jpeg_workers_at_50", "png_workers_at_50"}
    for fmt in ("jpeg", "png"):
        per_worker, needed = values[f"{fmt}_per_worker"], values[f"{fmt}_workers_at_50"]
        assert per_worker > 0 and needed - 1 < 50 / per_worker * 1.001 and needed >= 50 / per_worker * 0.999
    assert values["png_per_worker"] < values["jpeg_per_worker"]  # a 1024 x 1024 PNG decodes far more slowly
    text = out.read_text()
    assert "| CheXpert-small-like JPEG | 320x390 |" in text and "| NIH-like PNG | 1024x1024 |" in text
    assert "Command: `python benchmarks/input_pipeline.py --images 12" in text


def test_gpu_throughput_steady_rate_takes_the_second_half():
    import gpu_throughput

    history = [{"iteration": 0, "samples_per_s": None}, {"iteration": 10, "samples_per_s": 100.0},
               {"iteration": 20, "samples_per_s": 150.0}]
    # 100 samples in 1 s, then 200 in 4/3 s: the second 100 took 1/3 s
    assert gpu_throughput.steady_rate(history, 10) == pytest.approx(300.0)


def gpu_throughput_quick(tmp_path, *extra: str) -> tuple[dict[str, float], str]:
    out = tmp_path / "gt.md"
    _, values = run_script_process("benchmarks/gpu_throughput.py", "--quick", "--device", "cpu", *extra,
                                   "--out", str(out))
    assert set(values) == {"client_vs_bare_densenet_bf16", "bf16_speedup", "shared_gpu_ratio", "pipeline_ratio"}
    return values, out.read_text()


@pytest.mark.slow  # a local Ray: about 15 s in CI
def test_gpu_throughput_script_on_the_cpu(tmp_path):
    values, text = gpu_throughput_quick(tmp_path, "--skip", "shared")
    assert math.isnan(values["shared_gpu_ratio"])
    assert all(math.isfinite(v) and v > 0 for k, v in values.items() if k != "shared_gpu_ratio")
    assert "GPU figures are still to be measured" in text and "Device: CPU" in text
    for row in ("| densenet121 | 32x32 | 2 | bf16 | no |", "| resnet20 | 8x8 | 8 | fp32 | no |"):
        assert row in text
    assert "Command: `python benchmarks/gpu_throughput.py --quick --device cpu" in text


@pytest.mark.slow  # over a minute: gpu_throughput's quick run and a local Ray for the collective round
def test_gpu_suite_script_on_the_cpu(tmp_path):
    _, values = run_script_process("benchmarks/gpu_suite.py", "--quick", "--device", "cpu", "--out-dir",
                                   str(tmp_path))
    block = {"device_block_ms", "bare_sum_ms", "ratio_device_block_bare"}
    assert set(values) == {"client_vs_bare_densenet_bf16", "shared_gpu_ratio", "pipeline_ratio", "collective_ms",
                           "bare_allreduce_ms", "ratio_collective_bare", "collective_nccl", "bare_nccl", *block}
    assert all(math.isfinite(v) and v >= 0 for k, v in values.items() if k not in block)
    assert all(math.isnan(values[k]) for k in block)  # the GPU figure is not measured on the CPU
    assert values["collective_nccl"] == values["bare_nccl"] == 0  # gloo on the CPU, both sides
    assert values["ratio_collective_bare"] == pytest.approx(values["collective_ms"] / values["bare_allreduce_ms"],
                                                            rel=2e-3)
    suite = (tmp_path / "gpu_suite.md").read_text()
    assert "Device: CPU" in suite and "| collective round overhead | gloo |" in suite
    assert "Command: `python benchmarks/gpu_suite.py --quick --device cpu" in suite
    throughput = (tmp_path / "gpu_throughput.md").read_text()  # every section of gpu_throughput.py, shared too
    assert "| densenet121 | 32x32 | 2 | bf16 |" in throughput
    assert "| 4 | 0.5 |" in throughput and values["shared_gpu_ratio"] > 0  # four clients, a quarter of 2 CPUs each
    assert "The GPU figure is not measured" in suite and "| device block reduce | cpu |" in suite


@pytest.mark.slow  # three Ray executors of its own: about a minute
def test_stragglers_script(tmp_path):
    out = tmp_path / "st.md"
    _, values = run_script_process("benchmarks/stragglers.py", "--clients", "2", "--steps", "2", "--step-s", "0.05",
                                   "--slow", "8", "--rounds", "2", "--out", str(out))
    assert set(values) == {"straggler_ratio_deadline", "straggler_ratio_none"}
    assert values["straggler_ratio_none"] > 2  # the round waits for the client 8x slower
    assert values["straggler_ratio_deadline"] < values["straggler_ratio_none"]
    text = out.read_text()
    assert text.startswith(C.BEGIN) and "Command: `python benchmarks/stragglers.py --clients 2" in text
    assert "| slow client, round_deadline=1.2x |" in text


def test_transfer_precision_script(tmp_path):
    import transfer_precision

    out = tmp_path / "tp.md"
    line = transfer_precision.main(["--dataset", "digits", "--clients", "2", "--iterations", "64",
                                    "--algorithms", "codasca", "--seeds", "0", "1", "--out", str(out)])
    values = parse_result(line)
    assert set(values) == {"max_abs_d_bf16", "max_abs_d_bf16_ef", "max_abs_d_fp16", "max_abs_d_exact", "mean_d_bf16",
                           "mean_d_bf16_ef", "rms_d_bf16", "rms_d_bf16_ef", "rms_d_fp16", "rms_d_exact",
                           "bytes_ratio", "seeds"}
    assert values["seeds"] == 2
    assert 0.5 < values["bytes_ratio"] < 0.75  # 2 bytes a value, first broadcasts in float32
    for variant in ("bf16", "bf16_ef", "fp16", "exact"):
        assert values[f"max_abs_d_{variant}"] >= values[f"rms_d_{variant}"] >= 0
    text = out.read_text()
    assert "Command: `python benchmarks/transfer_precision.py --dataset digits" in text
    assert "| exact (bf16's path, float32 values: nothing rounded) |" in text
    assert "seeds with abs d > 0.003" in text


def test_transfer_precision_exact_variant_sends_float32_through_the_rounded_path():
    """The noise-floor reference: bf16's transfer path (4 bytes a value travel, so nothing was rounded), and the
    module's rounding is back in place after the run."""
    import transfer_precision as TP

    from fdam_ray.executors import transfer

    args = TP.parse_args(["--dataset", "digits", "--clients", "2", "--iterations", "32", "--algorithms", "codasca"])
    encode = transfer.encode
    bf16 = TP.run_variant(TP.spec_for(args, "codasca", 16, 0, "bf16"))
    exact = TP.run_variant(TP.spec_for(args, "codasca", 16, 0, "exact"))
    assert transfer.encode is encode
    assert exact["last"]["bytes_up"] == 2 * bf16["last"]["bytes_up"]


def test_transfer_precision_stage_length_sets_the_stagewise_schedule_and_is_checked(capsys):
    import transfer_precision as TP

    base = ["--dataset", "digits", "--clients", "2", "--iterations", "64", "--algorithms", "codasca"]
    args = TP.parse_args([*base, "--stage-length", "32"])
    assert TP.spec_for(args, "codasca", 16, 0, "bf16")["stage_length"] == 32
    assert TP._schedule(args) == "lr / 3 every 32 iterations (2 stages)"
    plain = TP.parse_args(base)
    assert TP.spec_for(plain, "codasca", 16, 0, "bf16")["stage_length"] == 64
    assert TP._schedule(plain) == "one stage of constant lr"
    for bad in ("24", "0", "128"):  # not a multiple of I = 16; not >= 1; longer than the run
        with pytest.raises(SystemExit):
            TP.parse_args([*base, "--stage-length", bad])
        assert f"--stage-length {bad}: must be a multiple of every --windows I" in capsys.readouterr().err


def test_node_reduce_precision_rates_fit_splits_the_round_and_needs_netlab(capsys):
    """--precision-rates: from rounds built as a + b x per transport and precision, the results block and the
    RESULT figures give back a and b, the ring bound (336 for 7M floats on 4 nodes), the ratios at 1gbit, a
    refused setting as refused, the slow node's x_eff, and a collective whose bytes went around the shaping is
    named; the option without --netlab is refused before anything starts."""
    import argparse

    import _node_reduce_links as L
    import node_reduce as NR

    args = argparse.Namespace(precision_rates=["1gbit", "500mbit", "250mbit"], netlab="netlab", nodes=[4],
                              clients_per_node=4, state_floats=7_000_000, repeats=3, rounds=6, block_seconds=10.0,
                              rate="1gbit", slow_rate="100mbit", deadline="2x", warmup=1)
    lines = {("star", "fp32"): (600, 3800), ("star", "bf16"): (700, 1900), ("node", "fp32"): (478, 1104),
             ("node", "bf16"): (628, 560), ("collective", "fp32"): (400, 420)}
    x = {"unshaped": 0.0, "1gbit": 1.0, "500mbit": 2.0, "250mbit": 4.0}
    ips = [f"127.0.0.{i}" for i in range(2, 7)]

    def row(ms, mb=None):
        return {"ms": ms, "lo": ms - 1, "hi": ms + 1, "per_call": 1, "node_mb": mb}

    links = {link: {L.combo_of(n, p): row(a + b * xv, None if link == "unshaped" else
                                          {ip: 0.0 if n == "collective" else b / 8 for ip in ips})
                    for (n, p), (a, b) in lines.items()} for link, xv in x.items()}
    slow = {L.combo_of("node", "fp32"): row(478 + 1104 * 3), L.combo_of("collective", "fp32"): row(400 + 420 * 10)}
    results = {"links": links, "x": x, "placed": [4, 4, 4, 4],
               "refused": {L.combo_of("collective", "bf16"): "config field 'transfer_precision': 'bf16' no"},
               "straggler": {"slow_node": ips[-1], "x_rate": 1.0, "x_slow": 10.0, "rows": slow, "refused": {}}}
    text = L.body(args, results, None, None)
    assert "| 1gbit | 4400 (4399..4401) | 2600 (2599..2601) | 1582 (1581..1583) | 1188 (1187..1189) | 820 " in text
    assert "| refused |" in text and "collective star bf16_ef: refused (config field" in text
    assert "| node | fp32 | 478 | 1104 | 3.29 | +0, +0, +0 |" in text and "b_ring = 2 (p - 1) / p x state " in text
    assert "| node, no deadline | 3790 (3789..3791) | 478 + 1104 x | 1582 | 11518 | 3.00 |" in text
    assert "Warning: collective fp32: a worker node received 0.0 MB" in text  # 0 MB: around the shaping
    values = L.values(args, results)
    assert values["b_ring_fp32"] == pytest.approx(336.0) and values["b_node_fp32"] == pytest.approx(1104.0)
    assert values["b_collective_fp32"] == pytest.approx(420.0) and math.isnan(values["b_collective_bf16"])
    assert values["round_ratio_collective_node_1gbit"] == pytest.approx(820 / 1582)
    assert values["round_ratio_collective_ring_1gbit"] == pytest.approx(820 / (400 + 336))
    assert values["straggler_x_collective_none"] == pytest.approx(10.0)
    assert parse_result(C.result_line(**values))["resid_max_star_fp32"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(SystemExit):
        NR.main(["--precision-rates", "1gbit", "250mbit"])
    assert "--precision-rates needs --netlab" in capsys.readouterr().err


def test_node_reduce_precision_rates_are_checked_before_anything_starts(capsys):
    import argparse

    import node_reduce as NR

    class Netcluster:  # netlab's rate parser, alone
        @staticmethod
        def parse_rate(rate):
            units = {"gbit": 10**9, "mbit": 10**6}
            for unit, scale in units.items():
                if rate.endswith(unit):
                    return int(float(rate[: -len(unit)]) * scale)
            raise ValueError(f"rate {rate!r}: use e.g. 1gbit, 500mbit, 10gbit")

    parser = argparse.ArgumentParser()
    NR.check_precision_rates(parser, Netcluster, ["1gbit", "1.5gbit", "250mbit"])
    for rates, says in ((["1gbit", "fast"], "rate 'fast'"), (["0mbit", "1gbit"], "'0mbit' is no rate above zero"),
                        (["1gbit", "1000mbit"], "'1000mbit' and '1gbit' are the same rate")):
        with pytest.raises(SystemExit):
            NR.check_precision_rates(parser, Netcluster, rates)
        assert f"--precision-rates: {says}" in capsys.readouterr().err
    assert NR.rate_key("1.5gbit") == "1_5gbit"


def test_privacy_independent_epsilon_matches_the_accountant_where_it_is_exact():
    """benchmarks/privacy.py's recomputation (no dp_accounting) on a few orders: the Gaussian's alpha / 2 sigma^2,
    sampling without replacement (Thm. 27 and its interpolation) at every order, Poisson at the integer orders,
    and the improved conversion; at a fractional order the package's Poisson value is never below the exact
    integral (dp_accounting 0.6.0 sums the series' terms in absolute value: an upper bound)."""
    pytest.importorskip("dp_accounting")
    import privacy as P

    from fdam_ray.privacy.accountant import Accountant

    orders = (1.5, 2.0, 3.0, 4.5, 8.0, 20.0)
    for population, sample, sampling, sigma in ((5, 5, "fixed", 1.3), (40, 8, "fixed", 1.7), (50, 5, "poisson", 1.1)):
        acc = Accountant(noise_multiplier=sigma, delta=1e-5, population=population, sample_size=sample,
                         sampling=sampling, orders=orders, accounting="rdp")
        acc.step(1, compositions=30)
        if sampling == "poisson":
            mine = 30 * P.rdp_poisson(sample / population, sigma, orders)
        elif sample < population:
            mine = 30 * P.rdp_wor(sample / population, sigma / 2, orders)
        else:
            mine = 30 * np.asarray(orders) / (2 * sigma**2)
        for a, theirs, ours in zip(orders, acc.rdp(), mine, strict=True):
            if sampling == "poisson" and not a.is_integer():
                assert theirs >= ours * (1 - 1e-12)
            else:
                assert ours == pytest.approx(theirs, rel=1e-9)
        if sampling != "poisson":
            assert P.independent_epsilon(sigma=sigma, population=population, sample_size=sample, sampling=sampling,
                                         compositions=30, delta=1e-5, orders=orders) == pytest.approx(acc.epsilon(),
                                                                                                      rel=1e-9)
    # the conversion by hand at one order: rdp 2 at alpha 8, delta 1e-5
    assert P.epsilon_from_rdp([8.0], [2.0], 1e-5) == pytest.approx(2 + math.log(7 / 8) - math.log(8e-5) / 7)
    assert P.epsilon_from_rdp([8.0], [1e-12], 1e-5) == 0.0  # the KL bound
    # quadrature and binomial sum agree: A_3 from the integral of the fractional path at 3 - 1e-9
    assert P._log_a_poisson(0.1, 1.1, 3 - 1e-9) == pytest.approx(P._log_a_poisson(0.1, 1.1, 3), rel=1e-6)


def test_fault_tests_script_tables_each_fault_test_and_counts_the_survivors(tmp_path, monkeypatch):
    import subprocess

    import fault_tests

    seen = {}

    def fake_pytest(command, **kw):  # writes the JUnit report pytest would
        seen["command"] = command
        report = next(a for a in command if a.startswith("--junitxml=")).split("=", 1)[1]
        Path(report).write_text(
            '<testsuites><testsuite name="pytest">'
            '<testcase classname="tests.e2e.test_faults" name="test_a[classic]" time="12.5"/>'
            '<testcase classname="tests.e2e.test_signals" name="test_b" time="3.0"><failure message="x"/></testcase>'
            '<testcase classname="tests.executors.test_hosted" name="test_c" time="1.0"/>'
            "</testsuite></testsuites>")
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(fault_tests.subprocess, "run", fake_pytest)
    out = tmp_path / "faults.md"
    line = fault_tests.main(["--quick", "--out", str(out)])
    assert parse_result(line)["faults"] == 3 and parse_result(line)["survived"] == 2
    assert parse_result(line)["failed"] == 1
    assert seen["command"][3:7] == ["-k", fault_tests.QUICK, "-m", "fault"]
    text = out.read_text()
    assert "| `tests/e2e/test_faults.py::test_a[classic]` | passed | 12.5 |" in text
    assert "| `tests/e2e/test_signals.py::test_b` | failed | 3.0 |" in text
    assert "python benchmarks/fault_tests.py --quick --out" in text


def test_every_fault_test_is_out_of_both_ci_tiers_but_one_sigterm_case():
    # the fault suite's tests carry the `fault` mark only: `pytest` ("not slow and not fault") and `pytest -m slow`
    # leave them out, except the classic SIGTERM case that CI keeps in the slow tier. One collection, every item's
    # marks read before any -m deselects it.
    import json
    import subprocess

    script = (
        "import json, sys, pytest\n"
        "class Grab:\n"
        "    marks = {}\n"
        "    @pytest.hookimpl(tryfirst=True)\n"
        "    def pytest_collection_modifyitems(self, items):\n"
        "        Grab.marks = {i.nodeid: sorted({m.name for m in i.iter_markers()}) for i in items}\n"
        "pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', *sys.argv[1:]], plugins=[Grab()])\n"
        "print('MARKS ' + json.dumps(Grab.marks))\n")
    out = subprocess.run([sys.executable, "-c", script, "tests/e2e/test_faults.py", "tests/e2e/test_signals.py"],
                         cwd=BENCH.parent, capture_output=True, text=True, timeout=300).stdout
    marks = json.loads(next(x for x in out.splitlines() if x.startswith("MARKS "))[6:])
    fault = {n for n, m in marks.items() if "fault" in m}
    assert len(fault) >= 7 and not any("slow" in marks[n] for n in fault)
    assert "slow" in marks["tests/e2e/test_faults.py::test_sigterm_stops_a_ray_run_the_same_way[classic]"]
    assert "tests/e2e/test_faults.py::test_sigterm_stops_a_ray_run_the_same_way[compiled]" in fault


def test_the_slow_compute_pace_is_read_from_its_control_file_and_only_slows_the_last_nodes_clients(tmp_path):
    import time

    from _node_reduce_compute import PacedDataset, read_pace

    control = tmp_path / "pace"
    assert read_pace(str(control), 0) == 0.0  # no file: no pace
    control.write_text("")
    assert read_pace(str(control), 5) == 0.0  # emptied after the phase: no pace
    control.write_text("0.05 12 3")
    assert read_pace(str(control), 11) == 0.05 and read_pace(str(control), 12) == pytest.approx(0.15)
    data = PacedDataset(np.zeros((1, 3), np.float32), np.ones((1, 1), np.float32), 12, str(control))
    t0 = time.monotonic()
    x, y = data[0]
    assert time.monotonic() - t0 >= 0.15 and x.shape == (3,) and float(y[0]) == 1.0
