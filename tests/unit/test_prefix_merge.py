"""Prefix-merged training rows (trainer/prefix_merge.py, SPANRL_TRAINER_PREFIX_MERGE).

Hand-computed rows and break causes on small token lists; the math agent's calls rendered
with the real SmolLM2 tokenizer and the chat template vLLM serves; and the exactness claim:
train_update's loss and gradient with merged rows equal those of the calls one by one."""
from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch

import deepspeed  # noqa: F401  (installed by infra/bootstrap.sh)
from tiny_models import tiny_qwen2

from spanrl.core.settings import Settings, TrainerConfig
from spanrl.trainer import batching, tracking, train
from spanrl.trainer.prefix_merge import BREAK_CAUSES, break_cause, collate_rows, merge_calls, truncated
from spanrl.trainer.self_imitation import SelfImitationBuffer, positive_entries


def _call(prompt, completion, call_index=0, *, rollout="r1", agent="math_agent", behaviour=None, adv=0.5, ret=1.0,
          **extra) -> dict:
    behaviour = behaviour if behaviour is not None else [-0.1 * (k + 1) for k in range(len(completion))]
    return {"advantage": adv, "group_id": "g", "group_rollouts": 2, "group_mean": 0.5, "group_std": 0.5,
            "transition": {"rollout_id": rollout, "attempt_id": "a0", "call_index": call_index,
                           "sequence_id": call_index, "agent_name": agent, "task_id": "t",
                           "prompt_token_ids": list(prompt), "completion_token_ids": list(completion),
                           "behaviour_logprobs": list(behaviour), "episode_return": ret, "reward": ret,
                           "policy_version": 0, **extra}}


def _no_breaks(**counts) -> dict:
    return {**dict.fromkeys(BREAK_CAUSES, 0), **counts}


# ---- hand-computed rows -------------------------------------------------------------------

def test_two_calls_that_extend_each_other_are_one_row():
    a = _call([1, 2], [3], 0, behaviour=[-0.1])
    b = _call([1, 2, 3, 4], [5, 6], 1, behaviour=[-0.2, -0.3])
    m = merge_calls([b, a], [0.25, 0.5])  # arrival order does not matter: call_index does
    assert len(m.rows) == 1
    row = m.rows[0]
    assert row.input_ids == [1, 2, 3, 4, 5, 6]
    assert row.loss_mask == [0, 0, 1, 0, 1, 1]  # the prompt and the inserted tool result 4 are masked
    assert row.advantages == [0, 0, 0.5, 0, 0.25, 0.25]  # each call's own advantage
    assert row.behaviour_logprobs == [0, 0, -0.1, 0, -0.2, -0.3]
    assert row.token_sample == [-1, -1, 1, -1, 0, 0]
    assert row.samples == [1, 0]
    assert (m.links, m.breaks, m.tokens, m.tokens_per_call) == (1, _no_breaks(), 6, 3 + 6)


def test_per_token_advantages_other_attempts_and_hand_made_samples_stay_apart():
    a = _call([1, 2], [3, 4], 0)
    b = _call([1, 2, 3, 4, 9], [5], 1)
    other = _call([1, 2, 3, 4, 9], [5], 1, rollout="r2")  # the same ids in another rollout: its own row
    loose = {"advantage": 1.0, "transition": {"prompt_token_ids": [1, 2, 3, 4, 9], "completion_token_ids": [7],
                                              "behaviour_logprobs": [-1.0], "episode_return": 0.0}}
    m = merge_calls([a, b, other, loose], [[0.1, 0.2], [0.3], 0.4, 1.0])
    assert [r.samples for r in m.rows] == [[0, 1], [2], [3]]
    assert m.rows[0].advantages == [0, 0, 0.1, 0.2, 0, 0.3]
    assert m.rows[1].input_ids == [1, 2, 3, 4, 9, 5] and m.rows[1].loss_mask == [0, 0, 0, 0, 0, 1]
    assert (m.links, m.breaks) == (1, _no_breaks())
    with pytest.raises(ValueError, match="2 token advantages for a completion of 1 tokens"):
        merge_calls([a, b], [[0.1, 0.2], [0.3, 0.4]])


