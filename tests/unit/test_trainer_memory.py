"""Issue 20 item 0: the trainer's memory follows the model, not the batch, and its rendezvous
listens on loopback. Chunked log-probs (losses.chunked_token_logprobs) and activation
checkpointing change no update: the same loss and weights as the full-logits path on a tiny
Qwen2 through the trainer's own engine (spanrl.trainer.train.build_engine / train_update)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deepspeed  # noqa: E402,F401  (installed by infra/bootstrap.sh)
from test_learning import rollout, tiny_model  # noqa: E402
from tiny_models import tiny_qwen2  # noqa: E402

from spanrl.trainer import losses  # noqa: E402
from spanrl.trainer.train import (BUCKET_ELEMENTS, LOGPROB_CHUNK, TrainerConfig, build_engine,  # noqa: E402
                                  deepspeed_config, load_model, load_reference_model, rendezvous_bind_address,
                                  train_update)

REPO = Path(__file__).resolve().parents[2]


def _update(base, samples, *, ref=None, checkpointing=False, zero_stage=2, **kw):
    model = copy.deepcopy(base)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = build_engine(model, lr=1e-3, micro_batch=64, zero_stage=zero_stage)
    metrics = train_update(engine, samples, micro_batch=64, ref_model=ref, kl_coef=0.1 if ref else 0.0, **kw)
    return metrics, dict(engine.module.named_parameters())


def test_chunked_logprobs_and_checkpointing_leave_the_update_unchanged():
    gen = torch.Generator().manual_seed(3)
    base = tiny_model(3)
    samples, _ = rollout(base, gen, 0)
    ref = copy.deepcopy(base).eval().requires_grad_(False)
    m_full, w_full = _update(base, samples, ref=ref, logprob_chunk=0)  # the path before issue 20
    runs = [_update(base, samples, ref=ref, logprob_chunk=5),  # 5 positions per chunk, uneven last one
            _update(base, samples, ref=ref, logprob_chunk=LOGPROB_CHUNK, checkpointing=True),
            _update(base, samples, ref=ref, logprob_chunk=0, micro_batch_tokens=40, checkpointing=True)]
    for m, w in runs:
        for key in ("loss", "approx_kl", "ref_kl", "clip_frac"):
            assert m[key] == pytest.approx(m_full[key], abs=1e-6), key
        # Adam's first step moves each weight by about lr * g / (|g| + eps): for the few elements
        # whose gradient is near eps, float noise in g shows as ~1e-6 in the weight (seen once
        # under load: 1.3e-6); a wrong gradient moves weights by ~lr = 1e-3
        for n, p in w_full.items():
            assert torch.allclose(w[n], p, atol=1e-5), n
    assert any(not torch.equal(a, w_full[n]) for n, a in base.named_parameters())  # a step was taken


def test_zero_stage_0_gives_the_update_of_stage_2():
    """One rank without ZeRO (no master copy of the weights, no flattened gradients: ~1 GB less
    at the peak for SmolLM2, trainer/README.md "Memory") takes the same step, and reports the
    gradient norm DeepSpeed keeps only under ZeRO."""
    gen = torch.Generator().manual_seed(5)
    base = tiny_model(5)
    samples, _ = rollout(base, gen, 0)
    m2, w2 = _update(base, samples)
    m0, w0 = _update(base, samples, zero_stage=0)
    for key in ("loss", "approx_kl", "clip_frac"):
        assert m0[key] == pytest.approx(m2[key], abs=1e-6), key
    assert m2["grad_norm"] is not None and m0["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    for n, p in w2.items():
        assert torch.allclose(w0[n], p, atol=1e-5), n
    assert any(not torch.equal(a, w2[n]) for n, a in base.named_parameters())


def _saved_bytes(model, ids) -> int:
    """Bytes autograd keeps for backward (parameters excluded) after one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum()
    return sum(v for k, v in saved.items() if k not in params)


def test_activation_checkpointing_setting_is_read_and_keeps_fewer_activations(tmp_path, monkeypatch):
    tiny_qwen2(64, 64, 0).save_pretrained(tmp_path)
    monkeypatch.setenv("SPANRL_TRAINER_ACTIVATION_CHECKPOINTING", "false")
    assert TrainerConfig().activation_checkpointing is False
    monkeypatch.delenv("SPANRL_TRAINER_ACTIVATION_CHECKPOINTING")
    assert TrainerConfig().activation_checkpointing is True  # the default
    plain, ckpt = load_model(tmp_path), load_model(tmp_path, activation_checkpointing=True)
    assert (plain.is_gradient_checkpointing, ckpt.is_gradient_checkpointing) == (False, True)
    assert load_reference_model(tmp_path).is_gradient_checkpointing is False
    plain.train(), ckpt.train()
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    kept_plain, kept_ckpt = _saved_bytes(plain, ids), _saved_bytes(ckpt, ids)
    assert kept_ckpt < kept_plain / 3, (kept_ckpt, kept_plain)


def test_logprob_chunk_setting_default_and_env(monkeypatch):
    assert TrainerConfig().logprob_chunk == LOGPROB_CHUNK == 256
    monkeypatch.setenv("SPANRL_TRAINER_LOGPROB_CHUNK", "0")
    assert TrainerConfig().logprob_chunk == 0


