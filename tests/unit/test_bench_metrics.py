"""bench.metrics: the sustained benchmark's pure helpers, exact values."""
import math

import pytest

from bench import metrics as M


def test_steady_window_cuts_first_and_last_tenth():
    assert M.steady_window(10.0, 110.0) == (20.0, 100.0)
    assert M.steady_window(0.0, 8.0, trim=0.25) == (2.0, 6.0)
    assert M.steady_window(5.0, 5.0) == (5.0, 5.0)


@pytest.mark.parametrize("args", [(2.0, 1.0), (0.0, 1.0, 0.5), (0.0, 1.0, -0.1)])
def test_steady_window_rejects_bad_input(args):
    with pytest.raises(ValueError):
        M.steady_window(*args)


def test_value_at_interpolates_and_clamps():
    s = [(0.0, 0), (2.0, 10), (4.0, 10), (5.0, 30)]
    assert M.value_at(s, -1.0) == 0.0
    assert M.value_at(s, 1.0) == 5.0
    assert M.value_at(s, 3.0) == 10.0
    assert M.value_at(s, 4.5) == 20.0
    assert M.value_at(s, 9.0) == 30.0
    with pytest.raises(ValueError):
        M.value_at([], 0.0)


def test_rate_in_window():
    s = [(0.0, 0), (10.0, 1000)]
    assert M.rate_in_window(s, 1.0, 9.0) == 100.0
    assert math.isnan(M.rate_in_window(s, 3.0, 3.0))
    assert math.isnan(M.rate_in_window([], 0.0, 1.0))


def test_steady_rate_starts_at_the_first_increase_and_trims():
    # idle until t=10, then 50/s until t=20, then 0 until t=30 (a drain tail)
    s = [(0.0, 0), (10.0, 0), (20.0, 500), (30.0, 500)]
    r = M.steady_rate(s)
    assert r["window_s"] == [12.0, 28.0]
    assert r["rate_per_s"] == (500 - 100) / 16.0
    assert math.isnan(M.steady_rate([(0.0, 3), (1.0, 3)])["rate_per_s"])
    assert math.isnan(M.steady_rate([])["rate_per_s"])


def test_percentile_nearest_rank():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert M.percentile(xs, 0.5) == 3.0
    assert M.percentile(xs, 0.0) == 1.0
    assert M.percentile(xs, 1.0) == 5.0
    assert M.percentile(list(range(101)), 0.99) == 99
    assert M.percentile(xs, 0.9) == 5.0  # index round(3.6) = 4
    assert math.isnan(M.percentile([], 0.5))
    with pytest.raises(ValueError):
        M.percentile(xs, 1.5)


def test_consumer_lag_sums_partitions_and_counts_uncommitted_from_beginning():
    end = {("spans", 0): 100, ("spans", 1): 50, ("spans", 2): 7, ("spans", 3): 0}
    committed = {("spans", 0): 90, ("spans", 1): None, ("spans", 3): 0, ("other", 0): 5}
    assert M.consumer_lag(end, committed) == 10 + 50 + 7 + 0
    assert M.consumer_lag(end, committed, begin_offsets={("spans", 1): 40, ("spans", 2): 7}) == 10 + 10 + 0
    # a committed offset past the end (transaction markers) is no negative lag
    assert M.consumer_lag({("t", 0): 10}, {("t", 0): 11}) == 0
    assert M.consumer_lag({("t", 0): 10}, {("t", 0): -1}) == 10


def test_pace_schedule_and_rollouts_for():
    assert M.pace_schedule(0, 100.0, 512, 1000.0) == 100.0
    assert M.pace_schedule(3, 100.0, 512, 1000.0) == 100.0 + 1.536
    assert M.pace_schedule(10, 0.0, 64, 32.0) == 20.0
    with pytest.raises(ValueError):
        M.pace_schedule(1, 0.0, 512, 0.0)
    with pytest.raises(ValueError):
        M.pace_schedule(-1, 0.0, 512, 10.0)
    assert M.rollouts_for(1000.0, 300.0, 8) == 37500
    assert M.rollouts_for(1000.0, 20.0, 8) == 2500
    assert M.rollouts_for(10.0, 1.0, 8) == 2
    with pytest.raises(ValueError):
        M.rollouts_for(1000.0, 0.0, 8)


def test_cpu_us_per_span():
    assert M.cpu_us_per_span(1.5, 3000) == 500.0
    assert math.isnan(M.cpu_us_per_span(1.0, 0))


