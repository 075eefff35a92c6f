"""Losses and batching on hand-computed cases."""
from __future__ import annotations

import math

import pytest
import torch

from spanrl.trainer import batching, losses

# Two sequences, T=3 positions each; position 0 is prompt, positions 1-2 completion;
# plus a padded batch row layout check below. Ratios r = exp(logp - behaviour):
#   seq 0 (A=+1): r = 1.5, 0.9     seq 1 (A=-1): r = 1.5, 0.5     eps = 0.2
# per token max(-A r, -A clip(r, 0.8, 1.2)):
#   seq 0: max(-1.5, -1.2) = -1.2 ; max(-0.9, -0.9) = -0.9
#   seq 1: max( 1.5,  1.2) =  1.5 ; max( 0.5,  0.8) =  0.8
# token mean over the 4 completion tokens: (-1.2 - 0.9 + 1.5 + 0.8) / 4 = 0.05
# k3 = (r-1) - ln r: 0.0945348919, 0.0053605157, 0.0945348919, 0.1931471806 -> mean 0.0968943700
# clipped tokens (|r-1| > 0.2): 1.5, 1.5, 0.5 -> 3/4
RATIOS = torch.tensor([[1.0, 1.5, 0.9], [1.0, 1.5, 0.5]])
MASK = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
BEHAVIOUR = torch.full((2, 3), -1.0)
LOGP = BEHAVIOUR + RATIOS.log()
ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])


def test_ppo_clip_loss_hand_computed():
    loss = losses.ppo_clip_loss(LOGP, BEHAVIOUR, ADV * MASK, MASK, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.05, abs=1e-6)


def test_ppo_clip_loss_ignores_masked_positions_and_uses_normaliser():
    logp = LOGP.clone()
    logp[:, 0] = 5.0  # junk at non-completion positions must not matter
    loss = losses.ppo_clip_loss(logp, BEHAVIOUR, ADV, MASK, clip_eps=0.2, normaliser=8.0)
    assert loss.item() == pytest.approx(0.2 / 8, abs=1e-6)


