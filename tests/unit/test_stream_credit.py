import math

import pytest

from spanrl.stream_jobs.credit import (InvalidReward, episode_return, grpo_advantages, group_stats,
                                identical_credit, parse_credit_rule)

EPS = 1e-6


def test_identical_credit_gives_R_to_every_call():
    assert identical_credit(0.7, 3) == [0.7, 0.7, 0.7]
    rule = parse_credit_rule("identical")
    assert rule.name == "identical" and rule(0.7, 3) == [0.7, 0.7, 0.7]
    assert parse_credit_rule(None).name == parse_credit_rule("").name == "identical"


def test_scaled_and_discounted_rules():
    assert parse_credit_rule("scaled:0.5")(2.0, 2) == [1.0, 1.0]
    rule = parse_credit_rule("discounted:0.5")
    assert rule.name == "discounted:0.5"
    # call t of T gets gamma^(T-1-t) * R
    assert rule(4.0, 3) == [1.0, 2.0, 4.0]
    assert rule(4.0, 0) == []


@pytest.mark.parametrize("bad", ["nope", "scaled", "scaled:x", "discounted:1.5", "discounted:-0.1",
                                 "scaled:nan", "identical:2"])
def test_unknown_or_malformed_rule_raises(bad):
    with pytest.raises(ValueError):
        parse_credit_rule(bad)


def test_episode_return_is_last_final_reward():
    events = [{"value": 0.2, "final": False}, {"value": 1.0, "final": True},
              {"value": 0.3, "final": False}, {"value": 0.5, "final": True}]
    assert episode_return(events) == 0.5  # intermediate rewards are not added
    assert episode_return([{"value": 0.2, "final": False}]) is None
    assert episode_return([]) is None
    with pytest.raises(InvalidReward):
        episode_return([{"value": math.nan, "final": True}])
    with pytest.raises(InvalidReward):
        episode_return([{"value": math.inf, "final": True}])


def test_grpo_advantages_population_std():
    # mean 0.5, population std 0.5
    assert grpo_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS),
                                                     -0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)]
    # returns [2, 0, 0, 2]: mean 1, std 1 -> [1, -1, -1, 1] / (1 + eps)
    assert grpo_advantages([2.0, 0.0, 0.0, 2.0]) == [1 / (1 + EPS), -1 / (1 + EPS),
                                                     -1 / (1 + EPS), 1 / (1 + EPS)]
    assert grpo_advantages([3.0]) == [0.0]
    assert grpo_advantages([]) == []
    assert grpo_advantages([1.0, 1.0]) == [0.0, 0.0]  # no spread: no signal
    assert group_stats([1.0, 0.0, 0.0, 1.0]) == (0.5, 0.5)


def test_return_to_go_and_own_intermediate_rewards():
    from spanrl.stream_jobs import air
    from spanrl.stream_jobs.credit import return_to_go_credit, with_intermediate

    # G_t = sum_k gamma^(k-t) i_k + gamma^(T-1-t) R: R = 1, i = [-0.1, 0, -0.2], gamma = 0.5
    assert return_to_go_credit(1.0, [-0.1, 0.0, -0.2], 0.5) == pytest.approx([0.1, 0.4, 0.8])
    assert return_to_go_credit(2.0, [0.0, 0.0, 0.0], 0.5) == [0.5, 1.0, 2.0]  # = discounted:0.5
    assert return_to_go_credit(1.0, [0.25, -0.5], 1.0) == [0.75, 0.5]      # gamma 1: R + future i
    assert return_to_go_credit(1.0, [], 0.5) == []
    assert with_intermediate([1.0, 1.0], [-0.25, 0.5]) == [0.75, 1.5]
    with pytest.raises(ValueError):
        with_intermediate([1.0], [0.0, 0.0])
    rule = parse_credit_rule("return_to_go:0.5")
    assert rule.name == "return_to_go:0.5" and rule(2.0, 3) == [0.5, 1.0, 2.0] and rule.air_name == ""
    assert rule(1.0, 3, [-0.1, 0.0, -0.2]) == pytest.approx([0.1, 0.4, 0.8])
    # the other rules add each call's own intermediate reward
    assert parse_credit_rule("identical")(1.0, 2, [-0.25, 0.0]) == [0.75, 1.0]
    assert parse_credit_rule("scaled:0.5")(2.0, 2, [0.25, -0.5]) == [1.25, 0.5]
    assert parse_credit_rule("discounted:0.5")(4.0, 3, [0.0, -1.0, 0.5]) == [1.0, 1.0, 4.5]
    with pytest.raises(ValueError, match="2 intermediate rewards for 3 calls"):
        parse_credit_rule("identical")(1.0, 3, [0.0, 0.0])
    with_air = parse_credit_rule("discounted:0.5").with_air(air.parse_air_rules("tool_error:-0.1"))
    assert (with_air.name, with_air.air_name, with_air(4.0, 3)) == ("discounted:0.5", "tool_error:-0.1", [1.0, 2.0, 4.0])
    for bad in ("return_to_go", "return_to_go:1.5", "return_to_go:x"):
        with pytest.raises(ValueError):
            parse_credit_rule(bad)
