import dataclasses
"""Production rollouts (agents no runner launched): the proxy's header rule, the assembler's
begin/end, the trainer's advantage for a group of one."""
import pytest
import torch

from spanrl.core import production
from spanrl.core.edge import BadRequest
from spanrl.schemas import codec
from spanrl.stream_jobs import assembly, grouping
from spanrl.trainer import losses

S = 1000
CFG = assembly.AssemblyConfig(reward_timeout_s=10, rollout_timeout_s=100, settle_s=2, production_idle_s=30)


# ---------------------------------------------------------------- proxy headers -> rollout
def test_headers_give_rollout_task_and_group_size():
    r = production.production_rollout({"x-spanrl-rollout-id": "chat-42", "x-spanrl-task": "faq/refunds",
                                       "x-spanrl-group-size": "3"})
    assert r == production.ProductionRollout("chat-42", "faq/refunds", 3, minted=False)
    assert production.span_attributes(r) == {"spanrl.origin": "production", "spanrl.task_id": "faq/refunds",
                                             "spanrl.group_size": "3"}


def test_no_headers_mints_a_rollout_that_is_its_own_group_of_one():
    r = production.production_rollout({}, mint=lambda: "prod-0001")
    assert r == production.ProductionRollout("prod-0001", "prod-0001", 1, minted=True)
    minted = production.mint_rollout_id()
    assert minted.startswith("prod-") and len(minted) == 37 and minted != production.mint_rollout_id()


def test_a_rollout_header_without_task_is_a_group_of_one_under_its_own_id():
    r = production.production_rollout({"x-spanrl-rollout-id": " chat-7 "})
    assert (r.rollout_id, r.task_id, r.group_size, r.minted) == ("chat-7", "chat-7", 1, False)


@pytest.mark.parametrize("headers, param", [
    ({"x-spanrl-rollout-id": ""}, "x-spanrl-rollout-id"),
    ({"x-spanrl-rollout-id": "has space"}, "x-spanrl-rollout-id"),
    ({"x-spanrl-rollout-id": "-leading-dash"}, "x-spanrl-rollout-id"),
    ({"x-spanrl-rollout-id": "x" * 129}, "x-spanrl-rollout-id"),
    ({"x-spanrl-task": "a|b"}, "x-spanrl-task"),
    ({"x-spanrl-group-size": "0"}, "x-spanrl-group-size"),
    ({"x-spanrl-group-size": "two"}, "x-spanrl-group-size"),
    ({"x-spanrl-group-size": "-1"}, "x-spanrl-group-size"),
])
def test_bad_headers_are_400_naming_the_header(headers, param):
    with pytest.raises(BadRequest) as exc:
        production.production_rollout(headers, mint=lambda: "prod-1")
    assert (exc.value.status, exc.value.reason, exc.value.param) == (400, "invalid_rollout_header", param)


def test_rollout_from_span_reads_only_what_the_proxy_wrote():
    assert production.rollout_from_span({"spanrl.origin": "production", "spanrl.task_id": "t",
                                         "spanrl.group_size": "2"}) == ("t", 2)
    assert production.rollout_from_span({"spanrl.origin": "production", "spanrl.task_id": "t"}) == ("t", 1)
    assert production.rollout_from_span({"spanrl.task_id": "t"}) is None  # a runner's call
    assert production.rollout_from_span(None) is None
    assert production.rollout_from_span({"spanrl.origin": "production", "spanrl.task_id": ""}) is None
    assert production.rollout_from_span({"spanrl.origin": "production", "spanrl.task_id": "t",
                                         "spanrl.group_size": "0"}) is None


# ---------------------------------------------------------------- assembler: begin and end
def call(sid, seq, task="faq", size="1", completion=(5, 6)):
    return {"rollout_id": "chat-1", "attempt_id": "0", "sequence_id": seq, "span_id": sid, "kind": "llm",
            "agent_name": None, "source": "proxy",
            "attributes": {"spanrl.origin": "production", "spanrl.task_id": task, "spanrl.group_size": size},
            "llm": {"model": "policy", "policy_version": 2, "prompt_token_ids": [1, seq],
                    "completion_token_ids": list(completion), "completion_logprobs": [-0.5] * len(completion),
                    "request_id": sid}}