# one test per break cause: previous call prompt [1, 2, 3], completion [4, 5]

def test_break_template_rewrite():
    a = _call([1, 2, 3], [4, 5], 0)
    b = _call([1, 8, 3, 4, 5, 6], [7], 1)  # the history re-rendered: token 2 became 8 inside a's prompt
    assert break_cause(a["transition"], b["transition"]) == "template_rewrite"
    m = merge_calls([a, b], [1.0, 1.0])
    assert [r.input_ids for r in m.rows] == [[1, 2, 3, 4, 5], [1, 8, 3, 4, 5, 6, 7]]
    assert [r.loss_mask for r in m.rows] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 1]]
    assert (m.links, m.breaks, m.tokens, m.tokens_per_call) == (0, _no_breaks(template_rewrite=1), 12, 12)


def test_break_retokenisation():
    a = _call([1, 2, 3], [4, 5, 2], 0)  # ended with the stop token 2
    b = _call([1, 2, 3, 45, 2, 6], [7], 1)  # the answer's text tokenised again: 4, 5 -> 45
    assert break_cause(a["transition"], b["transition"], stop_token_ids={2}) == "retokenisation"
    m = merge_calls([a, b], [1.0, 1.0], stop_token_ids={2})
    assert [r.samples for r in m.rows] == [[0], [1]]
    assert m.breaks == _no_breaks(retokenisation=1)


def test_break_truncation_recorded_or_told_by_the_missing_stop_token():
    a = _call([1, 2, 3], [4, 5], 0, finish_reason="length")  # cut by max_tokens
    b = _call([1, 2, 3, 4, 55, 2, 6], [7], 1)  # the cut text re-rendered with its end marker: 5 -> 55
    assert break_cause(a["transition"], b["transition"]) == "truncation"
    assert merge_calls([a, b], [1.0, 1.0]).breaks == _no_breaks(truncation=1)
    unrecorded = copy.deepcopy(a)
    del unrecorded["transition"]["finish_reason"]  # transition v2 records none: the stop ids tell
    assert truncated(unrecorded["transition"], {2}) and not truncated(unrecorded["transition"])
    assert break_cause(unrecorded["transition"], b["transition"], {2}) == "truncation"
    assert break_cause(unrecorded["transition"], b["transition"]) == "retokenisation"
    stopped = _call([1, 2, 3], [4, 5], 0, finish_reason="stop")
    assert break_cause(stopped["transition"], b["transition"], {2}) == "retokenisation"  # recorded wins


def test_a_cut_completion_whose_prefix_holds_still_merges():
    a = _call([1, 2, 3], [4, 5], 0, finish_reason="length")
    b = _call([1, 2, 3, 4, 5, 2, 6], [7], 1)  # the end marker 2 the model never wrote: inserted, masked
    m = merge_calls([a, b], [1.0, 1.0], stop_token_ids={2})
    assert m.rows[0].loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert (m.links, m.breaks) == (1, _no_breaks())


def test_break_different_agent_whatever_the_tokens():
    a = _call([1, 2, 3], [4, 5], 0, agent="planner")
    b = _call([1, 2, 3, 4, 5, 6], [7], 1, agent="coder")  # extends a, but another role
    c = _call([1, 2, 3, 4, 5, 6, 7, 8], [9], 2, agent="coder")
    assert break_cause(a["transition"], b["transition"]) == "different_agent"
    m = merge_calls([a, b, c], [1.0, 1.0, 1.0])
    assert [r.samples for r in m.rows] == [[0], [1, 2]]
    assert (m.links, m.breaks) == (1, _no_breaks(different_agent=1))


