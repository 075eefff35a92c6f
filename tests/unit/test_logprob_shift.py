"""The main job's log-prob-shift check (examples/math_agent/main_job.logprob_shift)."""
from __future__ import annotations

import random

import pytest

from examples.math_agent.main_job import logprob_shift, logprob_shift_all, samples_missing


def _sample(adv: float, prompt: list[int], completion: list[int], behaviour: list[float]) -> dict:
    return {"advantage": adv, "transition": {"prompt_token_ids": prompt, "completion_token_ids": completion,
                                             "behaviour_logprobs": behaviour}}


# summed log-prob under the "final" policy: -0.1 per completion token, whatever the prompt;
# one call for every scored completion (the main job sends them to vLLM in batches)
CALLS: list[int] = []


def _final(pairs):
    CALLS.append(len(pairs))
    return [-0.1 * len(completion_ids) for _, completion_ids in pairs]


SAMPLES = [
    _sample(+1.0, [1], [5, 6], [-0.5, -0.3]),          # positive, 2 tokens, behaviour sum -0.8
    _sample(+0.5, [2], [7, 8, 9, 10], [-0.2] * 4),     # positive, 4 tokens, behaviour sum -0.8
    _sample(-1.0, [3], [11], [-0.05]),                 # negative, 1 token
    _sample(0.0, [4], [12, 13], [-1.0, -1.0]),         # zero advantage: in neither
    _sample(+2.0, [5], [], []),                        # no completion tokens: skipped
]


def test_token_weighted_means_over_every_completion_of_each_sign():
    CALLS.clear()
    out = logprob_shift(SAMPLES, _final)
    assert CALLS == [3]  # one batch: the zero-advantage and the empty completion are not scored
    pos, neg = out["positive"], out["negative"]
    assert (pos["completions"], pos["tokens"]) == (2, 6)
    assert pos["mean_logprob_behaviour"] == pytest.approx(-1.6 / 6)
    assert pos["mean_logprob_final"] == pytest.approx(-0.6 / 6)
    assert pos["delta"] == pytest.approx(1.0 / 6)
    assert (neg["completions"], neg["tokens"]) == (1, 1)
    assert neg["delta"] == pytest.approx(-0.1 - -0.05)


def test_the_result_does_not_depend_on_the_order_samples_arrived_in():
    many = [_sample(random.Random(i).choice([-1.0, 1.0]), [i], list(range(1 + i % 5)), [-0.01 * i] * (1 + i % 5))
            for i in range(40)]
    want = logprob_shift(many, _final)
    shuffled = list(many)
    random.Random(7).shuffle(shuffled)
    got = logprob_shift(shuffled, _final)
    assert got.keys() == want.keys() == {"positive", "negative"}
    for sign in want:
        assert got[sign]["completions"] == want[sign]["completions"]
        assert got[sign]["delta"] == pytest.approx(want[sign]["delta"])
    assert want["positive"]["completions"] + want["negative"]["completions"] == 40


def test_a_sign_with_no_samples_is_absent():
    assert logprob_shift([_sample(1.0, [1], [2], [-0.5])], _final).keys() == {"positive"}
    CALLS.clear()
    assert logprob_shift([], _final) == {}
    assert CALLS == []  # nothing to score: no request


def _account(rollout, outcome, calls):
    return {"rollout_id": rollout, "outcome": outcome, "calls": [{"span_id": sid, "trained": t} for sid, t in calls]}


def _s(rollout, span):
    return {"transition": {"rollout_id": rollout, "span_id": span}}


def test_samples_missing_waits_for_every_trained_call_of_a_group():
    accounts = [_account("r1", "emitted", [("a", True), ("b", True), ("x", False)]),  # x: not selected
                _account("r2", "emitted", [("c", True)]),
                _account("r3", "no_llm_calls", []),
                _account("r4", "emitted", [("d", True)]),
                _account("other", "emitted", [("e", True)])]  # another job's rollout
    # r1's first sample is in, its second (same group, next poll) is not
    assert samples_missing({"r1", "r2", "r3", "r4"}, accounts, [_s("r1", "a"), _s("r2", "c")], {"r4"}) == {("r1", "b")}
    assert samples_missing({"r1", "r2", "r3", "r4"}, accounts, [_s("r1", "a"), _s("r1", "b"), _s("r2", "c")],
                           {"r4"}) == set()


def test_shift_of_every_iteration_pooled_and_per_iteration_scored_once():
    """logprob_shift_all's docstring example: iteration 0's rewarded completion moved -1.0 ->
    -0.8 nats over 2 tokens, iteration 1's -0.5 -> -0.6 over 3: pooled (-1.4 - -1.5) / 5."""
    final = {1: -0.8, 2: -0.6, 3: -2.0}
    calls = []

    def score(pairs):
        calls.append(len(pairs))
        return [final[prompt[0]] for prompt, _ in pairs]

    it0 = [_sample(+1.0, [1], [5, 6], [-0.5, -0.5]), _sample(-1.0, [3], [7], [-1.0]), _sample(0.0, [9], [4], [-1.0])]
    it1 = [_sample(+0.5, [2], [7, 8, 9], [-0.2, -0.2, -0.1])]
    got = logprob_shift_all([it0, it1], score)
    assert calls == [3]  # every non-zero-advantage completion once, in one call
    assert got["all"]["positive"]["delta"] == pytest.approx(0.02)
    assert got["all"]["positive"]["completions"] == 2 and got["all"]["positive"]["tokens"] == 5
    assert got["all"]["negative"]["delta"] == pytest.approx(-1.0)
    assert [p["positive"]["delta"] for p in got["per_iteration"]] == pytest.approx([0.1, -0.1 / 3])
    assert got["per_iteration"][0] == logprob_shift(it0, score)
    assert logprob_shift_all([], score) == {"all": {}, "per_iteration": []}
