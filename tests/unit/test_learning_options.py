"""The learning options of issue 18 on hand-computed values: Dr. GRPO advantages, the
zero-variance filter, sequence-mean aggregation, deterministic mini-batches, the reference
KL, and their use inside ``train_update`` with the trainer's own DeepSpeed engine on a tiny
random Qwen2 (no stack)."""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch

import deepspeed  # noqa: F401  (installed by infra/bootstrap.sh)
from tiny_models import tiny_qwen2

from spanrl.trainer import losses
from spanrl.trainer.self_imitation import SelfImitationBuffer, positive_entries
from spanrl.trainer.train import (build_engine, load_reference_model, sample_advantages, sample_key, token_advantages,
                                  train_update)


# ---- pure functions ----------------------------------------------------------------------

def test_dr_grpo_advantages_hand_computed():
    # a format-only group: five answers formatted (0.1), one not (0): mean 0.5/6
    mean = 0.5 / 6
    got = losses.dr_grpo_advantages([0.1] * 5 + [0.0], [mean] * 6)
    assert got == pytest.approx([0.1 - mean] * 5 + [-mean])
    assert got[0] == pytest.approx(0.016667, abs=1e-6) and got[-1] == pytest.approx(-0.083333, abs=1e-6)
    # GRPO's std scaling turns the same group into +0.447 / -2.236
    std = math.sqrt((5 * (0.1 - mean) ** 2 + mean ** 2) / 6)
    assert (0.1 - mean) / std == pytest.approx(0.4472, abs=1e-4) and -mean / std == pytest.approx(-2.2361, abs=1e-4)
    assert losses.dr_grpo_advantages([1.0, 0.0], [0.5, 0.5]) == [0.5, -0.5]
    with pytest.raises(ValueError):
        losses.dr_grpo_advantages([1.0], [0.5, 0.5])


def test_negative_weighted_advantages_hand_computed():
    assert losses.negative_weighted_advantages([0.5, -0.25, -0.25], 0.5) == [0.5, -0.125, -0.125]
    assert losses.negative_weighted_advantages([0.5, -0.25, 0.0], 0.0) == [0.5, 0.0, 0.0]
    assert losses.negative_weighted_advantages([0.5, -0.25], 1.0) == [0.5, -0.25]
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError):
            losses.negative_weighted_advantages([0.5], bad)


def test_zero_variance_samples():
    assert losses.zero_variance_samples([0.0, 0.5, 0.0], [6, 6, 1]) == [True, False, False]
    assert losses.zero_variance_samples([], []) == []
    with pytest.raises(ValueError):
        losses.zero_variance_samples([0.0], [])


def test_sequence_mean_weights():
    assert losses.sequence_loss_weights(["a", "a", "b"], [2, 2, 4], "sequence_mean") == [1 / 6, 1 / 6, 1 / 12]


def test_mini_batch_indices_are_sorted_and_balanced():
    assert losses.mini_batch_indices(["c", "a", "b", "d", "e"], 2) == [[1, 2, 0], [3, 4]]
    assert losses.mini_batch_indices(["b", "a"], 5) == [[1], [0]]  # capped at the sample count
    assert losses.mini_batch_indices([], 3) == []
    assert losses.mini_batch_indices(list("zyxwvu"), 3) == [[5, 4], [3, 2], [1, 0]]
    with pytest.raises(ValueError):
        losses.mini_batch_indices(["a"], 0)


def test_reference_kl_hand_computed():
    logp = torch.full((1, 3), math.log(0.5))
    ref = torch.full((1, 3), math.log(0.25))
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    assert float(losses.reference_kl(logp, ref, mask)) == pytest.approx(0.5 - math.log(0.5) - 1.0, abs=1e-6)
    assert float(losses.reference_kl(logp, logp, mask)) == 0.0


def test_ppo_clip_loss_adds_the_kl_term():
    # ratio 1 (logp = behaviour), advantage 1: PPO term -1 per token; k3 to ref adds 0.1931 * coef
    logp = torch.full((1, 2), math.log(0.5))
    ref = torch.full((1, 2), math.log(0.25))
    mask, adv = torch.ones(1, 2), torch.ones(1, 2)
    plain = losses.ppo_clip_loss(logp, logp, adv, mask)
    with_kl = losses.ppo_clip_loss(logp, logp, adv, mask, kl_coef=0.5, ref_logp=ref)
    assert float(plain) == pytest.approx(-1.0)
    assert float(with_kl) == pytest.approx(-1.0 + 0.5 * (0.5 - math.log(0.5) - 1.0), abs=1e-6)


