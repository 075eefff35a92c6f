"""Issue 19 item 2: LoRA as a trainer option (trainer/lora.py, peft). On a tiny random Qwen2
(2 layers, width 32) through the trainer's own engine: only the adapters train (the base
weights stay bitwise the same), gradients reach them with activation checkpointing, the KL
reference is the same model with the adapter disabled (no second model), checkpoints hold only
the adapter, the reloader merges it into the base for vLLM (the merged model computes what the
peft model computes) and refuses an adapter of another base model."""
from __future__ import annotations

import copy
import json
import math
import random
import struct
from pathlib import Path

import pytest
import torch

import deepspeed  # noqa: F401  (installed by infra/bootstrap.sh)
from tiny_models import tiny_qwen2

from spanrl.trainer import checkpoint, lora, train
from spanrl.trainer.train import (TrainerConfig, build_engine, completion_logprobs, load_model, save_checkpoint,
                                  train_update)

VOCAB, HIDDEN, LAYERS, RANK, ALPHA = 48, 32, 2, 4, 8.0
SPEC = lora.lora_spec(RANK, ALPHA, 0.0, lora.DEFAULT_TARGET_MODULES)


def _adapter_parameters() -> int:
    """LoRA parameters of the tiny Qwen2: r * (in + out) per target projection, per layer
    (q, k, v, o: 32 -> 32; gate, up: 32 -> 64; down: 64 -> 32)."""
    shapes = [(HIDDEN, HIDDEN)] * 4 + [(HIDDEN, 2 * HIDDEN)] * 2 + [(2 * HIDDEN, HIDDEN)]
    return LAYERS * sum(RANK * (i + o) for i, o in shapes)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """The tiny base model saved as a base model directory (no manifest), with a tokenizer-like
    side file and the record spanrl/core/model.py writes beside a converted base."""
    d = tmp_path_factory.mktemp("base")
    tiny_qwen2(VOCAB, HIDDEN, 0).save_pretrained(str(d), safe_serialization=True)
    (d / "tokenizer.json").write_text('{"tiny": true}')
    (d / "spanrl_base.json").write_text(json.dumps({"base_model": "tiny-qwen2"}))
    return d


@pytest.fixture(scope="module")
def base_id(base_dir) -> str:
    """The id the trainer and the reloader give the tiny base (train.base_model_id)."""
    return train.base_model_id(base_dir)


def _samples() -> list[dict]:
    rng = random.Random(0)
    out = []
    for g in range(2):
        rets = [1.0, 0.0, 0.0, 1.0]
        for i, r in enumerate(rets):
            comp = [rng.randrange(8, VOCAB) for _ in range(3)]
            out.append({"advantage": (r - 0.5) / 0.5, "group_id": f"t{g}", "group_rollouts": 4,
                        "transition": {"task_id": f"t{g}", "rollout_id": f"t{g}-{i}", "attempt_id": "0",
                                       "prompt_token_ids": [1, 5, 9, 2 + g], "completion_token_ids": comp,
                                       "behaviour_logprobs": [-math.log(VOCAB)] * 3, "episode_return": r,
                                       "reward": r, "policy_version": 0}})
    return out


def _lora_engine(base_dir: Path, lr: float = 1e-2, checkpointing: bool = False, seed: int = 0):
    """The engine of a fresh adapter on the tiny base (peft draws A from torch's RNG: seeded)."""
    torch.manual_seed(seed)
    return build_engine(load_model(base_dir, checkpointing, adapter=SPEC), lr=lr, micro_batch=8)


def _named(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(5))


# ---- settings -------------------------------------------------------------------------

def test_settings_defaults_env_and_spec(monkeypatch):
    cfg = TrainerConfig()
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout) == (0, 32.0, 0.0)
    assert cfg.lora_target_modules == "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    assert lora.lora_spec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules) is None
    for k, v in {"RANK": "16", "ALPHA": "8", "DROPOUT": "0.05", "TARGET_MODULES": " q_proj, v_proj ,"}.items():
        monkeypatch.setenv(f"SPANRL_TRAINER_LORA_{k}", v)
    monkeypatch.setattr(train.checkpoint, "make_client", lambda settings: None)
    t = train.Trainer(TrainerConfig(run="unit", http=False))
    assert t.adapter == {"kind": "lora", "rank": 16, "alpha": 8.0, "dropout": 0.05,
                         "target_modules": ["q_proj", "v_proj"]}
    for bad, match in [((-1, 8, 0.0, "q_proj"), "lora_rank"), ((4, 0, 0.0, "q_proj"), "lora_alpha"),
                       ((4, 8, 1.0, "q_proj"), "lora_dropout"), ((4, 8, 0.0, " , "), "no module")]:
        with pytest.raises(ValueError, match=match):
            lora.lora_spec(*bad)
    for modules in ("nope_proj", "q_proj,nope_proj"):  # peft alone refuses only the first
        with pytest.raises(ValueError, match="not found in the"):
            lora.wrap(tiny_qwen2(VOCAB, HIDDEN, 0), lora.lora_spec(4, 8, 0.0, modules))


