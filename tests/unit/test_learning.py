"""The trainer learns: a tiny random Qwen2 trained with the trainer's own engine and
update (spanrl.trainer.train.build_engine / train_update) on a toy task whose reward is the
fraction of completion tokens equal to TARGET. Completions are sampled with torch
(no vLLM), recording behaviour log-probs; GRPO advantages within groups of a prompt."""
from __future__ import annotations

import copy
import random

import pytest
import torch

import deepspeed  # noqa: E402,F401  (installed by infra/bootstrap.sh)
from tiny_models import tiny_qwen2  # noqa: E402

from spanrl.stream_jobs.credit import grpo_advantages  # noqa: E402
from spanrl.trainer.train import build_engine, train_update  # noqa: E402

VOCAB, TARGET, PROMPT_LEN, COMP_LEN = 64, 7, 4, 6
GROUPS, GROUP_SIZE = 8, 4


def tiny_model(seed: int = 0):
    return tiny_qwen2(VOCAB, 64, seed)


@torch.no_grad()
def rollout(model, gen: torch.Generator, step: int, temperature: float = 1.0):
    """GROUPS prompts x GROUP_SIZE completions sampled at ``temperature`` -> (Sample dicts,
    rewards [N]); the behaviour log-probs are those of the distribution sampled from, as vLLM's
    processed log-probs are."""
    model.eval()
    prompts = torch.randint(8, VOCAB, (GROUPS, PROMPT_LEN), generator=gen).repeat_interleave(GROUP_SIZE, 0)
    ids, logps = prompts, []
    for _ in range(COMP_LEN):
        logits = model(input_ids=ids).logits[:, -1].float() / temperature
        logp_all = torch.log_softmax(logits, -1)
        tok = torch.multinomial(logp_all.exp(), 1, generator=gen)
        logps.append(logp_all.gather(-1, tok))
        ids = torch.cat([ids, tok], 1)
    completions, behaviour = ids[:, PROMPT_LEN:], torch.cat(logps, 1)
    rewards = (completions == TARGET).float().mean(1)
    group_ids = [i // GROUP_SIZE for i in range(len(rewards))]
    adv = [a for g in range(GROUPS)  # the stream job's GRPO advantages, group by group
           for a in grpo_advantages(rewards[g * GROUP_SIZE:(g + 1) * GROUP_SIZE].tolist())]
    samples = [{
        "advantage": float(adv[i]),
        "transition": {"prompt_token_ids": prompts[i].tolist(), "completion_token_ids": completions[i].tolist(),
                       "behaviour_logprobs": behaviour[i].tolist(), "episode_return": float(rewards[i]),
                       "reward": float(rewards[i]), "task_id": f"t{step}-{group_ids[i]}"},
    } for i in range(len(rewards))]
    return samples, rewards


def test_grpo_raises_reward_with_the_trainer_engine():
    random.seed(0)
    gen = torch.Generator().manual_seed(0)
    engine = build_engine(tiny_model(0), lr=3e-3, micro_batch=16)
    curve = []
    for step in range(30):
        samples, rewards = rollout(engine.module, gen, step)
        curve.append(float(rewards.mean()))
        metrics = train_update(engine, samples, clip_eps=0.2, micro_batch=16, ppo_epochs=1)
        assert metrics["samples"] == GROUPS * GROUP_SIZE
    initial, final = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
    print("reward curve", [round(r, 3) for r in curve])
    assert final > initial + 0.3, curve


def test_micro_batching_equals_one_batch():
    """Gradient accumulation over micro-batches gives the same loss and the same step as one batch."""
    gen = torch.Generator().manual_seed(1)
    base = tiny_model(1)
    samples, _ = rollout(base, gen, 0)
    e_small = build_engine(copy.deepcopy(base), lr=1e-3, micro_batch=3)
    e_big = build_engine(copy.deepcopy(base), lr=1e-3, micro_batch=64)
    e_tok = build_engine(copy.deepcopy(base), lr=1e-3, micro_batch=64)
    m_small = train_update(e_small, samples, micro_batch=3)
    m_big = train_update(e_big, samples, micro_batch=64)
    m_tok = train_update(e_tok, samples, micro_batch=64, micro_batch_tokens=40)  # packed by tokens
    for m in (m_small, m_tok):
        assert m["loss"] == pytest.approx(m_big["loss"], abs=1e-5)
        assert m["approx_kl"] == pytest.approx(m_big["approx_kl"], abs=1e-6)
    for e in (e_small, e_tok):
        for (n, a), (_, b) in zip(e.module.named_parameters(), e_big.module.named_parameters()):
            assert torch.allclose(a, b, atol=1e-5), n
    changed = any(not torch.equal(a, b) for a, b in zip(base.parameters(), e_big.module.parameters()))
    assert changed


def test_per_rollout_mean_weighs_rollouts_equally():
    """per_rollout_mean: the same step as token_mean when every rollout has one call of equal
    length (the weights coincide); a different step when one rollout has more calls."""
    gen = torch.Generator().manual_seed(2)
    base = tiny_model(2)
    samples, _ = rollout(base, gen, 0)
    for i, s in enumerate(samples):
        s["transition"]["rollout_id"], s["transition"]["attempt_id"] = f"r{i}", "0"
    e_tok = build_engine(copy.deepcopy(base), lr=1e-3, micro_batch=64)
    e_roll = build_engine(copy.deepcopy(base), lr=1e-3, micro_batch=64)
    m_tok = train_update(e_tok, samples, micro_batch=64)
    m_roll = train_update(e_roll, samples, micro_batch=64, loss_agg="per_rollout_mean")
    assert m_roll["loss"] == pytest.approx(m_tok["loss"], abs=1e-6)
    for (n, a), (_, b) in zip(e_tok.module.named_parameters(), e_roll.module.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), n
    # rollout r0 now owns the first 8 samples: its tokens weigh 1/8 as much each
    for s in samples[:8]:
        s["transition"]["rollout_id"] = "r0"
    e_tok2 = build_engine(copy.deepcopy(base), lr=1e-3, micro_batch=64)
    e_roll2 = build_engine(copy.deepcopy(base), lr=1e-3, micro_batch=64)
    m_tok2 = train_update(e_tok2, samples, micro_batch=64)
    m_roll2 = train_update(e_roll2, samples, micro_batch=64, loss_agg="per_rollout_mean")
    assert m_tok2["loss"] == pytest.approx(m_tok["loss"], abs=1e-6)  # token mean ignores rollouts
    for (n, a), (_, b) in zip(e_tok2.module.named_parameters(), e_tok.module.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), n
    # (the loss value itself is ~0 at ratio 1: GRPO advantages sum to 0 in each group)
    moved = [not torch.allclose(a, b, atol=1e-6)
             for a, b in zip(e_roll2.module.parameters(), e_tok2.module.parameters())]
    assert any(moved)
    assert m_roll2["loss_agg"] == "per_rollout_mean"