def _sample(task: str, ret: float, mean: float, std: float, adv: float, comp: list[int], n: int = 4) -> dict:
    return {"advantage": adv, "group_id": task, "group_rollouts": n, "group_mean": mean, "group_std": std,
            "transition": {"task_id": task, "rollout_id": f"{task}-{ret}-{comp}", "attempt_id": "0",
                           "prompt_token_ids": [1, 5, 9], "completion_token_ids": comp,
                           "behaviour_logprobs": [-1.0] * len(comp), "episode_return": ret, "reward": ret,
                           "policy_version": 0}}


def test_sample_advantages_dr_grpo_uses_the_group_mean():
    batch = [_sample("t", 1.0, 0.25, 0.433, 1.732, [3]), _sample("t", 0.0, 0.25, 0.433, -0.577, [4])]
    assert sample_advantages(batch) == pytest.approx([1.732, -0.577])
    assert sample_advantages(batch, advantage_std_scale=False) == pytest.approx([0.75, -0.25])


def test_sample_key_orders_by_content_not_by_rollout_id():
    a = _sample("t1", 1.0, 0.5, 0.5, 1.0, [3, 4])
    b = copy.deepcopy(a)
    b["transition"]["rollout_id"] = "another-random-id"
    assert sample_key(a) == sample_key(b)
    c = _sample("t1", 1.0, 0.5, 0.5, 1.0, [3, 5])
    assert sample_key(a) != sample_key(c)
    assert sample_key(_sample("t0", 0.0, 0.5, 0.5, -1.0, [9]))[0] < sample_key(a)[0]


# ---- inside train_update -----------------------------------------------------------------

VOCAB = 48


def tiny_model(seed: int = 0):
    return tiny_qwen2(VOCAB, 32, seed)


def _batch() -> list[dict]:
    rng = random.Random(0)
    out = []
    for g in range(4):
        rets = [1.0, 0.0, 0.0, 1.0] if g < 2 else [0.1] * 4  # groups 2, 3: zero variance
        mean = sum(rets) / 4
        std = math.sqrt(sum((r - mean) ** 2 for r in rets) / 4)
        for r in rets:
            comp = [rng.randrange(8, VOCAB) for _ in range(3)]
            out.append(_sample(f"task-{g}", r, mean, std, 0.0 if std == 0 else (r - mean) / std, comp))
    return out


def _params(engine) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])


def test_zero_variance_groups_are_dropped_and_counted():
    samples = _batch()
    engine = build_engine(tiny_model(), lr=1e-3, micro_batch=4)
    m = train_update(engine, samples, drop_zero_variance=True)
    assert (m["samples_received"], m["dropped_zero_variance"], m["samples"], m["steps"]) == (16, 8, 8, 1)
    before = _params(engine)
    only_flat = [s for s in samples if s["group_std"] == 0]
    m = train_update(engine, only_flat, drop_zero_variance=True)
    assert (m["dropped_zero_variance"], m["samples"], m["steps"]) == (8, 0, 0)
    assert torch.equal(before, _params(engine))  # nothing left: no step was taken


def test_negative_weight_zero_leaves_punished_samples_without_gradient():
    """With negative_advantage_weight 0 an update of only negative-advantage samples takes a
    step that changes nothing (Adam's first step on a zero gradient is zero); with 1 the same
    samples move the weights, and the update's weighted advantage reports the scaled values."""
    negatives = [s for s in _batch() if s["advantage"] < 0]
    assert len(negatives) == 4
    for s in negatives:  # behaviour far less likely than now: ratio > 1, so A < 0 is not clipped
        s["transition"]["behaviour_logprobs"] = [-10.0] * len(s["transition"]["completion_token_ids"])
    moved = {}
    for w in (0.0, 1.0):
        engine = build_engine(tiny_model(), lr=1e-2, micro_batch=4)
        before = _params(engine)
        m = train_update(engine, negatives, negative_advantage_weight=w)
        assert m["steps"] == 1
        moved[w] = float((_params(engine) - before).abs().max())
        assert m["mean_advantage"] == pytest.approx(w * -1.0)  # each (0 - 0.5) / 0.5
    assert moved[0.0] == 0.0 and moved[1.0] > 0.0