def test_break_same_prompt():
    a = _call([1, 2, 3], [4, 5], 0)
    b = _call([1, 2, 3], [6], 0)  # choice 1 of the same n = 2 request: the same call_index, a sibling
    assert break_cause(a["transition"], b["transition"]) == "same_prompt"
    m = merge_calls([a, b], [1.0, -1.0])
    assert [r.input_ids for r in m.rows] == [[1, 2, 3, 4, 5], [1, 2, 3, 6]]
    assert m.breaks == _no_breaks(same_prompt=1)


def test_collate_rows_weighs_each_token_by_its_call():
    a = _call([1, 2], [3], 0, behaviour=[-0.1], ret=1.0)
    b = _call([1, 2, 3, 4], [5, 6], 1, behaviour=[-0.2, -0.3], ret=1.0)
    c = _call([7], [8], 0, rollout="r2", behaviour=[-0.4], ret=0.0)
    samples = [a, b, c]
    m = merge_calls(samples, [0.5, 0.5, -0.5])
    batch, w = collate_rows(m.rows, samples, [1 / 4, 1 / 8, 1 / 2], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert batch.completion_mask.tolist() == [[0, 0, 1, 0, 1, 1], [0, 1, 0, 0, 0, 0]]
    assert batch.advantages.tolist() == [[0, 0, 0.5, 0, 0.5, 0.5], [0, -0.5, 0, 0, 0, 0]]
    assert w.tolist() == [[0, 0, 0.25, 0, 0.125, 0.125], [0, 0.5, 0, 0, 0, 0]]
    assert batch.returns.tolist() == [1.0, 0.0]


def test_length_budget_batches():
    assert batching.length_budget_batches([3, 5, 2], 8, 4) == [[1], [0, 2]]
    assert batching.length_budget_batches([3, 5, 2], 100, 2) == [[1, 0], [2]]


def test_merge_counts_add_up_in_the_trainer_state_and_tensorboard():
    acc = train.TrainerState(run="u").prefix_merge
    metrics = {"prefix_merge_rows": 2, "prefix_merge_links": 3, "prefix_merge_tokens": 40,
               "prefix_merge_tokens_per_call": 90, "prefix_merge_breaks": _no_breaks(retokenisation=1)}
    train.add_merge_counts(acc, metrics)
    train.add_merge_counts(acc, metrics)
    train.add_merge_counts(acc, {"loss": 1.0})  # an update without merging adds nothing
    assert acc == {"enabled": False, "rows": 4, "links": 6, "tokens": 80, "tokens_per_call": 180,
                   "breaks": _no_breaks(retokenisation=2)}
    scalars = tracking.update_scalars(metrics, [], trained_version=0)
    assert {k: v for k, v in scalars.items() if "prefix_merge" in k} == {
        "train/prefix_merge_rows": 2.0, "train/prefix_merge_links": 3.0, "train/prefix_merge_tokens": 40.0,
        "train/prefix_merge_tokens_per_call": 90.0, "prefix_merge/breaks_template_rewrite": 0.0,
        "prefix_merge/breaks_retokenisation": 1.0, "prefix_merge/breaks_truncation": 0.0,
        "prefix_merge/breaks_different_agent": 0.0, "prefix_merge/breaks_same_prompt": 0.0}


def test_the_setting_is_on_by_default_and_reaches_status(tmp_path):
    assert TrainerConfig.from_environ({}).prefix_merge is True
    t = train.Trainer(TrainerConfig(run="unit", http=False, log_path=tmp_path / "t.jsonl", prefix_merge=False))
    assert t.status()["prefix_merge"]["enabled"] is False


# ---- the math agent's calls, rendered as vLLM renders them -----------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    model_dir = Settings().model_dir
    assert (model_dir / "tokenizer.json").exists(), f"no converted model at {model_dir}: `make test-unit` converts it"
    return AutoTokenizer.from_pretrained(str(model_dir))


def math_episode(tok, rollout: str, ret: float, turns: list[tuple[list[int] | str, str | None]]) -> list[dict]:
    """The calls of one math-agent episode (examples/math_agent/agent.py: its system prompt,
    few-shot turns and question) as the proxy records them: each prompt is the conversation so
    far rendered by the chat template vLLM serves (``Settings().vllm_chat_template``) and
    tokenised without special tokens added; each completion is ``turns[k][0]`` (a reply's text,
    tokenised canonically, or sampled ids) plus the end-of-sequence token; ``turns[k][1]``
    the user message the agent sends after it (a ``<result>``, or None for the last call).
    Behaviour log-probs and advantages are filled in later."""
    from examples.math_agent.agent import FEW_SHOT, SYSTEM_PROMPT

    template = (Path(__file__).resolve().parents[2] / Settings().vllm_chat_template).read_text()
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] + [{"role": r, "content": t} for r, t in FEW_SHOT]
    messages.append({"role": "user", "content": "Question: A crate holds 17 jars. How many jars are in 23 crates?"
                                                "\nEnd with: Answer: <number>"})
    calls = []
    for k, (reply, after) in enumerate(turns):
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
        prompt = tok.encode(text, add_special_tokens=False)
        ids = tok.encode(reply, add_special_tokens=False) if isinstance(reply, str) else list(reply)
        calls.append(_call(prompt, ids + [tok.eos_token_id], k, rollout=rollout, ret=ret,
                           behaviour=[0.0] * (len(ids) + 1)))
        messages.append({"role": "assistant", "content": reply if isinstance(reply, str) else tok.decode(reply)})
        if after is not None:
            messages.append({"role": "user", "content": after})
    return calls