def test_ppo_clip_loss_gradient_is_zero_where_clipped():
    logp = LOGP.clone().requires_grad_(True)
    losses.ppo_clip_loss(logp, BEHAVIOUR, ADV, MASK, clip_eps=0.2).backward()
    # seq0 tok1 (A>0, r>1+eps) clipped -> 0; seq0 tok2 unclipped -> -A r / 4 = -0.225
    # seq1 tok1 (A<0, r>1+eps) unclipped (pessimistic branch) -> +1.5/4; seq1 tok2 (A<0, r<1-eps) clipped -> 0
    expected = torch.tensor([[0.0, 0.0, -0.225], [0.0, 0.375, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_kl_penalty_adds_k3_to_reference():
    ref = LOGP.clone()  # ref == current -> k3 = 0, loss unchanged
    assert losses.ppo_clip_loss(LOGP, BEHAVIOUR, ADV, MASK, kl_coef=0.1, ref_logp=ref).item() == pytest.approx(0.05)
    ref = LOGP - math.log(2.0)  # pi_ref / pi = 0.5 -> k3 = 0.5 - ln 0.5 - 1 = 0.1931471806
    out = losses.ppo_clip_loss(LOGP, BEHAVIOUR, ADV, MASK, kl_coef=0.1, ref_logp=ref)
    assert out.item() == pytest.approx(0.05 + 0.1 * 0.1931471806, abs=1e-6)


def test_approx_kl_and_clip_fraction():
    assert losses.approx_kl(LOGP, BEHAVIOUR, MASK).item() == pytest.approx(0.09689437, abs=1e-6)
    assert losses.clip_fraction(LOGP, BEHAVIOUR, MASK, 0.2).item() == pytest.approx(0.75)


def test_token_logprobs_tiny_logits():
    # vocab 3; logits[0] uniform -> log p(token at 1) = -ln 3; logits[1] = [0, ln 2, 0] -> p = [1/4, 1/2, 1/4]
    logits = torch.tensor([[[0.0, 0.0, 0.0], [0.0, math.log(2.0), 0.0], [9.0, 9.0, 9.0]]])
    ids = torch.tensor([[2, 0, 1]])
    out = losses.token_logprobs(logits, ids, torch.tensor([[0.0, 1.0, 1.0]]))
    assert torch.allclose(out, torch.tensor([[0.0, -math.log(3.0), math.log(0.5)]]), atol=1e-6)
    out = losses.token_logprobs(logits, ids, torch.tensor([[0.0, 0.0, 1.0]]))
    assert torch.allclose(out, torch.tensor([[0.0, 0.0, math.log(0.5)]]), atol=1e-6)


def test_reinforce_pp_advantages():
    adv = losses.reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-5)


def _sample(prompt, completion, logprobs, adv, ret=1.0):
    return {"advantage": adv, "transition": {"prompt_token_ids": prompt, "completion_token_ids": completion,
                                             "behaviour_logprobs": logprobs, "episode_return": ret, "reward": ret}}


def test_collate_right_pads_and_aligns():
    s0 = _sample([11, 12], [13, 14], [-0.5, -0.25], 1.0, ret=1.0)
    s1 = _sample([21], [22, 23, 24, 25], [-1.0, -2.0, -3.0, -4.0], -0.5, ret=0.0)
    b = batching.collate([s0, s1], pad_token_id=0)
    assert b.input_ids.tolist() == [[11, 12, 13, 14, 0], [21, 22, 23, 24, 25]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert b.completion_mask.tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert b.behaviour_logprobs.tolist() == [[0, 0, -0.5, -0.25, 0], [0, -1.0, -2.0, -3.0, -4.0]]
    assert b.advantages.tolist() == [[0, 0, 1.0, 1.0, 0], [0, -0.5, -0.5, -0.5, -0.5]]
    assert b.returns.tolist() == [1.0, 0.0]
    assert (b.num_tokens, b.num_completion_tokens) == (9, 6)
    assert batching.collate([s0, s1], advantages=[2.0, 3.0]).advantages[1, 1].item() == 3.0


def test_check_sample_reasons():
    batching.check_sample(_sample([1], [2], [-0.1], 0.0))
    for s, reason in [(_sample([1], [], [], 0.0), "empty_completion"),
                      (_sample([1], [2, 3], [-0.1], 0.0), "logprob_mismatch"),
                      (_sample([], [2], [-0.1], 0.0), "empty_prompt")]:
        with pytest.raises(batching.BadSample) as e:
            batching.check_sample(s)
        assert e.value.reason == reason
    with pytest.raises(batching.BadSample, match="oversize"):
        batching.check_sample(_sample([1, 2, 3], [4], [-0.1], 0.0), max_tokens=3)
    batching.check_sample(_sample([0, 49151], [49151], [-0.1], 0.0), vocab_size=49152)
    for prompt, completion in [([1, 49152], [2]), ([1], [151643]), ([-1], [2])]:
        with pytest.raises(batching.BadSample, match="token_id_out_of_vocab") as e:
            batching.check_sample(_sample(prompt, completion, [-0.1], 0.0), vocab_size=49152)
        assert e.value.reason == "token_id_out_of_vocab"


def test_micro_batches():
    assert batching.micro_batches(list(range(5)), 2) == [[0, 1], [2, 3], [4]]


def _sized_sample(prompt_len, completion_len):
    return {"transition": {"prompt_token_ids": [1] * prompt_len, "completion_token_ids": [2] * completion_len,
                           "behaviour_logprobs": [-1.0] * completion_len, "episode_return": 0.0},
            "advantage": 0.0}


def test_token_budget_batches_pack_longest_first_within_budget():
    from spanrl.trainer import batching

    samples = [_sized_sample(3, 2), _sized_sample(10, 5), _sized_sample(4, 4), _sized_sample(1, 1)]  # lengths 5, 15, 8, 2
    # longest first: 15 alone (2*15 > 20); then 8, 5 (2*8=16 <= 20), then 2 would make 3*8=24 > 20
    assert batching.token_budget_batches(samples, max_padded_tokens=20, max_size=8) == [[1], [2, 0], [3]]
    assert batching.token_budget_batches(samples, max_padded_tokens=100, max_size=2) == [[1, 2], [0, 3]]


def test_completion_window_covers_every_completion_token():
    from spanrl.trainer import batching

    b = batching.collate([_sized_sample(3, 2), _sized_sample(5, 1)])  # T = 6; completions at [3,4] and [5]
    assert batching.completion_window(b) == 6 - 2  # positions 2..5: position 2 predicts token 3
    assert float(b.completion_mask[:, -4:].sum()) == float(b.completion_mask.sum())


def test_sequence_loss_weights_hand_computed():
    # rollouts a (two calls of 2 tokens) and b (one call of 4): 8 tokens
    assert losses.sequence_loss_weights(["a", "a", "b"], [2, 2, 4]) == [1 / 8] * 3
    assert losses.sequence_loss_weights(["a", "a", "b"], [2, 2, 4], "per_rollout_mean") == [1 / 8] * 3
    # a: 1 + 1 tokens, b: 6 tokens. token mean: 1/8 each; per rollout: a's tokens 1/(2*2), b's 1/(2*6)
    assert losses.sequence_loss_weights(["a", "a", "b"], [1, 1, 6], "per_rollout_mean") == [1 / 4, 1 / 4, 1 / 12]
    # the weights of all tokens sum to 1 either way
    for agg in losses.LOSS_AGGREGATIONS:
        w = losses.sequence_loss_weights(["x", "y", "y", "z"], [3, 5, 7, 1], agg)
        assert sum(wi * n for wi, n in zip(w, [3, 5, 7, 1])) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        losses.sequence_loss_weights(["a"], [1], "sample_mean")
    with pytest.raises(ValueError):
        losses.sequence_loss_weights(["a", "b"], [1], "token_mean")


def test_ppo_clip_loss_token_weights():
    # uniform weights 1/4 on the 4 completion tokens = the token mean (0.05, above)
    w = MASK / 4
    assert losses.ppo_clip_loss(LOGP, BEHAVIOUR, ADV * MASK, MASK, token_weights=w).item() == pytest.approx(0.05)
    # per-sequence weights: seq 0 tokens 1/2 each (-1.2, -0.9), seq 1 nothing -> -1.05
    w = torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.0, 0.0]])
    assert losses.ppo_clip_loss(LOGP, BEHAVIOUR, ADV * MASK, MASK, token_weights=w).item() == pytest.approx(-1.05)