def test_arrival_order_does_not_change_the_update():
    samples = _batch()
    shuffled = samples[:]
    random.Random(3).shuffle(shuffled)
    e1 = build_engine(tiny_model(), lr=1e-2, micro_batch=3)
    e2 = build_engine(tiny_model(), lr=1e-2, micro_batch=3)
    m1 = train_update(e1, samples, mini_batches=2)
    m2 = train_update(e2, shuffled, mini_batches=2)
    assert (m1["steps"], m1["mini_batches"]) == (2, 2)
    assert torch.equal(_params(e1), _params(e2))
    assert m1["loss"] == m2["loss"]


def test_kl_to_the_reference_policy_is_computed_and_holds_the_policy_back(tmp_path):
    """ref_kl is 0 while the policy equals the reference and grows as it moves; with a large
    kl_coef it grows less than without."""
    tiny_model().save_pretrained(str(tmp_path), safe_serialization=True)
    ref = load_reference_model(tmp_path)
    assert not any(p.requires_grad for p in ref.parameters())
    samples = [s for s in _batch() if s["group_std"] > 0]
    kls = {}
    for coef in (0.0, 5.0):
        engine = build_engine(tiny_model(), lr=3e-2, micro_batch=8)
        first = train_update(engine, samples, kl_coef=coef, ref_model=ref) if coef else None
        for _ in range(4):
            m = train_update(engine, samples, kl_coef=coef, ref_model=ref)
        kls[coef] = m["ref_kl"]
        if first is not None:
            assert first["ref_kl"] == pytest.approx(0.0, abs=1e-7)  # step 1 starts at the reference
    assert kls[0.0] > 0.0
    assert kls[5.0] < kls[0.0]
    no_ref = train_update(build_engine(tiny_model(), lr=1e-3), samples, kl_coef=0.1)
    assert "ref_kl" not in no_ref  # no reference model: nothing is computed or claimed


# ---- prefix-tree advantages (TreeRL's global advantage on a group's common prefixes) ------

def test_prefix_tree_advantages_hand_computed():
    b = 1 / 3
    got = losses.prefix_tree_advantages(["g"] * 3, [[5, 6], [5, 7], [8]], [1.0, 0.0, 0.0],
                                        [1 - b, -b, -b], [1.0] * 3)
    assert got == [pytest.approx([0.5 - b, 1 - b]), pytest.approx([0.5 - b, -b]), pytest.approx([-b])]
    # a prefix every completion of the root shares gets mean(R) - b = 0; GRPO's scale applies to it
    got = losses.prefix_tree_advantages(["g", "g"], [[4, 1], [4, 2]], [1.0, 0.0], [1.0, -1.0], [2.0, 2.0])
    assert got == [[0.0, 1.0], [0.0, -1.0]]
    # different roots (another prompt, another group) share nothing: the sample's advantage throughout
    got = losses.prefix_tree_advantages(["g", "h"], [[4, 1], [4, 2]], [1.0, 0.0], [0.5, -0.5], [1.0, 1.0])
    assert got == [[0.5, 0.5], [-0.5, -0.5]]
    assert losses.prefix_tree_advantages([], [], [], [], []) == []
    with pytest.raises(ValueError):
        losses.prefix_tree_advantages(["g"], [[1]], [1.0], [0.5], [])