def test_exporters_for_rounds_up_to_a_multiple_of_the_bridges():
    from argparse import Namespace

    from bench.sustained import exporters_for

    assert exporters_for(Namespace(exporters=None, mode="sustained"), 1) == 1
    assert exporters_for(Namespace(exporters=None, mode="sustained"), 2) == 2
    assert exporters_for(Namespace(exporters=None, mode="rate"), 1) == 4
    assert exporters_for(Namespace(exporters=None, mode="rate"), 3) == 6
    assert exporters_for(Namespace(exporters=3, mode="sustained"), 2) == 4


def test_memory_trend_fits_after_the_warm_up():
    # 100 MiB until t=10 (warm-up), then 200 + 1 MiB per 100 s: slope 36 MiB/h, growth 3 MiB over 300 s
    pts = [(0.0, 100.0), (5.0, 150.0)] + [(10.0 + 100 * i, 200.0 + i) for i in range(4)]
    tr = M.memory_trend(pts, warmup_s=10.0)
    assert tr["slope_mib_per_h"] == pytest.approx(36.0)
    assert tr["growth_mib"] == pytest.approx(3.0)
    assert (tr["mean_mib"], tr["first_mib"], tr["last_mib"], tr["window_s"], tr["samples"]) == (
        201.5, 200.0, 203.0, 300.0, 4)
    assert M.is_flat(tr)                              # 3 MiB <= max(5 % of 201.5, 16)
    assert not M.is_flat(tr, tolerance_frac=0.01, tolerance_mib=2.0)
    assert M.is_flat(M.memory_trend([(0, 500.0), (60, 400.0)], 0))   # shrinking is flat
    short = M.memory_trend([(0.0, 1.0), (1.0, 2.0)], warmup_s=1.0)
    assert math.isnan(short["slope_mib_per_h"]) and short["samples"] == 1 and not M.is_flat(short)
    with pytest.raises(ValueError, match="warmup_s"):
        M.memory_trend(pts, -1)


def test_soak_checks_and_tasks():
    from bench import soak

    assert [soak.task_of(i) for i in (0, 3, 4, 9)] == ["task-0", "task-0", "task-1", "task-2"]
    flat = M.memory_trend([(0, 100.0), (100, 101.0)], 0) | {"flat": True}
    res = {"expected": {"calls_in": 10}, "transitions": 10, "samples_out": 9, "warm_up": {"rollouts": 2, "samples": 10},
           "workload": {"shape": {"llm_calls": 5}}, "trainer": {"samples_received": 19, "updates": 2},
           "duplicates": {"transitions": 0, "samples": 1}, "dead_letters_total": {},
           "rate_behind_max_s": 61.0, "memory": {"worker0": flat}}
    c = soak.checks(res)
    assert {k: v["ok"] for k, v in c.items()} == {
        "transitions_out": True, "samples_out": False, "warm_up_samples": True, "trainer_received": True,
        "no_duplicates": False, "no_dead_letters": True, "rate_kept": False, "memory_flat_worker0": True}
    assert c["samples_out"]["detail"] == "9 of 10"


def test_prefix_tree_tokens_share_within_an_attempt_only():
    from bench.prefix_merge_recorded import common_prefix, tree_tokens

    def call(rollout, index, prompt, completion):
        return {"transition": {"rollout_id": rollout, "attempt_id": "a0", "call_index": index,
                               "prompt_token_ids": prompt, "completion_token_ids": completion}}

    samples = [call("r1", 1, [1, 2, 3, 4, 9], [5, 6]),  # extends call 0: 3 new tokens
               call("r1", 0, [1, 2, 3], [4]),  # 4 tokens
               call("r1", 2, [1, 2, 7], [8]),  # another role: shares [1, 2] only -> 2 new
               call("r2", 0, [1, 2, 3], [4])]  # another attempt shares nothing -> 4
    assert common_prefix([1, 2, 3], [1, 2, 7, 8]) == 2
    assert tree_tokens(samples) == 4 + 3 + 2 + 4


def test_max_rel_diff_skips_figures_the_first_run_lacks():
    from bench.metrics import max_rel_diff

    assert max_rel_diff({"x": 2.0, "y": None}, {"x": 2.5, "y": 1.0}, ("x", "y")) == 0.25
    assert max_rel_diff({"x": 0.0}, {"x": 1e-13}, ("x",)) == pytest.approx(0.1)
