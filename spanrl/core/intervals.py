"""95% confidence intervals for evaluation reports: pure functions, no I/O.

- :func:`wilson_interval` for a rate (k successes of n episodes): Wilson (1927), "Probable
  inference, the law of succession, and statistical inference", JASA 22(158); the score
  interval recommended over the Wald interval by Brown, Cai & DasGupta (2001), Stat. Sci.
  16(2), s4.1.
- :func:`bootstrap_mean_interval` for a mean (e.g. mean reward): percentile bootstrap,
  Efron & Tibshirani (1993), "An Introduction to the Bootstrap", ch. 13.
- :func:`paired_difference` for two policies evaluated on the *same* tasks: the per-task
  differences ``b_i - a_i`` resampled as pairs (paired bootstrap, ibid. ch. 13), so the
  task-to-task spread that both policies share cancels out.

Bootstrap intervals use a seeded ``random.Random``: the same inputs give the same interval.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Sequence

#: two-sided 95% normal quantile (1.959963...)
Z95 = NormalDist().inv_cdf(0.975)


@dataclass(frozen=True)
class Interval:
    """A point estimate with its confidence interval ``[low, high]`` at ``level``; ``n`` is
    the number of observations (episodes, or tasks for a paired difference)."""

    estimate: float
    low: float
    high: float
    n: int
    level: float = 0.95
    method: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    def excludes_zero_above(self) -> bool:
        """True when the whole interval lies above 0."""
        return self.low > 0.0


def wilson_interval(successes: int, n: int, z: float = Z95) -> Interval:
    """Wilson score interval for a binomial rate ``successes / n``.

    ``center = (p + z²/2n) / (1 + z²/n)``, ``half = z·sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n)``.
    Raises ValueError for ``n <= 0`` or ``successes`` outside ``[0, n]``. Example: 0 of 10
    gives [0, 0.2775], 5 of 10 gives [0.2366, 0.7634].
    """
    if n <= 0:
        raise ValueError("wilson_interval needs n > 0")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    # at k = 0 (k = n) the lower (upper) end is exactly 0 (1); round-off would leave 1e-17
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == n else min(1.0, center + half)
    return Interval(p, low, high, n, method="wilson")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted values, linear interpolation between
    order statistics (numpy's default "linear" method)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap_means(values: Sequence[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """Sorted means of ``resamples`` resamples (with replacement, same size) of ``values``."""
    n = len(values)
    rng = random.Random(seed)
    means = [sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples)]
    means.sort()
    return means


def bootstrap_mean_interval(values: Sequence[float], resamples: int = 2000, seed: int = 0,
                            level: float = 0.95) -> Interval:
    """Percentile-bootstrap interval of the mean of ``values``.

    Raises ValueError for no values. Constant values give a zero-width interval.
    """
    values = [float(v) for v in values]
    if not values:
        raise ValueError("bootstrap_mean_interval needs at least one value")
    means = bootstrap_means(values, resamples, seed)
    alpha = (1.0 - level) / 2
    return Interval(sum(values) / len(values), percentile(means, alpha), percentile(means, 1.0 - alpha),
                    len(values), level, method="bootstrap")


def paired_difference(a: Sequence[float], b: Sequence[float], resamples: int = 2000, seed: int = 0,
                      level: float = 0.95) -> Interval:
    """Mean of ``b_i - a_i`` over paired observations (the same task under policy a and
    policy b) with its paired percentile-bootstrap interval.

    Raises ValueError when the lengths differ or are zero.
    """
    if len(a) != len(b):
        raise ValueError(f"paired_difference needs equal lengths, got {len(a)} and {len(b)}")
    diffs = [float(y) - float(x) for x, y in zip(a, b)]
    out = bootstrap_mean_interval(diffs, resamples, seed, level)
    return Interval(out.estimate, out.low, out.high, out.n, level, method="paired-bootstrap")


#: two-sided 95% quantiles t_{0.975, df} of Student's t for df = 1..30 (any statistics table,
#: e.g. NIST/SEMATECH e-Handbook of Statistical Methods, 1.3.6.7.2); beyond 30 the normal's
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t_interval(values: Sequence[float]) -> Interval:
    """Student-t 95% interval of the mean of a few independent values (e.g. one paired
    difference per seed): ``mean +- t_{0.975, n-1} * s / sqrt(n)`` with the sample std s
    (ddof 1; Student 1908, Biometrika 6(1)). The spread between runs is what it measures, so
    with 3 seeds t = 4.303 makes it wide. One value: a zero-width interval at it (no spread
    known: ``method`` says so). Raises ValueError for no values. Example: [0.1, 0.2, 0.3] ->
    0.2 +- 4.303 * 0.1 / sqrt(3) = [-0.0484, 0.4484]."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        raise ValueError("t_interval needs at least one value")
    mean = sum(values) / n
    if n == 1:
        return Interval(mean, mean, mean, 1, method="single-value")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = _T975[n - 2] if n - 1 <= len(_T975) else Z95
    half = t * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, method="student-t")


def pooled_paired_difference(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]],
                             resamples: int = 2000, seed: int = 0) -> Interval:
    """Paired difference pooled over runs that evaluated the *same* tasks: ``a[s][i]``,
    ``b[s][i]`` are task i's scores under policies a and b in run s (e.g. base and final of
    seed s). Each task's difference is averaged over the runs, then the tasks are resampled
    as pairs (:func:`paired_difference`'s bootstrap over tasks; Efron & Tibshirani 1993
    ch. 13): the interval of the mean over runs and tasks, with the task-to-task spread as
    its uncertainty (the run-to-run spread is :func:`t_interval`'s). Raises ValueError when
    runs or tasks do not line up. Example: a = [[0, 0], [0, 1]], b = [[1, 0], [1, 1]] ->
    per-task mean differences [1, 0], estimate 0.5."""
    if not a or len(a) != len(b):
        raise ValueError(f"pooled_paired_difference needs the same runs for a and b, got {len(a)} and {len(b)}")
    n = len(a[0])
    if n == 0 or any(len(x) != n for x in (*a, *b)):
        raise ValueError("pooled_paired_difference needs the same non-empty task list in every run")
    per_task = [sum(float(b[s][i]) - float(a[s][i]) for s in range(len(a))) / len(a) for i in range(n)]
    out = bootstrap_mean_interval(per_task, resamples, seed)
    return Interval(out.estimate, out.low, out.high, n, method="pooled-paired-bootstrap")
