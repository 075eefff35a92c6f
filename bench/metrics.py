"""Pure helpers of the sustained benchmark (bench.sustained): steady-state window, rates from
cumulative series, percentiles, consumer lag, fixed-rate pacing. No I/O; unit-tested with
exact values in tests/unit/test_bench_metrics.py.

A *series* is a list of ``(t_s, cumulative_count)`` pairs sorted by ``t_s`` (seconds on one
monotonic clock): e.g. spans acknowledged by the bridge so far, transitions read so far.
"""
from __future__ import annotations

import math
from bisect import bisect_right


def steady_window(t_start: float, t_end: float, trim: float = 0.1) -> tuple[float, float]:
    """The steady-state part of ``[t_start, t_end]``: the first and last ``trim`` of it cut off.

    Returns ``(t_start + trim * d, t_end - trim * d)`` with ``d = t_end - t_start`` (seconds).
    Raises ValueError if ``t_end < t_start`` or ``trim`` is not in ``[0, 0.5)``.
    """
    if t_end < t_start:
        raise ValueError(f"window ends before it starts: {t_start} > {t_end}")
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    d = t_end - t_start
    return t_start + trim * d, t_end - trim * d


def value_at(series: list[tuple[float, float]], t: float) -> float:
    """A cumulative series' value at time ``t``, linearly interpolated between samples.

    Before the first sample: the first value; after the last: the last value.
    Raises ValueError for an empty series.
    """
    if not series:
        raise ValueError("empty series")
    times = [p[0] for p in series]
    i = bisect_right(times, t)
    if i == 0:
        return float(series[0][1])
    if i == len(series):
        return float(series[-1][1])
    (t0, v0), (t1, v1) = series[i - 1], series[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else float(v1)


def rate_in_window(series: list[tuple[float, float]], w0: float, w1: float) -> float:
    """Mean rate (count per second) of a cumulative series over ``[w0, w1]``.

    ``(value_at(w1) - value_at(w0)) / (w1 - w0)``; NaN for an empty or zero-length window.
    """
    if not series or w1 <= w0:
        return float("nan")
    return (value_at(series, w1) - value_at(series, w0)) / (w1 - w0)


def steady_rate(series: list[tuple[float, float]], trim: float = 0.1) -> dict:
    """Rate of a cumulative series over its steady state: the inner ``1 - 2*trim`` of the time
    from its first increase to its last sample (the first/last ``trim`` excluded).

    Returns ``{"rate_per_s", "window_s": [w0, w1]}``; rate NaN when the series never rises.
    """
    first = next((i for i, p in enumerate(series) if p[1] > series[0][1]), None)
    if first is None:
        return {"rate_per_s": float("nan"), "window_s": None}
    start = series[first - 1][0]  # the last sample before the first increase
    w0, w1 = steady_window(start, series[-1][0], trim)
    return {"rate_per_s": rate_in_window(series, w0, w1), "window_s": [w0, w1]}


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile on the sorted sample, index ``round(q * (n - 1))`` (the same rule
    as bench.run.pct, so burst and sustained figures compare). NaN for an empty sample.
    Raises ValueError unless ``0 <= q <= 1``."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def consumer_lag(end_offsets: dict, committed: dict, begin_offsets: dict | None = None) -> int:
    """Records a consumer group has still to consume: ``sum(max(0, end - committed))`` over the
    partitions in ``end_offsets`` (Kafka's lag as ``kafka-consumer-groups --describe`` shows it).

    A partition with no committed offset (``None`` or absent) counts from its beginning offset
    (``begin_offsets``, 0 if not given), as a new group with ``auto_offset_reset=earliest``
    would read it. Offsets are Kafka offsets (the next offset to write / to read).
    """
    begin_offsets = begin_offsets or {}
    lag = 0
    for tp, end in end_offsets.items():
        c = committed.get(tp)
        if c is None or c < 0:
            c = begin_offsets.get(tp, 0)
        lag += max(0, end - c)
    return lag


def pace_schedule(k: int, t0: float, batch_spans: int, spans_per_s: float) -> float:
    """When export batch ``k`` (0-based) is due at a fixed offered rate: ``t0 + k * batch_spans /
    spans_per_s`` (seconds), i.e. batch k carries spans ``[k*batch_spans, (k+1)*batch_spans)``.

    Raises ValueError for a non-positive rate or batch size, or a negative ``k``.
    """
    if spans_per_s <= 0 or batch_spans <= 0 or k < 0:
        raise ValueError(f"need k >= 0, batch_spans > 0, spans_per_s > 0 (got {k}, {batch_spans}, {spans_per_s})")
    return t0 + k * batch_spans / spans_per_s


def rollouts_for(spans_per_s: float, duration_s: float, spans_per_rollout: int) -> int:
    """Rollouts needed to offer ``spans_per_s * duration_s`` spans: the ceiling of that over
    ``spans_per_rollout``. Raises ValueError for a non-positive argument."""
    if spans_per_s <= 0 or duration_s <= 0 or spans_per_rollout <= 0:
        raise ValueError("spans_per_s, duration_s and spans_per_rollout must be > 0")
    return math.ceil(spans_per_s * duration_s / spans_per_rollout)


def cpu_us_per_span(cpu_s: float, spans: int) -> float:
    """CPU microseconds per span: ``cpu_s * 1e6 / spans``; NaN when ``spans`` is 0."""
    return cpu_s * 1e6 / spans if spans else float("nan")


def memory_trend(points: list[tuple[float, float]], warmup_s: float) -> dict:
    """Least-squares line through a process's RSS samples after ``warmup_s``: is its memory flat?

    ``points``: ``(t_s, rss_mib)`` sorted by time, t from the run's start. Returns
    ``{"slope_mib_per_h", "growth_mib"`` (slope x the window's length), ``"mean_mib",
    "first_mib", "last_mib", "window_s", "samples"}``; slope NaN with fewer than 2 samples or a
    zero-length window. Raises ValueError for a negative ``warmup_s``.
    """
    if warmup_s < 0:
        raise ValueError(f"warmup_s must be >= 0, got {warmup_s}")
    pts = [(t, v) for t, v in points if t >= warmup_s]
    n = len(pts)
    if n < 2 or pts[-1][0] <= pts[0][0]:
        nan = float("nan")
        return {"slope_mib_per_h": nan, "growth_mib": nan, "mean_mib": pts[0][1] if pts else nan,
                "first_mib": pts[0][1] if pts else nan, "last_mib": pts[-1][1] if pts else nan,
                "window_s": 0.0, "samples": n}
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    slope = sum((t - mt) * (v - mv) for t, v in pts) / sum((t - mt) ** 2 for t, _ in pts)  # MiB per s
    window = pts[-1][0] - pts[0][0]
    return {"slope_mib_per_h": slope * 3600.0, "growth_mib": slope * window, "mean_mib": mv,
            "first_mib": pts[0][1], "last_mib": pts[-1][1], "window_s": window, "samples": n}


def is_flat(trend: dict, tolerance_frac: float = 0.05, tolerance_mib: float = 16.0) -> bool:
    """Whether a :func:`memory_trend` is flat: the fitted growth over its window is at most
    ``max(tolerance_frac x mean, tolerance_mib)`` MiB (a NaN trend is not flat)."""
    g = trend["growth_mib"]
    return not math.isnan(g) and g <= max(tolerance_frac * trend["mean_mib"], tolerance_mib)


def max_rel_diff(a: dict, b: dict, keys) -> float:
    """Largest ``|a[k] - b[k]| / |a[k]|`` over ``keys`` whose ``a`` value is not None (the
    denominator at least 1e-12): how far two runs of one update that should agree are apart.
    Example: a {x: 2, y: None}, b {x: 2.5, y: 1}, keys (x, y) -> 0.25."""
    return max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in keys if a.get(k) is not None)