def test_deepspeed_buckets_are_small():
    zero = deepspeed_config(8, 1.0, 1e-5, 0.0, zero_stage=2)["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == BUCKET_ELEMENTS == 20_000_000


@pytest.mark.parametrize("addr, expected", [
    (None, "127.0.0.1"), ("", "127.0.0.1"), ("localhost", "127.0.0.1"), ("LOCALHOST", "127.0.0.1"),
    ("127.0.0.1", "127.0.0.1"), ("127.0.1.1", "127.0.0.1"), ("::1", "::1"), ("[::1]", "::1"),
    ("10.0.0.5", "10.0.0.5"), ("fd00::5", "fd00::5"), ("trainer-0.svc", "trainer-0.svc"),
])
def test_rendezvous_bind_address(addr, expected):
    assert rendezvous_bind_address(addr) == expected


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", "[::]"])
def test_rendezvous_refuses_unspecified_addresses(addr):
    with pytest.raises(ValueError, match="not an address peers can reach"):
        rendezvous_bind_address(addr)


LISTENERS = r'''
import os, sys
from spanrl.trainer.train import init_distributed
init_distributed()
links = []
for fd in os.listdir("/proc/self/fd"):
    try:
        links.append(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # the listing's own descriptor, closed by now
        pass
inodes = {link[8:-1] for link in links if link.startswith("socket:")}
for name in ("tcp", "tcp6"):
    for line in open(f"/proc/net/{name}").read().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in inodes:  # LISTEN, this process's socket
            print("LISTEN", name, f[1])
'''


def test_rendezvous_listens_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", LISTENERS], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    pairs = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("LISTEN ")]
    assert pairs, out.stdout  # the store at least
    for family, local in pairs:  # /proc/net: hex address:port; 0100007F = 127.0.0.1
        ip = local.split(":")[0]
        assert ip in ("0100007F", "00000000000000000000000001000000"), (family, local)


@pytest.mark.parametrize("temperature", [None, 0.7])  # 0.7: SPANRL_ROLLOUT_TEMPERATURE's scaling
def test_chunked_token_logprobs_equals_token_logprobs_values_and_gradients(temperature):
    torch.manual_seed(0)
    B, T, H, V = 3, 9, 6, 13
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    ids = torch.randint(0, V, (B, T))
    mask = torch.zeros(B, T)
    mask[:, 5:] = 1.0
    mask[2, 8] = 0.0  # a padded tail
    mask[1, 3:] = 1.0  # a longer completion
    g = torch.randn(B, T)
    full = losses.token_logprobs(hidden @ weight.T, ids, mask, temperature)
    g_full = torch.autograd.grad((full * g).sum(), (hidden, weight))
    for chunk in (1, 4, 1000):
        out = losses.chunked_token_logprobs(hidden, weight, ids, mask, chunk, temperature)
        assert out.dtype == torch.float32 and out.shape == (B, T)
        assert torch.allclose(out, full, atol=1e-5)
        assert torch.equal(out == 0, full == 0)  # zero off the completion
        for a, b in zip(torch.autograd.grad((out * g).sum(), (hidden, weight)), g_full):
            assert torch.allclose(a, b, atol=1e-5)


def test_chunked_token_logprobs_exact_value_and_errors():
    # V = 2, logits [0, log 3] at position 0 -> log p(token 1) = log 3 - log 4 = log 0.75
    hidden = torch.tensor([[[1.0], [0.0]]])
    weight = torch.tensor([[0.0], [torch.log(torch.tensor(3.0)).item()]])
    out = losses.chunked_token_logprobs(hidden, weight, torch.tensor([[0, 1]]), torch.tensor([[0.0, 1.0]]), 1)
    assert out.tolist()[0][0] == 0.0 and out.tolist()[0][1] == pytest.approx(-0.2876821, abs=1e-6)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        losses.chunked_token_logprobs(hidden, weight, torch.tensor([[0, 1]]), torch.tensor([[0.0, 1.0]]), 0)


def test_the_services_torch_work_runs_on_one_thread(tmp_path):
    """Updates, loads and checkpoint saves run on the trainer's one torch thread (one malloc
    arena), also while other work keeps asyncio's default pool busy."""
    import asyncio
    import threading

    from spanrl.trainer import train

    t = train.Trainer(TrainerConfig(run="unit", http=False, log_path=tmp_path / "t.jsonl"))

    def where(tag: str) -> tuple[str, int, str]:
        return tag, threading.get_ident(), threading.current_thread().name

    async def main():
        busy = [asyncio.to_thread(threading.Event().wait, 0.05) for _ in range(4)]
        ran = await asyncio.gather(*busy, *(t.on_torch_thread(where, tag=f"u{i}") for i in range(6)))
        return ran[4:]

    ran = asyncio.run(main())
    assert [tag for tag, _, _ in ran] == [f"u{i}" for i in range(6)]
    assert len({ident for _, ident, _ in ran}) == 1 and ran[0][2].startswith("spanrl-torch")
    t.torch_thread.shutdown()