# ---- training -------------------------------------------------------------------------

def test_only_the_adapters_train_and_the_base_stays_bitwise(base_dir):
    engine = _lora_engine(base_dir)
    model = engine.module
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == _adapter_parameters() == 4352
    # the optimizer holds the adapters only (one rank: no ZeRO, the CPU Adam's own parameter groups)
    assert sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]) == _adapter_parameters()
    before = _named(model)
    m = train_update(engine, _samples(), micro_batch=8)
    assert m["steps"] == 1
    after = _named(model)
    for n, p in after.items():
        if n not in trainable:
            assert torch.equal(p, before[n]), n  # base weights: bitwise unchanged
        elif ".lora_B." in n:
            assert not torch.equal(p, before[n]), n  # B starts at 0 and gets every gradient
        else:  # A's gradient is B^T (...) = 0 while B = 0: Adam leaves it exactly where it was
            assert torch.equal(p, before[n]), n
    train_update(engine, _samples(), micro_batch=8)
    again = _named(model)
    assert all(not torch.equal(again[n], after[n]) for n in trainable)  # now A moves too
    assert all(torch.equal(again[n], before[n]) for n in before if n not in trainable)


def test_gradients_reach_the_adapters_with_activation_checkpointing(base_dir):
    grads = {}
    for ckpt in (False, True):
        torch.manual_seed(1)  # the same adapter (peft draws A at random) ...
        model = load_model(base_dir, ckpt, adapter=SPEC)
        assert model.is_gradient_checkpointing is ckpt
        with torch.no_grad():  # B != 0, so A's gradients are not 0 either
            for n, p in model.named_parameters():
                if ".lora_B." in n:
                    p.normal_(0, 0.1)
        model.train()
        ids = _ids()
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.logsumexp(-1).mean().backward()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        grads[ckpt] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads[True]) == 2 * 7 * LAYERS
    for n, g in grads[True].items():
        assert g.abs().sum() > 0, n
        assert torch.allclose(g, grads[False][n], atol=1e-6), n


def test_reference_is_the_base_model_under_the_disabled_adapter(base_dir):
    """The reference log-probs with the adapter disabled are the base model's, exactly, after the
    adapter moved; training with that reference equals training with a separate frozen copy
    (so peft's toggling of the adapters' requires_grad inside disable_adapter() leaves
    DeepSpeed's gradient hooks working)."""
    base = load_model(base_dir).eval().requires_grad_(False)
    e_disabled, e_copy = _lora_engine(base_dir), _lora_engine(base_dir)
    ref = lora.AdapterDisabled(e_disabled.module)
    first = train_update(e_disabled, _samples(), kl_coef=0.5, ref_model=ref)
    assert first["ref_kl"] == 0.0  # B = 0: the policy is the base model
    m_copy = train_update(e_copy, _samples(), kl_coef=0.5, ref_model=base)
    assert m_copy["ref_kl"] == first["ref_kl"] and m_copy["loss"] == first["loss"]
    for _ in range(2):
        m_disabled = train_update(e_disabled, _samples(), kl_coef=0.5, ref_model=ref)
        m_copy = train_update(e_copy, _samples(), kl_coef=0.5, ref_model=base)
    assert m_disabled["ref_kl"] > 0 and m_disabled["ref_kl"] == m_copy["ref_kl"]
    w_disabled, w_copy = _named(e_disabled.module), _named(e_copy.module)
    assert all(torch.equal(w_disabled[n], w_copy[n]) for n in w_copy)
    assert all(p.requires_grad for n, p in e_disabled.module.named_parameters() if ".lora_" in n)
    ids = _ids()
    mask = torch.ones_like(ids, dtype=torch.float32)
    for chunk in (0, 2):
        with torch.no_grad():
            got = completion_logprobs(ref, ids, torch.ones_like(ids), mask, 4, chunk)
            want = completion_logprobs(base, ids, torch.ones_like(ids), mask, 4, chunk)
            policy = completion_logprobs(e_disabled, ids, torch.ones_like(ids), mask, 4, chunk)
        assert torch.equal(got, want), chunk
        assert not torch.allclose(policy, want, atol=1e-4)  # the adapter does change the policy
    assert e_disabled.module.training  # AdapterDisabled ran in eval mode and put train mode back


