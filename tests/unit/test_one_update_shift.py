"""bench/one_update_shift.py: its setting parser, its trainer-side scorer against the trainer's
own log-probs, and one update from saved weights whose `base` line is exactly 0 when the
behaviour log-probs are the model's own (tiny random Qwen2, no stack)."""
from __future__ import annotations

import pytest
import torch
from rich.console import Console

import deepspeed  # noqa: F401  (installed by infra/bootstrap.sh)
from tiny_models import tiny_qwen2

from bench import one_update_shift as ous
from spanrl.trainer import losses

VOCAB = 40


def test_parse_setting():
    assert ous.parse_setting("lr=1e-5,mini_batches=8,drop_zero_variance=false,loss_agg=token_mean") == {
        "lr": 1e-5, "mini_batches": 8, "drop_zero_variance": False, "loss_agg": "token_mean"}
    for bad in ("mini_batches=8", "lr"):
        with pytest.raises(ValueError):
            ous.parse_setting(bad)


def _per_token(model, prompt, completion) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits
    ids = torch.tensor([prompt + completion])
    mask = torch.tensor([[0.0] * len(prompt) + [1.0] * len(completion)])
    lp = losses.token_logprobs(logits, ids, mask)[0]  # the trainer's own: lp[t] = log p(ids[t] | ids[<t])
    return [float(x) for x in lp[len(prompt):]]


def test_scorer_equals_the_trainer_log_probs_and_the_base_line_is_zero(tmp_path):
    model = tiny_qwen2(VOCAB, 32, 0).eval()
    pairs = [([1, 5, 9], [3, 4]), ([2, 7], [11, 12, 13])]
    per_token = [_per_token(model, p, c) for p, c in pairs]
    assert ous.completion_logprob_sums(model, pairs) == pytest.approx([sum(t) for t in per_token], abs=1e-5)

    model.save_pretrained(str(tmp_path), safe_serialization=True)
    rets = [1.0, 0.0]
    samples = [{"advantage": r - 0.5, "group_id": "t", "group_rollouts": 2, "group_mean": 0.5, "group_std": 0.5,
                "transition": {"task_id": "t", "rollout_id": f"r{i}", "attempt_id": "0", "prompt_token_ids": p,
                               "completion_token_ids": c, "behaviour_logprobs": lp, "episode_return": r,
                               "reward": r, "policy_version": 0}}
               for i, ((p, c), lp, r) in enumerate(zip(pairs, per_token, rets))]
    later = [dict(x, transition={**x["transition"], "policy_version": 1}) for x in samples]
    chain = ous.run_chain({1: later, 0: samples}, [{"lr": 1e-2, "mini_batches": 1, "kl_coef": 0.1}], tmp_path,
                          Console(quiet=True))
    # one update per version in order; after version 0's, iteration 0's completions are its own
    assert [r["update_on_version"] for r in chain] == [0, 1]
    assert chain[0]["iteration0"] == chain[0]["own"] and chain[0]["steps"] == 1 and "ref_kl" in chain[0]
    assert chain[1]["iteration0"] != chain[0]["iteration0"]  # the second update moved them again
    rows = ous.run(samples, [{"lr": 1e-2, "mini_batches": 1}], tmp_path, Console(quiet=True))
    assert rows[0]["setting"] == "base"
    assert rows[0]["shift"] == {"positive": 0.0, "negative": 0.0}
    assert rows[1]["steps"] == 1 and set(rows[1]["shift"]) == {"positive", "negative"}
    assert rows[1]["shift"] != rows[0]["shift"]  # the update moved the weights


def test_demo_update_options_follow_the_demo_trainer_env():
    opts = ous.demo_update_options()
    assert (opts["lr"], opts["mini_batches"], opts["loss_agg"]) == (1e-5, 8, "token_mean")
    assert opts["advantage_std_scale"] is False and opts["drop_zero_variance"] is True