def math_group(tok) -> list[dict]:
    """Four episodes of one task (group of 4, returns [1, 0, 1, 0]): two with a calculator
    call and an answer, one whose first reply asks nothing (the agent nudges), one whose
    ``<calc>`` was sampled as the non-canonical ``<``, ``cal``, ``c``, ``>`` (its next prompt
    tokenises the text again: a retokenisation break)."""
    nudge = "What is the final answer? Reply exactly as: Answer: <number>"
    sampled = [44, 5020, 83, 46] + tok.encode("17*23</calc>", add_special_tokens=False)
    episodes = [
        math_episode(tok, "ep-right", 1.0, [("<calc>17*23</calc>", "<result>391</result>"), ("Answer: 391", None)]),
        math_episode(tok, "ep-wrong", 0.0, [("<calc>17+23</calc>", "<result>40</result>"), ("Answer: 40", None)]),
        math_episode(tok, "ep-nudged", 1.0, [("Let me think.", nudge), ("<calc>17*23</calc>", "<result>391</result>"),
                                             ("Answer: 391", None)]),
        math_episode(tok, "ep-retok", 0.0, [(sampled, "<result>391</result>"), ("Answer: 39", None)]),
    ]
    calls = [c for ep in episodes for c in ep]
    for c in calls:  # GRPO over the group: mean 0.5, std 0.5
        c.update(group_id="17x23", group_rollouts=4, advantage=(c["transition"]["episode_return"] - 0.5) / 0.5)
    return calls


def test_math_agent_calls_merge_with_the_real_template(tokenizer):
    calls = math_group(tokenizer)
    m = merge_calls(calls, [c["advantage"] for c in calls], stop_token_ids={tokenizer.eos_token_id})
    assert [r.samples for r in m.rows] == [[0, 1], [2, 3], [4, 5, 6], [7], [8]]
    assert (m.links, m.breaks) == (4, _no_breaks(retokenisation=1))
    first, second = calls[0]["transition"], calls[1]["transition"]
    inserted = second["prompt_token_ids"][len(first["prompt_token_ids"]) + len(first["completion_token_ids"]):]
    # what the agent added between the calls: "\n", the user turn with the tool result, the generation prompt
    assert tokenizer.decode(inserted) == "\n<|im_start|>user\n<result>391</result><|im_end|>\n<|im_start|>assistant\n"
    assert m.tokens_per_call == sum(len(c["transition"]["prompt_token_ids"])
                                    + len(c["transition"]["completion_token_ids"]) for c in calls)
    assert (m.tokens, m.tokens_per_call) == (1628, 2848)  # the few-shot prompt forwarded once per row, not per call


