"""policy_report: rates and means of reward components (a graded component's rate is not its mean)."""
import pytest

from spanrl.infra.evaluation import EvalError, Episode, policy_report


def _ep(i: int, f1: float, correct: float) -> Episode:
    return Episode(task_id=f"t{i}", rollout_id=f"r{i}", status="succeeded", reward=0.9 * f1 + 0.1,
                   components={"f1": f1, "correct": correct, "format": 1.0}, llm_calls=3)


def test_component_rate_is_share_above_zero_and_mean_is_the_mean():
    eps = [_ep(0, 0.5, 0.0), _ep(1, 1.0, 1.0), _ep(2, 0.0, 0.0), _ep(3, 0.25, 0.0)]
    rep = policy_report(eps)
    assert rep["component_rates"]["f1"]["estimate"] == pytest.approx(0.75)
    assert rep["component_means"]["f1"]["estimate"] == pytest.approx(0.4375)
    # a 0/1 component: rate and mean agree
    assert rep["component_rates"]["correct"]["estimate"] == pytest.approx(0.25)
    assert rep["component_means"]["correct"]["estimate"] == pytest.approx(0.25)
    assert rep["success_rate"]["estimate"] == pytest.approx(0.25)
    assert rep["component_means"]["format"] == {**rep["component_means"]["format"], "estimate": 1.0, "low": 1.0,
                                                 "high": 1.0}
    lo, hi = rep["component_means"]["f1"]["low"], rep["component_means"]["f1"]["high"]
    assert 0.0 <= lo <= 0.4375 <= hi <= 1.0


def test_no_episodes_is_an_error():
    with pytest.raises(EvalError):
        policy_report([])