def reward(value, final=True):
    return {"rollout_id": "chat-1", "attempt_id": "0", "value": value, "final": final, "timestamp_ms": 1}


def run(events, until_s, cfg=CFG):
    """Feed (t_seconds, kind, record) events, with a tick every second up to until_s."""
    state, store, out = assembly.new_state("chat-1"), {}, assembly.Outcome()
    ticks = [(t, "tick", None) for t in range(int(until_s) + 1)]
    for t, kind, rec in sorted(events + ticks, key=lambda e: (e[0], e[1] == "tick")):
        now = int(t * S)
        if kind == "span":
            out.extend(assembly.add_span(state, rec, store, cfg, now))
        elif kind == "reward":
            out.extend(assembly.add_reward(state, rec, now))
        elif kind == "life":
            out.extend(assembly.add_rollout_event(state, rec, now))
        out.extend(assembly.advance(state, store, cfg, now))
    return out, state, store


def test_a_final_reward_ends_a_production_rollout_and_its_calls_train():
    out, state, store = run([(0, "span", call("c0", 0)), (1, "span", call("c1", 1, completion=(7,))),
                             (20, "reward", reward(1.0))], until_s=25)
    assert out.dead_letters == []
    assert [(t["span_id"], t["task_id"], t["group_size"], t["reward"], t["status"], t["call_index"])
            for t in out.transitions] == [("c0", "faq", 1, 1.0, "succeeded", 0), ("c1", "faq", 1, 1.0, "succeeded", 1)]
    a = state["attempts"]["0"]
    # ended at the reward (t=20), emitted settle_s (2 s) later
    assert (a["production"], a["ended_ms"], a["done"], a["done_ms"]) == (True, 20 * S, "emitted", 22 * S)
    assert store == {}
    for t in out.transitions:
        assert codec.decode("transition", codec.encode("transition", t)) == t


def test_an_intermediate_reward_does_not_end_it():
    out, state, _ = run([(0, "span", call("c0", 0)), (5, "reward", reward(0.5, final=False))], until_s=20)
    assert out.transitions == [] and out.dead_letters == [] and state["attempts"]["0"]["status"] is None


def test_idle_ends_it_then_a_reward_within_reward_timeout_still_trains():
    # last input t=3; idle 30 s -> ended at t=33; reward at t=40 (< 33 + 10) -> emitted at 42
    out, state, _ = run([(0, "span", call("c0", 0)), (3, "span", call("c1", 1)),
                         (40, "reward", reward(-1.0))], until_s=45)
    a = state["attempts"]["0"]
    assert (a["status"], a["error"], a["ended_ms"]) == ("succeeded", "idle 30s", 33 * S)
    assert [(t["span_id"], t["reward"]) for t in out.transitions] == [("c0", -1.0), ("c1", -1.0)]
    assert (a["done"], a["done_ms"]) == ("emitted", 42 * S)


def test_idle_end_without_reward_parks_then_without_a_window_is_dead_lettered():
    out, state, _ = run([(0, "span", call("c0", 0))], until_s=45)
    assert out.transitions == [] and out.dead_letters == []  # idle end at 30, parked at 40 (late rewards)
    assert state["attempts"]["0"]["parked_ms"] == 40 * S
    no_window = dataclasses.replace(CFG, reward_window_s=0)
    out, state, _ = run([(0, "span", call("c0", 0))], until_s=45, cfg=no_window)
    assert out.transitions == []
    assert [(d["reason"], d["rollout_id"], d["task_id"]) for d in out.dead_letters] == [
        ("no_reward_before_timeout", "chat-1", "faq")]
    assert state["attempts"]["0"]["done_ms"] == 40 * S


def test_an_explicit_end_from_the_bridge_keeps_the_calls_task():
    # the bridge's end event knows no task (""), group size 0: the calls' label wins, whatever the order
    end = {"rollout_id": "chat-1", "attempt_id": "0", "task_id": "", "status": "succeeded", "group_size": 0}
    out, state, _ = run([(0, "life", end), (1, "span", call("c0", 0, task="faq", size="2")),
                         (2, "reward", reward(0.25))], until_s=10)
    assert [(t["task_id"], t["group_size"], t["reward"]) for t in out.transitions] == [("faq", 2, 0.25)]
    assert state["attempts"]["0"]["ended_ms"] == 0  # the explicit end, not the reward


