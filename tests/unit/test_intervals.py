"""Confidence intervals of evaluation reports, on hand-computed cases."""
import math

import pytest

from spanrl.core import intervals


def test_wilson_hand_computed():
    # z = 1.959964; 0/10: centre = (z²/20)/(1+z²/10) = 0.13877 = half-width
    iv = intervals.wilson_interval(0, 10)
    assert iv.estimate == 0.0
    assert iv.low == 0.0
    assert iv.high == pytest.approx(0.27753, abs=1e-5)
    # 5/10: centre 0.5, half = z*sqrt(0.025 + z²/400)/(1 + z²/10) = 0.26335
    iv = intervals.wilson_interval(5, 10)
    assert (iv.low, iv.high) == (pytest.approx(0.23659, abs=1e-5), pytest.approx(0.76341, abs=1e-5))
    # 10/10 mirrors 0/10
    iv = intervals.wilson_interval(10, 10)
    assert iv.high == 1.0 and iv.low == pytest.approx(1 - 0.27753, abs=1e-5)
    # 20/200 = 0.1: centre 0.10754, half 0.04187 -> [0.06567, 0.14941]
    iv = intervals.wilson_interval(20, 200)
    assert (iv.low, iv.high) == (pytest.approx(0.06567, abs=1e-5), pytest.approx(0.14941, abs=1e-5))
    assert iv.n == 200 and iv.method == "wilson"


@pytest.mark.parametrize("k,n", [(0, 0), (-1, 5), (6, 5)])
def test_wilson_rejects_bad_counts(k, n):
    with pytest.raises(ValueError):
        intervals.wilson_interval(k, n)


def test_percentile_linear():
    v = [0.0, 1.0, 2.0, 3.0]
    assert intervals.percentile(v, 0.0) == 0.0
    assert intervals.percentile(v, 1.0) == 3.0
    assert intervals.percentile(v, 0.5) == 1.5
    assert intervals.percentile(v, 0.25) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        intervals.percentile([], 0.5)


def test_bootstrap_constant_values_zero_width():
    iv = intervals.bootstrap_mean_interval([0.4] * 7)
    assert (iv.estimate, iv.low, iv.high, iv.n) == (pytest.approx(0.4), pytest.approx(0.4), pytest.approx(0.4), 7)


def test_bootstrap_matches_exact_distribution_for_two_points():
    # values {0, 1}: the exact bootstrap distribution of the mean is 0 (1/4), 0.5 (1/2), 1 (1/4),
    # so the 2.5% and 97.5% percentiles are 0 and 1 and ~half the resamples equal 0.5
    means = intervals.bootstrap_means([0.0, 1.0], resamples=4000, seed=3)
    assert set(means) == {0.0, 0.5, 1.0}
    assert abs(means.count(0.5) / 4000 - 0.5) < 0.03
    iv = intervals.bootstrap_mean_interval([0.0, 1.0], resamples=4000, seed=3)
    assert (iv.estimate, iv.low, iv.high) == (0.5, 0.0, 1.0)


def test_bootstrap_close_to_normal_theory_for_large_n():
    # 100 values, 30 ones: mean 0.3, sd/sqrt(n) = sqrt(.21/100) = 0.0458 -> ±0.0898
    vals = [1.0] * 30 + [0.0] * 70
    iv = intervals.bootstrap_mean_interval(vals, resamples=4000, seed=1)
    assert iv.low == pytest.approx(0.3 - 0.0898, abs=0.015)
    assert iv.high == pytest.approx(0.3 + 0.0898, abs=0.015)
    # deterministic for a seed
    assert intervals.bootstrap_mean_interval(vals, resamples=4000, seed=1) == iv
    with pytest.raises(ValueError):
        intervals.bootstrap_mean_interval([])


def test_paired_difference_hand_computed():
    a = [0.0, 0.0, 1.0, 0.0]
    b = [1.0, 0.0, 1.0, 1.0]
    iv = intervals.paired_difference(a, b, resamples=3000, seed=0)
    # diffs [1, 0, 0, 1]: mean 0.5; exact bootstrap support {0, .25, .5, .75, 1}
    assert iv.estimate == 0.5 and iv.n == 4 and iv.method == "paired-bootstrap"
    # P(mean = 0) = (1/2)^4 = 1/16 > 2.5%: the lower end is 0, the upper 1
    assert iv.low == 0.0 and iv.high == 1.0
    # a shared task effect cancels: b = a + 0.1 exactly -> zero-width interval at 0.1
    a2 = [0.0, 0.9, 0.3, 1.0, 0.5]
    iv2 = intervals.paired_difference(a2, [x + 0.1 for x in a2])
    assert iv2.low == pytest.approx(0.1) and iv2.high == pytest.approx(0.1)
    assert iv2.excludes_zero_above()
    with pytest.raises(ValueError):
        intervals.paired_difference([1.0], [1.0, 2.0])


def test_exact_support_of_paired_resamples():
    # every resample mean of diffs [1, 0, 0, 1] is k/4
    means = intervals.bootstrap_means([1.0, 0.0, 0.0, 1.0], resamples=500, seed=2)
    assert set(means) <= {k / 4 for k in range(5)}
    assert all(math.isclose(m * 4, round(m * 4)) for m in means)