def _trainer(monkeypatch, tmp_path, base_dir, **cfg):
    monkeypatch.setattr(train.checkpoint, "make_client", lambda settings: None)
    return train.Trainer(TrainerConfig(run="unit", http=False, base_dir=base_dir, log_path=tmp_path / "t.jsonl",
                                       micro_batch=8, **cfg))


def test_trainer_uses_the_disabled_adapter_as_reference_and_loads_no_second_model(monkeypatch, tmp_path, base_dir):
    loaded = []
    real = train.load_reference_model
    monkeypatch.setattr(train, "load_reference_model", lambda d: loaded.append(d) or real(d))
    t = _trainer(monkeypatch, tmp_path, base_dir, kl_coef=0.1, lora_rank=RANK, lora_alpha=ALPHA)
    t.load_policy()
    assert loaded == [] and isinstance(t.ref_model, lora.AdapterDisabled) and t.ref_model.module is t.engine.module
    events = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [e for e in events if e["event"] == "reference_model"][0]["adapter_disabled"] is True
    full = _trainer(monkeypatch, tmp_path, base_dir, kl_coef=0.1)  # lora_rank 0: as before, a frozen copy
    full.load_policy()
    assert loaded == [base_dir] and not hasattr(full.engine.module, "peft_config")
    assert all(p.requires_grad for p in full.engine.module.parameters())


# ---- checkpoints ----------------------------------------------------------------------

def _publish(engine, base_dir: Path, out: Path, adapter: dict | None = SPEC, base_model: str | None = None,
             version: int = 1) -> dict:
    return save_checkpoint(engine.module, base_dir, out, run="unit", version=version, parent_version=version - 1,
                           base_model=base_model or train.base_model_id(base_dir), step=1,
                           trained_offsets={"samples:0": 8},
                           consumed_offsets={"samples:0": [0, 8]}, metrics={"loss": 0.1}, adapter=adapter)


def _data_bytes(path: Path) -> int:
    """Bytes of a safetensors file's tensors (the file less its 8-byte length and JSON header)."""
    with open(path, "rb") as f:
        header = struct.unpack("<Q", f.read(8))[0]
    return path.stat().st_size - 8 - header


def test_an_adapter_checkpoint_holds_only_the_adapter(base_dir, base_id, tmp_path):
    engine = _lora_engine(base_dir)
    train_update(engine, _samples())
    out = tmp_path / "000001"
    m = _publish(engine, base_dir, out)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                     "manifest.json"]
    assert checkpoint.verify_manifest(out) == m
    assert m["adapter"] == SPEC and m["base_model"] == base_id and lora.is_adapter(m)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (RANK, ALPHA, base_id)
    assert sorted(cfg["target_modules"]) == sorted(SPEC["target_modules"])
    # sizes: the adapter's tensors are 4 bytes x 4,352 parameters; the full model's 4 x 23,904 (two
    # 48 x 32 embeddings, per layer 7 projections, q/k/v biases and 2 norms, the final norm)
    full = tmp_path / "full"
    save_checkpoint(load_model(base_dir), base_dir, full, run="unit", version=1, parent_version=0,
                    base_model=base_id, step=1, trained_offsets={}, metrics={})
    adapter_bytes = (out / "adapter_model.safetensors").stat().st_size
    full_bytes = (full / "model.safetensors").stat().st_size
    assert _data_bytes(out / "adapter_model.safetensors") == 4 * _adapter_parameters()
    full_params = sum(p.numel() for p in load_model(base_dir).parameters())
    assert _data_bytes(full / "model.safetensors") == 4 * full_params == 4 * 23_904
    print(f"tiny Qwen2 (rank {RANK}, 7 projections x {LAYERS} layers): adapter_model.safetensors {adapter_bytes} B, "
          f"model.safetensors {full_bytes} B ({adapter_bytes / full_bytes:.3f})")
    assert not lora.is_adapter(checkpoint.verify_manifest(full)) and "adapter" not in checkpoint.verify_manifest(full)
    with pytest.raises(ValueError, match="adapter"):  # a peft model needs its spec in the manifest
        _publish(engine, base_dir, tmp_path / "x", adapter=None)
    # what the trainer resumes from: the same policy, to the bit
    again = load_model(base_dir, adapter=SPEC, adapter_dir=out).eval()
    engine.module.eval()
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, engine.module(input_ids=ids).logits)


