"""The Gaussian mechanism's NumPy halves: clipping bounds a contribution, noise has the stated std, replays by seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fdam_ray.privacy.mechanisms import clip_to_norm, gaussian_noise, noise_generator, noise_share_std, noise_std


def test_a_vector_within_the_bound_is_returned_bit_for_bit():
    rng = np.random.default_rng(0)
    v = rng.standard_normal(1000).astype(np.float32)
    v *= np.float32(0.5 / np.linalg.norm(v.astype(np.float64)))
    out, norm = clip_to_norm(v, 1.0)
    assert out is v and norm == pytest.approx(0.5, rel=1e-6)
    exactly = np.array([3.0, 4.0], dtype=np.float32)  # norm exactly C: the bound is inclusive
    assert clip_to_norm(exactly, 5.0)[0] is exactly


def test_clipping_scales_to_the_bound_along_the_same_direction():
    v = np.array([3.0, 4.0], dtype=np.float64)
    out, norm = clip_to_norm(v, 1.0)
    assert norm == 5.0
    np.testing.assert_allclose(out, [0.6, 0.8], rtol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_clipped_vector_never_exceeds_the_bound_even_after_rounding(dtype):
    rng = np.random.default_rng(1)
    naive_over = 0  # trials where v * (C / ||v||) rounded to the dtype lands above C: what the shrink step fixes
    for trial in range(300):
        v = (rng.standard_normal(257) * 10.0 ** rng.uniform(-1, 6)).astype(dtype)
        clip = float(10.0 ** rng.uniform(-3, 1))
        out, norm = clip_to_norm(v, clip)
        assert out.dtype == dtype
        assert float(np.linalg.norm(out.astype(np.float64))) <= clip, trial
        if norm > clip:  # bound binding: the norm is C up to a few float32 ulps
            assert float(np.linalg.norm(out.astype(np.float64))) == pytest.approx(clip, rel=1e-5)
            naive = (v.astype(np.float64) * (clip / norm)).astype(dtype).astype(np.float64)
            naive_over += float(np.linalg.norm(naive)) > clip
    assert dtype == np.float64 or naive_over > 30


def test_one_huge_change_moves_the_noiseless_sum_by_at_most_the_bound():
    rng = np.random.default_rng(2)
    clip = 1.0
    honest = [rng.standard_normal(64).astype(np.float32) * 0.01 for _ in range(9)]
    base = sum(clip_to_norm(d, clip)[0].astype(np.float64) for d in honest)
    for scale in (1.0, 1e3, 1e30):
        rogue = rng.standard_normal(64).astype(np.float32) * np.float32(scale)
        with_rogue = base + clip_to_norm(rogue, clip)[0].astype(np.float64)
        assert np.linalg.norm(with_rogue - base) <= clip * (1 + 1e-12)
    # replacing one client by another: the sum moves by at most 2C (the replace-one sensitivity)
    other = clip_to_norm(-rogue, clip)[0].astype(np.float64)
    assert np.linalg.norm(base + other - with_rogue) <= 2 * clip * (1 + 1e-12)


def test_bad_inputs_are_refused_in_one_line():
    with pytest.raises(ValueError, match="clip 0"):
        clip_to_norm(np.ones(3), 0)
    with pytest.raises(ValueError, match="inf or nan"):
        clip_to_norm(np.array([1.0, np.nan]), 1.0)
    with pytest.raises(ValueError, match="std -1"):
        gaussian_noise(3, -1.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="reporting_sites 0"):
        noise_share_std(1.0, 1.0, 0)


def test_noise_std_is_sigma_times_c_within_a_stated_tolerance():
    # n draws of N(0, s^2): the sample std's relative standard error is 1/sqrt(2n) ~ 0.0011 at n = 4e5; 5 of them
    n, sigma, clip = 400_000, 1.3, 0.7
    draws = gaussian_noise(n, noise_std(sigma, clip), noise_generator(5, 0))
    assert draws.dtype == np.float32
    assert float(np.std(draws.astype(np.float64))) == pytest.approx(sigma * clip, rel=5 / math.sqrt(2 * n))
    assert abs(float(np.mean(draws.astype(np.float64)))) < 5 * sigma * clip / math.sqrt(n)


def test_noise_is_the_float64_draw_rounded_once():
    a = gaussian_noise((4, 5), 2.5, noise_generator(1, 2, 3))
    wide = noise_generator(1, 2, 3).standard_normal((4, 5), dtype=np.float64) * 2.5
    np.testing.assert_array_equal(a, wide.astype(np.float32))
    assert not gaussian_noise(7, 0.0, noise_generator(1, 2)).any()


def test_shares_of_m_sites_sum_to_the_server_noise_variance():
    sigma, clip, m, n = 1.1, 2.0, 5, 200_000
    assert noise_share_std(sigma, clip, m) == pytest.approx(sigma * clip / math.sqrt(m), rel=1e-15)
    total = sum(gaussian_noise(n, noise_share_std(sigma, clip, m), noise_generator(9, 4, site)).astype(np.float64)
                for site in range(m))
    assert float(np.var(total)) == pytest.approx((sigma * clip) ** 2, rel=5 * math.sqrt(2 / n))
    assert noise_share_std(sigma, clip, 1) == noise_std(sigma, clip)


def test_same_seed_round_and_site_replay_the_noise_and_any_other_key_does_not():
    def draw(*key):
        return gaussian_noise(100, 1.0, noise_generator(*key))

    np.testing.assert_array_equal(draw(3, 7, 1), draw(3, 7, 1))
    np.testing.assert_array_equal(draw(3, 7), draw(3, 7, None))
    others = [draw(4, 7, 1), draw(3, 8, 1), draw(3, 7, 2), draw(3, 7), draw(3, 7, 0)]
    for other in others:
        assert not np.array_equal(other, draw(3, 7, 1))
    assert not np.array_equal(draw(3, 7), draw(3, 7, 0))  # the server's stream is no site's
    # a stream of its own: not the client sampler's default_rng([seed, round])
    sampler = np.random.default_rng([3, 7]).standard_normal(100).astype(np.float32)
    assert not np.array_equal(draw(3, 7), sampler)


def test_no_seed_draws_fresh_noise():
    assert not np.array_equal(gaussian_noise(50, 1.0, noise_generator(None, 0)),
                              gaussian_noise(50, 1.0, noise_generator(None, 0)))