def test_an_explicit_end_consumed_after_the_rating_still_gives_the_status():
    """The bridge's end (failed) was sent first, but Kafka delivered the rating first (other
    topic): the attempt ended at the rating (inferred succeeded); the explicit end, consumed
    before the emission, sets the status. After the emission it changes nothing."""
    end = {"rollout_id": "chat-1", "attempt_id": "0", "task_id": "", "status": "failed", "group_size": 0,
           "error": "user closed the chat"}
    out, state, _ = run([(0, "span", call("c0", 0)), (5, "reward", reward(0.0)), (5.5, "life", end)], until_s=10)
    assert [(t["status"], t["reward"]) for t in out.transitions] == [("failed", 0.0)]
    assert (state["attempts"]["0"]["error"], state["attempts"]["0"]["done_ms"]) == ("user closed the chat", 7 * S)
    late, state, _ = run([(0, "span", call("c0", 0)), (5, "reward", reward(0.0)), (9, "life", end)], until_s=10)
    assert [t["status"] for t in late.transitions] == ["succeeded"] and state["attempts"]["0"]["error"] is None


def test_a_runners_rollout_is_not_ended_by_its_reward():
    runner_call = {**call("c0", 0), "attributes": {}}
    out, state, _ = run([(0, "span", runner_call), (1, "reward", reward(1.0))], until_s=50)
    a = state["attempts"]["0"]
    assert out.transitions == [] and out.dead_letters == [] and a["status"] is None and "production" not in a


# ---------------------------------------------------------------- grouping and the trainer
def test_a_group_of_one_gets_the_batch_baseline_in_the_trainer():
    out, _, _ = run([(0, "span", call("c0", 0, task="prod-a")), (1, "reward", reward(1.0))], until_s=5)
    g_state, g_store = grouping.new_state("prod-a"), {}
    [tr] = out.transitions
    samples = grouping.add_transition(g_state, tr, g_store, grouping.GroupingConfig(), 5 * S).samples
    assert [(s["group_id"], s["group_rollouts"], s["advantage"]) for s in samples] == [("prod-a/0", 1, 0.0)]
    # returns 1, 0 (groups of one) and 2, 0 (a group of two with GRPO advantages +1, -1):
    # batch mean 0.75, population std sqrt(0.6875)
    adv = losses.singleton_batch_advantages(torch.tensor([0.0, 0.0, 1.0, -1.0]), torch.tensor([1.0, 0.0, 2.0, 0.0]),
                                            torch.tensor([1, 1, 2, 2]), eps=0.0)
    std = 0.6875 ** 0.5
    assert adv.tolist() == pytest.approx([0.25 / std, -0.75 / std, 1.0, -1.0], abs=1e-6)


def test_batch_baseline_of_one_sample_is_zero():
    adv = losses.singleton_batch_advantages(torch.tensor([0.0]), torch.tensor([3.0]), torch.tensor([1]))
    assert adv.tolist() == [0.0]


def _sample(R, adv, n):
    return {"transition": {"episode_return": R, "reward": R}, "advantage": adv, "group_rollouts": n}  # identical credit


def test_trainer_update_advantages_by_setting():
    from spanrl.trainer.train import sample_advantages

    batch = [_sample(1.0, 0.0, 1), _sample(0.0, 0.0, 1), _sample(2.0, 1.0, 2), _sample(0.0, -1.0, 2)]
    std = 0.6875 ** 0.5  # returns 1, 0, 2, 0: mean 0.75
    assert sample_advantages(batch) == pytest.approx([0.25 / std, -0.75 / std, 1.0, -1.0], abs=1e-5)
    assert sample_advantages(batch, singleton_advantage="zero") == [0.0, 0.0, 1.0, -1.0]
    assert sample_advantages(batch, "reinforce_pp") == pytest.approx(
        [0.25 / std, -0.75 / std, 1.25 / std, -0.75 / std], abs=1e-5)
    no_field = [{"transition": {"episode_return": 1.0}, "advantage": 0.5}]
    assert sample_advantages(no_field) == [0.5]
    with pytest.raises(ValueError, match="singleton_advantage"):
        sample_advantages(batch, singleton_advantage="mean")
    with pytest.raises(ValueError, match="algorithm"):
        sample_advantages(batch, "ppo")