# ---- exactness: merged rows give the per-call loss and gradient --------------------------------

class GradEngine:
    """train_update's engine interface over a plain model: ``backward`` accumulates the
    gradient, ``step`` records it (flattened) and zeroes it without changing the weights, so
    two runs over the same weights can be compared gradient by gradient."""

    def __init__(self, model):
        self.module, self.device, self.grads = model, torch.device("cpu"), []

    def __call__(self, **kwargs):
        return self.module(**kwargs)

    def train(self):
        self.module.train()

    def set_gradient_accumulation_boundary(self, _):
        pass

    def backward(self, loss, scale_wrt_gas=False):
        loss.backward()

    def step(self):
        params = list(self.module.parameters())
        self.grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                     for p in params]))
        for p in params:
            p.grad = None


def with_behaviour(calls: list[dict], model, seed: int = 0) -> list[dict]:
    """``calls`` with behaviour log-probs = ``model``'s own log-prob of each completion token plus
    noise of +-0.3 (a behaviour policy a little off the trained one: some ratios are clipped)."""
    rng = random.Random(seed)
    out = copy.deepcopy(calls)
    with torch.no_grad():
        for c in out:
            t = c["transition"]
            b = batching.collate([c])
            logp = train.completion_logprobs(model, b.input_ids, b.attention_mask, b.completion_mask,
                                             b.input_ids.shape[1], 0)
            own = logp[0, len(t["prompt_token_ids"]):].tolist()
            t["behaviour_logprobs"] = [x + rng.uniform(-0.3, 0.3) for x in own]
    return out


def tiny_policy(seed: int = 0):
    model = tiny_qwen2(49152, 32, seed)  # SmolLM2's vocabulary: the recorded ids as they are
    model.config.eos_token_id = 2
    return model


OPTIONS = {
    "token_mean": {},
    "sequence_mean": {"loss_agg": "sequence_mean"},
    "per_rollout_mean": {"loss_agg": "per_rollout_mean", "micro_batch": 2},
    "full_logits_dr_grpo": {"logprob_chunk": 0, "advantage_std_scale": False, "micro_batch_tokens": 700},
    "prefix_tree_mini_batches_kl": {"prefix_tree_advantage": True, "mini_batches": 2, "kl_coef": 0.1,
                                    "ratio_cap": 3.0, "negative_advantage_weight": 0.5},
    "self_imitation_drop_zero_variance_epochs": {"drop_zero_variance": True, "ppo_epochs": 2},
    "self_imitation_sil_loss": {"drop_zero_variance": True},
}


def earlier_update(calls: list[dict]) -> list[dict]:
    """``calls`` as another group of an earlier update (other rollout ids), for a replay buffer."""
    out = copy.deepcopy(calls)
    for c in out:
        c["transition"]["rollout_id"] += "-earlier"
        c["group_id"] = "earlier"
    return out


