"""The tracked scalars of an update and the trackers (spanrl.trainer.tracking)."""
from __future__ import annotations

import pytest

from spanrl.trainer import tracking


def sample(reward: float, advantage: float, group: str, group_std: float, version: int) -> dict:
    return {"transition": {"reward": reward, "episode_return": reward, "policy_version": version},
            "advantage": advantage, "group_id": group, "group_std": group_std}


SAMPLES = [sample(1.0, 1.0, "t1/0", 0.5, 3), sample(0.0, -1.0, "t1/0", 0.5, 2),
           sample(0.5, 0.0, "t2/0", 0.0, 3), sample(0.5, 0.0, "t2/0", 0.0, 1)]
METRICS = {"loss": -0.25, "approx_kl": 0.01, "clip_frac": 0.125, "grad_norm": 2.0, "lr": 5e-5,
           "advantage_std": 0.5, "mean_advantage": 0.0, "tokens_per_s": 150.0, "samples": 4, "update_s": 3.5,
           "mean_return": 0.5, "loss_agg": "token_mean", "weighted_advantage": float("nan")}


def test_update_scalars_exact():
    assert tracking.update_scalars(METRICS, SAMPLES, trained_version=3) == {
        "train/loss": -0.25, "train/approx_kl": 0.01, "train/clip_fraction": 0.125, "train/grad_norm": 2.0,
        "train/lr": 5e-5, "train/advantage_std": 0.5, "train/mean_advantage": 0.0, "train/tokens_per_s": 150.0,
        "train/samples": 4.0, "train/update_s": 3.5, "train/mean_return": 0.5,
        "reward/mean": 0.5, "reward/std": pytest.approx(0.3535533905932738),  # sqrt(0.125)
        "train/zero_variance_group_fraction": 0.5,  # t2/0 has group_std 0
        "policy/version": 3.0,
        "policy/version_lag_min": 0.0, "policy/version_lag_mean": 0.75, "policy/version_lag_max": 2.0,
    }


def test_update_scalars_leave_out_missing_and_non_finite_values():
    assert tracking.update_scalars({"loss": float("inf"), "grad_norm": None}, [], trained_version=0) == {
        "policy/version": 0.0}


def test_version_lag_from_the_update_when_it_reports_one():
    got = tracking.update_scalars({"version_lag": {"min": 1, "max": 4, "mean": 2.5}}, SAMPLES, trained_version=3)
    assert {k: v for k, v in got.items() if k.startswith("policy/version_lag")} == {
        "policy/version_lag_min": 1.0, "policy/version_lag_max": 4.0, "policy/version_lag_mean": 2.5}
    got = tracking.update_scalars({"version_lag": 2}, SAMPLES, trained_version=3)
    assert got["policy/version_lag"] == 2.0 and "policy/version_lag_max" not in got


def test_version_lag_and_zero_variance_groups():
    assert tracking.version_lag(5, [5, 4, 1]) == {"min": 0.0, "mean": pytest.approx(5 / 3), "max": 4.0}
    assert tracking.version_lag(5, []) == {}
    assert tracking.zero_variance_group_fraction([]) == 0.0
    assert tracking.zero_variance_group_fraction(SAMPLES[:2]) == 0.0


def test_make_tracker_refuses_an_unknown_kind_and_none_logs_nothing(tmp_path):
    with pytest.raises(ValueError, match="SPANRL_TRACKER"):
        tracking.make_tracker("neptune", tmp_path, "r")
    t = tracking.make_tracker("none", tmp_path, "r")
    t.log({"train/loss": 1.0}, 1)
    t.close()
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_tracker_writes_scalars_event_accumulator_reads(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = tracking.make_tracker("tensorboard", tmp_path / "r" / "trainer", "r")
    t.log({"train/loss": -0.5, "reward/mean": 0.25}, 1)
    t.log({"train/loss": 0.75}, 2)
    t.close()
    acc = EventAccumulator(str(tmp_path / "r" / "trainer"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["reward/mean", "train/loss"]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, -0.5), (2, 0.75)]


def test_iteration_scalars_of_a_main_job_iteration():
    result = {"iteration": 2, "rollouts": 36, "rollouts_failed": 1, "transitions": 70, "samples": 70,
              "dead_letters": 2, "mean_reward": 0.25, "format_rate": 0.5, "correct_rate": 0.125, "tool_use_rate": 1.0,
              "zero_variance_groups": 3, "groups": 6, "policy_versions_served": [1, 2], "wall_s": 80.5,
              "agents": {"math_agent": {"calls": 70}}}
    assert tracking.iteration_scalars(result) == {
        "main_job/mean_reward": 0.25, "main_job/correct_rate": 0.125, "main_job/format_rate": 0.5,
        "main_job/tool_use_rate": 1.0, "main_job/rollouts": 36.0, "main_job/rollouts_failed": 1.0,
        "main_job/transitions": 70.0, "main_job/samples": 70.0, "main_job/dead_letters": 2.0, "main_job/wall_s": 80.5,
        "main_job/zero_variance_group_fraction": 0.5, "policy/version_served": 2.0}
    assert tracking.iteration_scalars({"iteration": 0, "groups": 0, "policy_versions_served": []}) == {}


def iv(x: float) -> dict:
    return {"estimate": x, "low": x - 0.1, "high": x + 0.1, "n": 10, "level": 0.95, "method": "m"}


def test_report_scalars_by_policy_version():
    report = {"policies": {
        "base": {"version": 0, "episodes": 200, "mean_reward": iv(0.2), "success_rate": iv(0.1), "format_rate": iv(0.9),
                 "tool_use_rate": None, "mean_llm_calls": iv(2.0)},
        "run:7": {"version": 7, "episodes": 200, "mean_reward": iv(0.3), "success_rate": iv(0.25), "format_rate": iv(1.0),
                  "tool_use_rate": iv(0.5), "mean_llm_calls": iv(2.5)}},
        "paired": {"run:7 - base": {"mean_reward": iv(0.1), "success_rate": iv(0.15), "tasks": 200}}}
    assert tracking.report_scalars(report) == {
        0: {"eval/episodes": 200.0, "eval/mean_reward": 0.2, "eval/success_rate": 0.1, "eval/format_rate": 0.9,
            "eval/mean_llm_calls": 2.0},
        7: {"eval/episodes": 200.0, "eval/mean_reward": 0.3, "eval/success_rate": 0.25, "eval/format_rate": 1.0,
            "eval/tool_use_rate": 0.5, "eval/mean_llm_calls": 2.5, "eval/paired_mean_reward": 0.1,
            "eval/paired_success_rate": 0.15}}


def test_log_once_writes_under_run_and_who_and_never_raises(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from spanrl.core.settings import Settings

    s = Settings(tracker="tensorboard", tracker_dir=tmp_path)
    tracking.log_once(s, "demo-1", "eval/heldout-greedy", {7: {"eval/mean_reward": 0.3}, 0: {"eval/mean_reward": 0.2}})
    acc = EventAccumulator(str(tmp_path / "demo-1" / "eval" / "heldout-greedy"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("eval/mean_reward")] == [(0, 0.2), (7, 0.3)]
    tracking.log_once(Settings(tracker="neptune", tracker_dir=tmp_path), "r", "x", {0: {"a": 1.0}})
    assert "tracking r/x failed" in caplog.text
