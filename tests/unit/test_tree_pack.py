"""Tree packing (trainer/tree_pack.py, SPANRL_TRAINER_TREE_PACKING).

Hand-computed packings and micro-batch groupings on small token lists; the exactness claim on a
tiny Qwen2 with transformers' sdpa attention (the trainer's): packed log-probs and gradients equal
the rows' forwarded one by one, and train_update with tree packing gives the unpacked update's
loss, metrics and every step's gradient, on the math agent's real calls, merged or not."""
from __future__ import annotations

import pytest
import torch

import test_prefix_merge as pm  # the math agent's calls and the gradient-recording engine
from tiny_models import tiny_qwen2

from spanrl.core.settings import TrainerConfig
from spanrl.trainer import batching, tracking, train, tree_pack

tokenizer = pm.tokenizer  # the module-scoped fixture: SmolLM2's tokenizer from the converted model


# ---- hand-computed packings ------------------------------------------------------------------

def test_pack_rows_hand_computed():
    p = tree_pack.pack_rows([[5, 6, 8, 9], [5, 6, 7]])  # sorted: [5, 6, 7] first
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert p.position_ids.tolist() == [[0, 1, 2, 2, 3]]
    assert p.index.tolist() == [[0, 1, 3, 4], [0, 1, 2, 0]]
    assert (p.tokens, p.row_tokens, p.lengths) == (5, 7, [4, 3])
    assert p.attention_mask.shape == (1, 1, 5, 5)
    assert p.attention_mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0],
                                                    [1, 1, 0, 0, 0],
                                                    [1, 1, 1, 0, 0],   # 7 sees 5, 6
                                                    [1, 1, 0, 1, 0],   # 8 sees 5, 6, not 7
                                                    [1, 1, 0, 1, 1]]