def update_pair(tok, name: str, option: str, **fixed) -> tuple[tuple, tuple, dict]:
    """train_update on the math agent's calls (:func:`math_group`, behaviour a little off the
    policy) with the option set ``OPTIONS[name]`` (and ``fixed``), boolean ``option`` off and
    then on, each from the same tiny policy through a :class:`GradEngine`; a ``kl_coef`` set gets
    a reference model, a ``self_imitation`` set a replayed earlier group and a zero-variance group
    dropped. Returns ``((metrics, step gradients) off, (...) on, the options)``."""
    calls = with_behaviour(math_group(tok), tiny_policy())
    options = {**OPTIONS[name], **fixed}
    if options.get("kl_coef"):
        options["ref_model"] = tiny_policy(seed=2).eval()
    replayed = []
    if name.startswith("self_imitation"):  # a replayed earlier group, and a zero-variance group dropped
        flat = earlier_update(calls)
        for c in flat:
            c["transition"]["rollout_id"] += "-flat"
            c.update(group_id="flat", group_std=0.0, advantage=0.0)
        replayed = earlier_update(calls)
        calls = calls + flat
    got = {}
    for on in (False, True):
        if replayed:
            options["self_imitation"] = SelfImitationBuffer(2, loss="sil" if name.endswith("sil_loss") else "clipped")
            options["self_imitation"].add(positive_entries(replayed, [c["advantage"] for c in replayed]))
        engine = GradEngine(tiny_policy())
        metrics = train.train_update(engine, copy.deepcopy(calls), **{option: on}, **options)
        got[on] = (metrics, engine.grads)
    return got[False], got[True], options


@pytest.mark.parametrize("name", list(OPTIONS))
def test_merged_loss_and_gradient_equal_the_per_call_ones(tokenizer, name):
    """On the math agent's calls (real token ids), one update with ``prefix_merge`` gives the
    per-call update's loss, approx_kl and clip fraction, and each optimizer step's gradient, to
    a max abs difference <= 1e-5 x the largest gradient entry (float32; measured here 2.0e-7 to
    2.0e-6 of it, the largest with per_rollout_mean, whose loss is smallest: 3.9e-4)."""
    (per_call, g_call), (merged, g_merged), options = update_pair(tokenizer, name, "prefix_merge")
    assert len(g_call) == len(g_merged) == (1 if name in ("token_mean", "sequence_mean", "per_rollout_mean",
                                                          "full_logits_dr_grpo", "self_imitation_sil_loss") else 2)
    for a, b in zip(g_call, g_merged):
        assert float(a.abs().max()) > 0
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())
    # the loss is a signed sum of per-token terms of size ~|advantage| (~0.5) that nearly cancel
    # (per_rollout_mean: 3.9e-4): float32 summed in another order differs by ~1e-8 absolute
    # (1.3e-8 seen in make test, 3.3e-5 of that small total), so the bound is absolute, 1e-6;
    # one token of a few hundred left out or weighed wrongly moves it by ~1e-3
    for key in ("loss", "approx_kl", "clip_frac", *(("ref_kl",) if "ref_model" in options else ())):
        assert merged[key] == pytest.approx(per_call[key], rel=1e-5, abs=1e-6), key
    assert 0 < per_call["clip_frac"] < 1  # the clip acts on some tokens, not on all
    for key in ("completion_tokens", "weighted_advantage", "mean_advantage", "samples"):
        assert merged[key] == pytest.approx(per_call[key]), key
    assert "prefix_merge_rows" not in per_call
    assert merged["prefix_merge_tokens_per_call"] == per_call["tokens"]
    assert merged["tokens"] == merged["prefix_merge_tokens"] < per_call["tokens"]
    if name == "prefix_tree_mini_batches_kl":  # content order cuts the episodes' chains
        assert merged["prefix_merge_mini_batch_cuts"] == merged["prefix_merge_rows"] - 5
    elif name.startswith("self_imitation"):  # 9 calls dropped (zero variance), 5 positive earlier ones replayed:
        # 2 rows more
        assert (merged["dropped_zero_variance"], merged["replayed"]) == (9, 5)
        assert (merged["prefix_merge_rows"], merged["prefix_merge_links"]) == (7, 7)
    else:
        assert (merged["prefix_merge_rows"], merged["prefix_merge_links"]) == (5, 4)
        assert merged["prefix_merge_breaks"] == _no_breaks(retokenisation=1)