def test_token_advantages_root_by_group_and_prompt():
    """Calls of one group with the same prompt share a root, under Dr. GRPO's scale 1 or
    GRPO's 1 / std; a call with another prompt (e.g. the second call, after the tool result)
    is a root of its own."""
    s = [_sample("t", 1.0, 0.5, 0.5, 1.0, [3, 4]), _sample("t", 0.0, 0.5, 0.5, -1.0, [3, 6]),
         _sample("t", 0.0, 0.5, 0.5, -1.0, [3, 7])]
    s[2]["transition"]["prompt_token_ids"] = [1, 5, 9, 2]
    dr = sample_advantages(s, advantage_std_scale=False)
    assert dr == pytest.approx([0.5, -0.5, -0.5])
    got = token_advantages(s, dr, advantage_std_scale=False)
    assert got == [pytest.approx([0.0, 0.5]), pytest.approx([0.0, -0.5]), pytest.approx([-0.5, -0.5])]
    got = token_advantages(s, sample_advantages(s), advantage_std_scale=True)  # scale 1 / (0.5 + 1e-6)
    assert got[0] == pytest.approx([0.0, 1.0], abs=1e-5) and got[1] == pytest.approx([0.0, -1.0], abs=1e-5)


def test_prefix_tree_advantage_in_train_update():
    """The option changes the update exactly as the per-token advantages say: two completions
    of one prompt that share their first token, one rewarded, one not. Under plain Dr. GRPO
    the shared token gets +0.5 in one sample and -0.5 in the other (cancelling only inside a
    step); with the prefix tree it gets 0 in both. Split into two mini-batches (one sample
    each), the two settings therefore give different weights; in one mini-batch, where the
    shared token's two terms cancel, the same weights up to rounding."""
    s = [_sample("t", 1.0, 0.5, 0.5, 1.0, [20, 21, 22]), _sample("t", 0.0, 0.5, 0.5, -1.0, [20, 30, 31])]
    for x in s:
        x["transition"]["behaviour_logprobs"] = [-math.log(VOCAB)] * 3
    out = {}
    for tree in (False, True):
        for minis in (1, 2):
            torch.manual_seed(0)
            engine = build_engine(tiny_model(), lr=1e-2, micro_batch=4)
            m = train_update(engine, copy.deepcopy(s), advantage_std_scale=False, mini_batches=minis,
                             prefix_tree_advantage=tree)
            assert m["steps"] == minis
            out[tree, minis] = _params(engine)
    same, split = ((out[False, k] - out[True, k]).abs().max().item() for k in (1, 2))
    # one step: equal up to Adam's normalisation of rounding-level gradient differences (1.6e-5
    # measured); two steps: the shared token moved up then down in plain GRPO (0.04 measured)
    assert same < 1e-4 and split > 1e-2
    with pytest.raises(ValueError):
        train_update(build_engine(tiny_model(), lr=1e-2), copy.deepcopy(s), algorithm="reinforce_pp",
                     prefix_tree_advantage=True)


# ---- self-imitation (SPANRL_TRAINER_SELF_IMITATION_UPDATES) --------------------------------

def test_positive_entries_hand_computed():
    s = [_sample("t", r, 0.5, 0.5, 0.0, [3 + i]) for i, r in enumerate((1.0, 0.5, 0.0, 0.6))]
    got = positive_entries(s, [0.5, 0.0, -0.25, 0.1])
    assert [(x is s[0], a, row) for x, a, row in got[:1]] == [(True, 0.5, None)]
    assert [x["transition"]["completion_token_ids"] for x, _, _ in got] == [[3], [6]]
    assert [a for _, a, _ in got] == [0.5, 0.1]
    rows = [[0.0, 0.5], [0.0], [-0.25], [0.1, 0.1]]
    assert [row for _, _, row in positive_entries(s, [0.5, 0.0, -0.25, 0.1], rows)] == [[0.0, 0.5], [0.1, 0.1]]
    with pytest.raises(ValueError):
        positive_entries(s, [0.5])
    with pytest.raises(ValueError):
        positive_entries(s, [0.5, 0.0, -0.25, 0.1], rows[:2])


def test_self_imitation_buffer_keeps_the_last_updates():
    buf = SelfImitationBuffer(2)
    a, b, c = ({"id": k} for k in "abc")
    buf.add([(a, 0.5, None)])
    buf.add([])  # an update without positives still takes its slot
    assert [x["id"] for x, _, _ in buf.entries()] == ["a"] and len(buf) == 1
    buf.add([(b, 0.2, None), (c, 0.1, None)])  # a's update is now 3 updates old: dropped
    assert [x["id"] for x, _, _ in buf.entries()] == ["b", "c"] and len(buf) == 2
    with pytest.raises(ValueError):
        SelfImitationBuffer(0)