def test_pack_rows_equal_rows_prefix_rows_and_no_sharing():
    p = tree_pack.pack_rows([[1, 2, 3], [1, 2, 3], [1, 2], [4]])
    assert p.input_ids.tolist() == [[1, 2, 3, 4]]  # the equal row and the prefix row add nothing
    assert p.index.tolist() == [[0, 1, 2], [0, 1, 2], [0, 1, 0], [3, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0]]
    assert p.attention_mask[0, 0, 3].int().tolist() == [0, 0, 0, 1]  # row [4] sees only itself
    with pytest.raises(ValueError, match="at least one row"):
        tree_pack.pack_rows([])
    with pytest.raises(ValueError, match="empty row"):
        tree_pack.pack_rows([[1], []])
    assert tree_pack.pack_rows([[1, 2], [1]], width=4).index.tolist() == [[0, 1, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="width 1"):
        tree_pack.pack_rows([[1, 2]], width=1)


def test_pack_batch_reads_the_right_padded_rows():
    b = batching.collate([pm._call([5, 6], [8, 9]), pm._call([5, 6], [7])], pad_token_id=0)
    p = tree_pack.pack_batch(b.input_ids, b.attention_mask)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert p.index.tolist() == [[0, 1, 3, 4], [0, 1, 2, 0]]


def test_tree_budget_batches_hand_computed():
    rows = [[1, 2, 3], [9, 9], [1, 2, 4]]
    assert tree_pack.tree_budget_batches(rows, 4, 8) == [[0, 2], [1]]  # 1, 2, 3, 4 packed; 9, 9 would be 6
    assert tree_pack.tree_budget_batches(rows, 100, 2) == [[0, 2], [1]]  # two rows at most
    assert tree_pack.tree_budget_batches(rows, 3, 8) == [[0], [2], [1]]  # 2 shared + 1 new would be 4
    assert tree_pack.tree_budget_batches([[1] * 10], 4, 8) == [[0]]  # longer than the budget: alone
    with pytest.raises(ValueError):
        tree_pack.tree_budget_batches(rows, 0, 8)


# ---- exactness on a tiny Qwen2 ---------------------------------------------------------------

def _rows_with_shared_prefixes(seed: int = 0) -> list[dict]:
    """Six calls: a 30-token system prefix shared by all, two 'questions' of 12 tokens shared
    within a group of three, completions of 3-7 tokens."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()  # noqa: E731
    system = rnd(30)
    calls = []
    for q in range(2):
        question = rnd(12)
        for k in range(3):
            completion = rnd(3 + 2 * k)
            calls.append(pm._call(system + question, completion, rollout=f"r{q}{k}", adv=(k - 1) * 0.5))
    return calls


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_logprobs_and_gradients_equal_the_rows_alone(checkpointing):
    """completion_logprobs with a TreePack: the log-probs of every completion token equal the
    unpacked batch's to 1e-5 and the weight gradient of their sum to 1e-5 x its largest entry
    (float32; the sdpa attention the trainer loads, with HF activation checkpointing or not)."""
    calls = _rows_with_shared_prefixes()
    b = batching.collate(calls)
    K = batching.completion_window(b)
    pack = tree_pack.pack_batch(b.input_ids, b.attention_mask)
    assert pack.tokens == 30 + 2 * 12 + sum(3 + 2 * k for k in range(3)) * 2 < pack.row_tokens
    out = {}
    for packed in (False, True):
        model = tiny_qwen2(500, 32, seed=1)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        logp = train.completion_logprobs(model, b.input_ids, b.attention_mask, b.completion_mask, K, 4,
                                         pack=pack if packed else None)
        logp.sum().backward()
        out[packed] = (logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]))
    (l0, g0), (l1, g1) = out[False], out[True]
    mask = b.completion_mask[:, -K:] > 0
    assert int(mask.sum()) == 30 and float(l0[mask].abs().min()) > 0
    assert float((l0 - l1)[mask].abs().max()) <= 1e-5
    assert float((l1[~mask]).abs().max()) == 0.0  # padding and prompt positions stay 0
    assert float((g0 - g1).abs().max()) <= 1e-5 * float(g0.abs().max())


TREE_OPTIONS = {k: v for k, v in pm.OPTIONS.items() if not v.get("logprob_chunk") == 0}


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("name", list(TREE_OPTIONS))
def test_tree_packed_update_equals_the_unpacked_one(tokenizer, name, merge):
    """On the math agent's calls (real token ids; every call shares the system prompt and
    few-shot turns), train_update with ``tree_packing`` gives the unpacked update's loss,
    approx_kl, clip fraction (and ref_kl) to 1e-5 relative / 1e-6 absolute and each optimizer
    step's gradient to 1e-5 x its largest entry, with prefix_merge on or off; it forwards fewer tokens."""
    (plain, g_plain), (packed, g_packed), options = pm.update_pair(tokenizer, name, "tree_packing",
                                                                  prefix_merge=merge, micro_batch_tokens=4096)
    assert len(g_plain) == len(g_packed) >= 1
    for a, b in zip(g_plain, g_packed):
        assert float(a.abs().max()) > 0
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())
    for key in ("loss", "approx_kl", "clip_frac", *(("ref_kl",) if "ref_model" in options else ())):
        assert packed[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
    for key in ("completion_tokens", "weighted_advantage", "samples"):
        assert packed[key] == pytest.approx(plain[key]), key
    assert "tree_pack_tokens" not in plain
    assert packed["tree_pack_tokens"] < packed["tree_pack_row_tokens"]
    scalars = tracking.update_scalars(packed, [], trained_version=0)
    assert (scalars["train/tree_pack_tokens"], scalars["train/tree_pack_row_tokens"]) == (
        packed["tree_pack_tokens"], packed["tree_pack_row_tokens"])


def test_tree_packing_through_deepspeed_matches_unpacked(tokenizer):
    """Through build_engine (DeepSpeed ZeRO-2, Adam): loss and gradient norm to 1e-5 relative,
    the weights after the step to 1e-5 (Adam's first step is ~lr = 1e-3 per entry)."""
    pm.deepspeed_updates_agree(pm.with_behaviour(pm.math_group(tokenizer), pm.tiny_policy()), "tree_packing",
                               prefix_merge=True, micro_batch_tokens=4096)


def test_tree_packing_needs_chunked_logprobs(tokenizer, monkeypatch, tmp_path):
    calls = pm.with_behaviour(pm.math_group(tokenizer), pm.tiny_policy())
    with pytest.raises(ValueError, match="tree_packing needs logprob_chunk > 0"):
        train.train_update(pm.GradEngine(pm.tiny_policy()), calls, tree_packing=True, logprob_chunk=0)
    monkeypatch.setattr(train.checkpoint, "make_client", lambda settings: None)
    with pytest.raises(ValueError, match="tree_packing needs logprob_chunk > 0"):
        train.Trainer(TrainerConfig(run="unit", http=False, log_path=tmp_path / "t.jsonl", tree_packing=True,
                                    logprob_chunk=0))
    assert TrainerConfig().tree_packing is False


# ---- bench/tree_pack.py --------------------------------------------------------------------

def test_bench_picks_whole_groups_of_one_version():
    from bench.tree_pack import pick_groups

    calls = [pm._call([1], [2], rollout=f"r{k}") for k in range(5)]
    for c, (g, v) in zip(calls, [("b", 0), ("a", 0), ("c", 0), ("a", 1), ("b", 0)]):
        c["group_id"], c["transition"]["policy_version"] = g, v
    assert [calls.index(c) for c in pick_groups(calls, 0, 2)] == [0, 1, 4]
    assert [calls.index(c) for c in pick_groups(calls, 0, 0)] == [0, 1, 2, 4]
    assert pick_groups(calls, 2, 0) == []


def test_bench_trains_with_the_demo_trainer_settings_of_the_model():
    from bench.tree_pack import demo_trainer_config

    cfg = demo_trainer_config("qwen2.5-coder-0.5b")
    assert (cfg.lora_rank, cfg.lr, cfg.kl_coef, cfg.mini_batches, cfg.prefix_merge) == (16, 5e-5, 0.2, 8, True)
    assert (demo_trainer_config("smollm2-135m").lora_rank, demo_trainer_config("smollm2-135m").lr) == (0, 1e-5)