def test_resume_loads_the_adapter_and_refuses_adapters_that_do_not_fit(monkeypatch, tmp_path, base_dir, base_id):
    engine = _lora_engine(base_dir)
    train_update(engine, _samples())
    good, other_base = tmp_path / "000001", tmp_path / "000002"
    _publish(engine, base_dir, good)
    _publish(engine, base_dir, other_base, base_model="another base model")
    t = _trainer(monkeypatch, tmp_path, base_dir, lora_rank=RANK, lora_alpha=ALPHA)
    t.model_dir = good  # what resume() sets: the newest checkpoint, here an adapter of this base
    t.load_policy()
    trained, resumed = _named(engine.module), _named(t.engine.module)
    assert resumed.keys() == trained.keys() and all(torch.equal(resumed[n], trained[n]) for n in trained)
    for model_dir, cfg, match in [(other_base, {"lora_rank": RANK, "lora_alpha": ALPHA}, "trained on base model"),
                                  (good, {"lora_rank": 8, "lora_alpha": ALPHA}, "rank 4 != 8"),
                                  (good, {}, "is a LoRA adapter checkpoint")]:
        t = _trainer(monkeypatch, tmp_path, base_dir, **cfg)
        t.model_dir = model_dir
        with pytest.raises(ValueError, match=match):
            t.load_policy()
    full = tmp_path / "full"
    save_checkpoint(load_model(base_dir), base_dir, full, run="unit", version=1, parent_version=0,
                    base_model=base_id, step=1, trained_offsets={}, metrics={})
    t = _trainer(monkeypatch, tmp_path, base_dir, lora_rank=RANK)
    t.model_dir = full
    with pytest.raises(ValueError, match="holds full weights"):
        t.load_policy()
    t = _trainer(monkeypatch, tmp_path, full, lora_rank=RANK)  # a checkpoint as LoRA's base: refused
    with pytest.raises(ValueError, match="is a checkpoint, not a base model"):
        t.load_policy()


# ---- merging (pure) -------------------------------------------------------------------

def test_merge_lora_hand_computed_and_errors():
    w = {"l.weight": torch.zeros(2, 3), "other.weight": torch.ones(1)}
    a, b = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1.0], [2.0]])
    merged = lora.merge_lora(w, {"l.weight": (a, b), "elsewhere.weight": (a, b)}, 0.5)
    assert torch.equal(merged["l.weight"], torch.tensor([[0.5, 1.0, 1.5], [1.0, 2.0, 3.0]]))
    assert merged["other.weight"] is w["other.weight"] and torch.equal(w["l.weight"], torch.zeros(2, 3))
    with pytest.raises(ValueError, match="do not fit W"):
        lora.merge_lora(w, {"l.weight": (a.T, b)}, 0.5)
    pre = lora.PEFT_PREFIX + "model.layers.0.self_attn.q_proj"
    assert lora.lora_pairs({pre + ".lora_A.weight": a, pre + ".lora_B.weight": b}) == {
        "model.layers.0.self_attn.q_proj.weight": (a, b)}
    with pytest.raises(ValueError, match="without their other half"):
        lora.lora_pairs({pre + ".lora_A.weight": a})
    with pytest.raises(ValueError, match="not a LoRA A/B weight"):
        lora.lora_pairs({pre + ".lora_magnitude_vector": a})
    assert lora.adapter_scale({"r": 4, "lora_alpha": 8}) == 2.0
    assert lora.adapter_scale({"r": 4, "lora_alpha": 8, "use_rslora": True}) == 4.0
    with pytest.raises(ValueError, match="use_dora"):
        lora.adapter_scale({"r": 4, "lora_alpha": 8, "use_dora": True})


def test_the_merged_model_computes_what_the_peft_model_computes(base_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = _lora_engine(base_dir, lr=5e-2)
    for _ in range(3):
        train_update(engine, _samples())
    ckpt = tmp_path / "000001"
    _publish(engine, base_dir, ckpt)
    out = lora.merge_adapter_dir(base_dir, ckpt, tmp_path / "000001.merged")
    assert sorted(p.name for p in out.iterdir()) == sorted([p.name for p in base_dir.iterdir()] + [lora.MERGED_FROM])
    for name in ("config.json", "tokenizer.json", "spanrl_base.json"):
        assert (out / name).read_bytes() == (base_dir / name).read_bytes()
    assert lora.merged_is_current(out, base_dir, ckpt) and not lora.merged_is_current(out, tmp_path, ckpt)
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    peft_model = engine.module.eval()
    ids = _ids()
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        base_logits = load_model(base_dir).eval()(input_ids=ids).logits
    assert (want - got).abs().max() < 1e-5
    assert (want - base_logits).abs().max() > 1e-3  # the adapter is in the merged weights
    # the same weights as peft's own merge_and_unload
    peft_merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    for n, p in merged.state_dict().items():
        assert torch.allclose(p, peft_merged[n], atol=1e-6), n