def test_prefix_merge_through_deepspeed_matches_per_call(tokenizer):
    """The same through build_engine (DeepSpeed ZeRO-2, Adam): the update's loss and DeepSpeed's
    gradient norm agree to 1e-5 relative, and the weights after the step to 1e-5 (measured: the
    same grad norm to every printed digit, weights 6.2e-7 apart at most; Adam's first step is
    ~lr x sign(g) = 1e-3, so a gradient entry that changed sign would show as ~2e-3)."""
    deepspeed_updates_agree(with_behaviour(math_group(tokenizer), tiny_policy()), "prefix_merge")


def deepspeed_updates_agree(calls: list[dict], option: str, **common) -> None:
    """One train_update of ``calls`` through build_engine (DeepSpeed ZeRO-2, Adam, lr 1e-3, micro-batch 4)
    with boolean ``option`` off and on (``common``: the other keywords of both): the loss and the gradient
    norm agree to 1e-5 relative, the weights after the step to 1e-5 absolute."""
    out = {}
    for on in (False, True):
        engine = train.build_engine(tiny_policy(), lr=1e-3, micro_batch=4)
        m = train.train_update(engine, copy.deepcopy(calls), micro_batch=4, **{option: on}, **common)
        out[on] = (m, torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()]))
    (m0, w0), (m1, w1) = out[False], out[True]
    assert m1["loss"] == pytest.approx(m0["loss"], rel=1e-5)
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-5)
    assert float((w0 - w1).abs().max()) <= 1e-5


def test_the_trainer_counts_merges_in_status_and_the_update_line(tokenizer, monkeypatch, tmp_path):
    """Trainer._train with prefix_merge on (the engine a GradEngine, nothing published): /status's
    ``prefix_merge`` adds up the updates' rows, links, breaks and tokens; the update log line has them."""
    import asyncio
    import json

    monkeypatch.setattr(train.checkpoint, "make_client", lambda settings: None)
    t = train.Trainer(TrainerConfig(run="unit", http=False, log_path=tmp_path / "t.jsonl", prefix_merge=True,
                                    checkpoint_every=100))
    t.engine = GradEngine(tiny_policy())
    t.state.trained_offsets = {f"{t.cfg.samples_topic}:0": 0}  # where the run started
    calls = with_behaviour(math_group(tokenizer), tiny_policy())
    for update in range(2):
        asyncio.run(t._train([(0, 9 * update + k, c) for k, c in enumerate(copy.deepcopy(calls))], pad_id=2))
    assert t.status()["prefix_merge"] == {"enabled": True, "rows": 10, "links": 8, "tokens": 2 * 1628,
                                          "tokens_per_call": 2 * 2848, "breaks": _no_breaks(retokenisation=2)}
    line = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines() if '"update"' in x][-1]
    assert (line["prefix_merge_rows"], line["prefix_merge_breaks"]) == (5, _no_breaks(retokenisation=1))
    # the manifest of the next checkpoint carries the last update's counts, breaks by cause
    carried = train.manifest_metrics(t.state.last_metrics)
    assert (carried["prefix_merge_rows"], carried["prefix_merge_links"]) == (5, 4)
    assert {k: v for k, v in carried.items() if k.startswith("prefix_merge_breaks_")} == {
        f"prefix_merge_breaks_{cause}": n for cause, n in _no_breaks(retokenisation=1).items()}
    assert "loss_agg" not in carried and carried["loss"] == pytest.approx(line["loss"], abs=1e-6)  # the line rounds


def test_manifest_metrics_hand_computed():
    assert train.manifest_metrics({"loss": 0.1, "steps": 2, "loss_agg": "token_mean",
                                   "prefix_merge_breaks": {"truncation": 2, "same_prompt": 0}}) == {
        "loss": 0.1, "steps": 2, "prefix_merge_breaks_truncation": 2, "prefix_merge_breaks_same_prompt": 0}
