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