def _completion_logprob(engine, sample: dict) -> float:
    t = sample["transition"]
    ids = torch.tensor([t["prompt_token_ids"] + t["completion_token_ids"]])
    with torch.no_grad():
        logits = engine.module(input_ids=ids).logits
    n = len(t["completion_token_ids"])
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[0, -n:] = 1.0
    return float(losses.token_logprobs(logits, ids, mask).sum())


def test_self_imitation_in_train_update():
    """Update 1 (Dr. GRPO) puts its positive-advantage samples, with the advantages it trained
    them with (R - mean = +0.5), into the buffer, and only those. Update 2 is given only punished
    samples with negative weight 0 (no gradient of their own): without the buffer it changes
    nothing; with it, the replayed positives are what moves the weights, towards them (their
    log-likelihood rises), and they are counted as replayed, not as samples."""
    batch = [s for s in _batch() if s["group_std"] > 0]  # 2 groups: returns [1, 0, 0, 1]
    negatives = copy.deepcopy([s for s in batch if s["transition"]["episode_return"] == 0.0])
    buf = SelfImitationBuffer(3)
    engine = build_engine(tiny_model(), lr=1e-2, micro_batch=4)
    m1 = train_update(engine, copy.deepcopy(batch), advantage_std_scale=False, self_imitation=buf)
    assert (m1["samples"], m1["replayed"]) == (8, 0)  # an empty buffer at the first update
    assert len(buf) == 4
    assert sorted(a for _, a, _ in buf.entries()) == [0.5] * 4
    assert all(s["transition"]["episode_return"] == 1.0 for s, _, _ in buf.entries())
    replayed = [s for s, _, _ in buf.entries()]
    moved, gain = {}, {}
    for use in (False, True):
        model = tiny_model()
        model.load_state_dict(engine.module.state_dict())  # update 1's weights (before the optimizer sees them)
        e = build_engine(model, lr=1e-2, micro_batch=4)
        before_p, before_lp = _params(e), sum(_completion_logprob(e, s) for s in replayed)
        b = SelfImitationBuffer(3)
        b.add(buf.entries())
        m2 = train_update(e, copy.deepcopy(negatives), advantage_std_scale=False, negative_advantage_weight=0.0,
                          self_imitation=b if use else None)
        moved[use] = float((_params(e) - before_p).abs().max())
        gain[use] = sum(_completion_logprob(e, s) for s in replayed) - before_lp
        if use:
            assert (m2["samples"], m2["replayed"], m2["replayed_tokens"]) == (4, 4, 12)
            assert len(b) == 4  # update 1's positives stay (3 slots); update 2 had none: an empty slot
        else:
            assert "replayed" not in m2
    assert moved[False] == 0.0 and moved[True] > 0.0
    assert gain[True] > 0.0


def test_self_imitation_with_prefix_tree_keeps_token_rows():
    s = [_sample("t", 1.0, 0.5, 0.5, 1.0, [20, 21, 22]), _sample("t", 0.0, 0.5, 0.5, -1.0, [20, 30, 31])]
    buf = SelfImitationBuffer(1)
    train_update(build_engine(tiny_model(), lr=1e-2), copy.deepcopy(s), advantage_std_scale=False,
                 prefix_tree_advantage=True, self_imitation=buf)
    # the shared first token gets mean return - mean = 0, the rest R - mean = +0.5 (as trained)
    assert [(a, row) for _, a, row in buf.entries()] == [(0.5, pytest.approx([0.0, 0.5, 0.5]))]
    with pytest.raises(ValueError):  # a per-token entry replayed into a per-sample update
        train_update(build_engine(tiny_model(), lr=1e-2), copy.deepcopy(s), advantage_std_scale=False,
                     self_imitation=buf)


def test_an_update_without_new_samples_adds_nothing():
    flat = [s for s in _batch() if s["group_std"] == 0]
    buf = SelfImitationBuffer(2)
    buf.add([(_sample("t", 1.0, 0.5, 0.5, 0.5, [9]), 0.5, None)])
    m = train_update(build_engine(tiny_model(), lr=1e-2), flat, drop_zero_variance=True, self_imitation=buf)
    assert (m["steps"], m["replayed"]) == (0, 0) and len(buf) == 1


