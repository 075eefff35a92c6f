"""The release gate's decision rule on hand-computed cases."""
import pytest

from spanrl.trainer.gate import ACCEPT, REFUSE, gate_decision


def test_equal_policies_are_served():
    inc = {"a": 1.0, "b": 0.1, "c": 0.0}
    d = gate_decision(inc, dict(inc))
    assert d.accept and d.reason == ACCEPT
    assert d.difference["estimate"] == 0.0 and d.difference["low"] == 0.0 and d.difference["high"] == 0.0
    assert (d.incumbent_mean, d.candidate_mean, d.tasks) == (pytest.approx(1.1 / 3), pytest.approx(1.1 / 3), 3)


def test_three_tasks_are_too_few_to_refuse():
    # differences [-1, 0, -1]: P(bootstrap mean = 0) = (1/3)^3 = 3.7% > 2.5% -> upper end 0
    d = gate_decision({"a": 1.0, "b": 0.0, "c": 1.0}, {"a": 0.0, "b": 0.0, "c": 0.0})
    assert d.difference["estimate"] == pytest.approx(-2 / 3)
    assert d.difference["high"] == 0.0
    assert d.accept


def test_clearly_worse_is_refused():
    # differences [-1, 0, -1, -1, 0, -1]: P(mean = 0) = 1/729, P(mean >= -1/6) = 1.8% -> upper < 0
    inc = dict(zip("abcdef", [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]))
    d = gate_decision(inc, {k: 0.0 for k in inc})
    assert not d.accept and d.reason == REFUSE
    assert d.difference["high"] < 0
    # the same drop within a tolerance of 0.7 is served
    assert gate_decision(inc, {k: 0.0 for k in inc}, tolerance=0.7).accept


def test_better_is_served_and_only_shared_tasks_count():
    d = gate_decision({"a": 0.0, "b": 0.0, "x": 1.0}, {"a": 1.0, "b": 1.0, "y": 0.0})
    assert d.accept and d.tasks == 2 and d.difference["estimate"] == 1.0


def test_bad_input():
    with pytest.raises(ValueError):
        gate_decision({"a": 1.0}, {"b": 1.0})
    with pytest.raises(ValueError):
        gate_decision({"a": 1.0}, {"a": 1.0}, tolerance=-0.1)