def test_dual_clip_caps_the_ratio_of_negative_advantages():
    """Dual-clip PPO (arXiv 1912.09729): A = -1, ratio e^ln5 = 5: PPO-clip loss is 5 (unbounded in
    the ratio), with c = 3 it is 3; positive advantages and small ratios are unchanged."""
    mask = torch.ones(1, 4)
    logp = torch.log(torch.tensor([[5.0, 5.0, 0.5, 1.1]]))
    beh = torch.zeros(1, 4)
    adv = torch.tensor([[-1.0, 2.0, -1.0, -2.0]])
    per_token = lambda cap: losses.ppo_clip_loss(logp, beh, adv, mask, clip_eps=0.2, ratio_cap=cap,  # noqa: E731
                                                 token_weights=torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert float(per_token(None)) == pytest.approx(5.0)
    assert float(per_token(3.0)) == pytest.approx(3.0)
    # per token: [min(5, 3), -2 * clip(5) = -2.4, max(0.5, 0.8) = 0.8, 2 * 1.1 = 2.2] -> mean
    assert float(losses.ppo_clip_loss(logp, beh, adv, mask, ratio_cap=3.0)) == pytest.approx((3.0 - 2.4 + 0.8 + 2.2) / 4)
    with pytest.raises(ValueError, match="ratio_cap must be > 1"):
        losses.dual_clip(torch.zeros(1, 1), torch.zeros(1, 1), 1.0)