def test_self_imitation_weight_scales_replayed_advantages():
    """SIL's beta^sil: a replayed entry's advantage (or per-token row) times the weight; the
    weight changes the update only through the replayed samples' share of the loss (Adam
    would undo a common scale), so with new samples of their own it moves the weights
    differently, and weight <= 0 is refused."""
    buf = SelfImitationBuffer(1, weight=2.0)
    assert buf.replay_advantage(({}, 0.25, None)) == 0.5
    assert buf.replay_advantage(({}, 0.25, [0.1, 0.3])) == pytest.approx([0.2, 0.6])
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError):
            SelfImitationBuffer(1, weight=bad)
    batch = [s for s in _batch() if s["group_std"] > 0]
    first = build_engine(tiny_model(), lr=1e-2, micro_batch=4)
    seed = SelfImitationBuffer(1)
    train_update(first, copy.deepcopy(batch), advantage_std_scale=False, self_imitation=seed)
    after = {}
    for weight in (1.0, 4.0):
        model = tiny_model()
        model.load_state_dict(first.module.state_dict())
        e = build_engine(model, lr=1e-2, micro_batch=4)
        b = SelfImitationBuffer(2, weight=weight)
        b.add(seed.entries())
        train_update(e, copy.deepcopy(batch), advantage_std_scale=False, self_imitation=b)
        after[weight] = _params(e)
    assert float((after[1.0] - after[4.0]).abs().max()) > 0.0


def test_self_imitation_loss_hand_computed():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    adv = torch.tensor([[0.5, -0.5, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = torch.full((1, 3), 0.25)
    loss = losses.self_imitation_loss(logp, adv, mask, w)
    assert float(loss) == pytest.approx(0.25 * 0.5 * 1.0)  # the negative and the masked tokens add nothing
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.125, 0.0, 0.0])  # -A+ * w, whatever the ratio
    # with the k3 term to a reference: + kl_coef * (e^(ref - logp) - (ref - logp) - 1) * w per token
    ref = torch.tensor([[-1.5, -2.0, -3.0]])
    k3 = math.exp(-0.5) + 0.5 - 1.0
    got = losses.self_imitation_loss(logp.detach(), adv, mask, w, kl_coef=0.1, ref_logp=ref)
    assert float(got) == pytest.approx(0.125 + 0.1 * k3 * 0.25)
    with pytest.raises(ValueError):
        SelfImitationBuffer(1, loss="unclipped")


def test_sil_loss_pushes_replayed_samples_past_the_clip():
    """Replayed positives whose ratio to their behaviour log-probs is far above 1 + clip_eps:
    under the update's PPO clip they give no gradient (the weights do not move when the new
    samples have none of their own either); under SIL's loss they are pushed up all the same."""
    batch = [s for s in _batch() if s["group_std"] > 0]
    negatives = copy.deepcopy([s for s in batch if s["transition"]["episode_return"] == 0.0])
    first = build_engine(tiny_model(), lr=1e-2, micro_batch=4)
    seed = SelfImitationBuffer(1)
    train_update(first, copy.deepcopy(batch), advantage_std_scale=False, self_imitation=seed)
    entries = []
    for s, a, row in seed.entries():
        s = copy.deepcopy(s)
        s["transition"]["behaviour_logprobs"] = [-30.0] * len(s["transition"]["completion_token_ids"])
        entries.append((s, a, row))
    moved, gain = {}, {}
    for loss in ("clipped", "sil"):
        model = tiny_model()
        model.load_state_dict(first.module.state_dict())
        e = build_engine(model, lr=1e-2, micro_batch=4)
        before_p = _params(e)
        before_lp = sum(_completion_logprob(e, s) for s, _, _ in entries)
        b = SelfImitationBuffer(1, loss=loss)
        b.add(entries)
        m = train_update(e, copy.deepcopy(negatives), advantage_std_scale=False, negative_advantage_weight=0.0,
                         self_imitation=b)
        assert (m["samples"], m["replayed"]) == (4, 4)
        moved[loss] = float((_params(e) - before_p).abs().max())
        gain[loss] = sum(_completion_logprob(e, s) for s, _, _ in entries) - before_lp
    assert moved["clipped"] == 0.0
    assert moved["sil"] > 0.0 and gain["sil"] > 0.0
